"""Hand-computed examples for the prototype-family maths (algorithms/prototype_maths.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms import prototype_maths as pm
from algorithms.fesem import fesem_step

# three class centres at distances d01 = 3, d02 = 4, d12 = 5
Q = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
ALL = torch.tensor([True, True, True])


def test_tgp_margin_code_and_paper():
    # code: gap = (min(3,4), min(3,5), min(4,5)) = (3, 3, 4) -> max 4; paper: largest pair distance 5
    assert pm.tgp_margin(Q, ALL, tau=100.0, mode="code") == pytest.approx(4.0)
    assert pm.tgp_margin(Q, ALL, tau=100.0, mode="paper") == pytest.approx(5.0)
    # the threshold tau caps both
    assert pm.tgp_margin(Q, ALL, tau=3.5, mode="code") == pytest.approx(3.5)
    assert pm.tgp_margin(Q, ALL, tau=3.5, mode="paper") == pytest.approx(3.5)
    # only classes 0 and 1 uploaded: one pair, distance 3
    two = torch.tensor([True, True, False])
    assert pm.tgp_margin(Q, two, tau=100.0, mode="code") == pytest.approx(3.0)
    assert pm.tgp_margin(Q, torch.tensor([True, False, False]), tau=100.0) == 0.0


def test_tgp_contrastive_loss_hand_example():
    # p = (0, 0) of class 0; distances to P = (0, 3, 4); delta = 1 -> logits (-1, -3, -4)
    # loss = -log(e^-1 / (e^-1 + e^-3 + e^-4)) = log(1 + e^-2 + e^-3)
    p = torch.tensor([[0.0, 0.0]])
    loss = pm.tgp_contrastive_loss(p, torch.tensor([0]), Q, delta=1.0)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-2) + math.exp(-3)), rel=1e-6)
    # two rows are averaged: add p = (3, 0) of class 1: distances (3, 0, 5) -> logits (-3, -1, -5)
    p2 = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    loss2 = pm.tgp_contrastive_loss(p2, torch.tensor([0, 1]), Q, delta=1.0)
    second = math.log(1 + math.exp(-2) + math.exp(-4))
    assert float(loss2) == pytest.approx((math.log(1 + math.exp(-2) + math.exp(-3)) + second) / 2, rel=1e-6)


def test_orthogonal_head_and_uh_logits():
    g = torch.Generator().manual_seed(0)
    w = pm.orthogonal_head(10, 50, g)
    assert w.shape == (10, 50)
    assert torch.allclose(w @ w.t(), torch.eye(10), atol=1e-5)
    # s * <z / ||z||, W_c>: z = (3, 4) -> (0.6, 0.8); W = I; s = 2 -> (1.2, 1.6)
    out = pm.uh_logits(torch.tensor([[3.0, 4.0]]), torch.eye(2), torch.tensor(2.0))
    assert torch.allclose(out, torch.tensor([[1.2, 1.6]]))
    with pytest.raises(ValueError):
        pm.orthogonal_head(10, 5, g)


def test_pu_loss_hand_example():
    # row 0 labelled y=0, logits (0, 0) -> p = (.5, .5); row 1 unlabelled, logits (ln 3, 0) -> p = (.75, .25)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    y_obs = torch.tensor([0, pm.UNLABELLED])
    prior = torch.tensor([0.4, 0.6])
    # L_U = 1/(1*2) * (-log .25 - log .75) ; L_Pc = 1/1 * 0.4 * -log .5
    l_u = 0.5 * (math.log(4.0) + math.log(4.0 / 3.0))
    l_pc = 0.4 * math.log(2.0)
    got = pm.pu_loss(logits, y_obs, prior, torch.tensor([1.0, 1.0]), eps=0.0)
    assert float(got) == pytest.approx(l_u - l_pc, rel=1e-6)
    # only class 0 positive: the unlabelled term keeps only c = 0
    got = pm.pu_loss(logits, y_obs, prior, torch.tensor([1.0, 0.0]), eps=0.0)
    assert float(got) == pytest.approx(0.5 * math.log(4.0) - l_pc, rel=1e-6)
    # the default eps = 1e-6 changes it by O(1e-6) only, and the labelled CE uses the labelled row alone
    assert float(pm.pu_loss(logits, y_obs, prior, torch.tensor([1.0, 1.0]))) == pytest.approx(l_u - l_pc, abs=1e-5)
    assert float(pm.labelled_ce(logits, y_obs)) == pytest.approx(math.log(2.0), rel=1e-6)


def test_pu_split_counts_prior_and_hidden_labels():
    y = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
    y_obs, prior, pos = pm.pu_split(y, [0, 1, 2], 4, pm.Labelling(0.5), np.random.default_rng(0))
    # labelled: floor(.5 * (4, 2, 4)) = (2, 1, 2); |U| = 5; prior = (2, 1, 2, 0) / 5
    assert [(y_obs == c).sum().item() for c in range(3)] == [2, 1, 2]
    assert (y_obs == pm.UNLABELLED).sum().item() == 5
    assert torch.allclose(prior, torch.tensor([0.4, 0.2, 0.4, 0.0]))
    assert pos.tolist() == [1.0, 1.0, 1.0, 0.0]
    lab = y_obs >= 0
    assert torch.equal(y_obs[lab], y[lab])  # kept labels are true labels; hidden ones are -1, never the label
    # rho = 0.1: at least one label per held class -> (1, 1, 1) labelled, |U| = 7
    y_obs, prior, _ = pm.pu_split(y, [0, 1, 2], 3, pm.Labelling(0.1), np.random.default_rng(0))
    assert (y_obs >= 0).sum().item() == 3
    assert torch.allclose(prior, torch.tensor([3 / 7, 1 / 7, 3 / 7]))
    # rho = 1: nothing hidden, prior 0 (so the PU term vanishes)
    y_obs, prior, _ = pm.pu_split(y, [0, 1, 2], 3, pm.Labelling(1.0), np.random.default_rng(0))
    assert torch.equal(y_obs, y) and float(prior.sum()) == 0.0
    # same stream -> same split
    a = pm.pu_split(y, [0, 1, 2], 3, pm.Labelling(0.5), np.random.default_rng(5))[0]
    b = pm.pu_split(y, [0, 1, 2], 3, pm.Labelling(0.5), np.random.default_rng(5))[0]
    assert torch.equal(a, b)


def test_proximal_term_hand_example():
    w = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    a = [torch.tensor([0.0, 0.0]), torch.tensor([[1.0]])]
    # mu/2 * (1 + 4 + 4) with mu = 0.5
    assert float(pm.proximal_term(w, a, 0.5)) == pytest.approx(0.25 * 9)


def test_fesem_step_hand_example():
    c0, c1, c2 = {"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([10.0, 10.0])}, {"w": torch.tensor([100.0, 100.0])}
    local = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([9.0, 10.0])}]
    centres, assign = fesem_step(local, [c0, c1, c2])
    assert assign.tolist() == [0, 0, 1]
    assert torch.allclose(centres[0]["w"], torch.tensor([0.5, 0.5]))  # plain average of the members
    assert torch.allclose(centres[1]["w"], torch.tensor([9.0, 10.0]))
    assert torch.equal(centres[2]["w"], c2["w"])  # nobody joined: unchanged


def test_distill_loss_hand_example():
    # f(x) = (0, 0) -> p = (.5, .5); global logits of class 0 = (ln 3, 0) -> q = (.75, .25)
    # KL(q || p) = .75 ln(.75/.5) + .25 ln(.25/.5)
    glob = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    logits = torch.zeros(2, 2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    mask = torch.tensor([True, False])
    # row 1 (class 1) has no global logit: contributes 0 but counts in the mean over 2 rows
    got = pm.distill_loss(logits, torch.tensor([0, 1]), glob, mask, temperature=1.0)
    assert float(got) == pytest.approx(kl / 2, rel=1e-6)
    sums, counts = pm.class_mean_logits(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), torch.tensor([0, 0, 1]), 3)
    assert counts.tolist() == [2, 1, 0]
    assert torch.allclose(sums[0], torch.tensor([4.0, 6.0], dtype=torch.float64))
