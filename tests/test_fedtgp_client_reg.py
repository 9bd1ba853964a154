"""Issue 51 item 5: FedTGP's client regulariser as seed 002 states it (section 5 step 4,
L_i = CE + lambda E_{c ~ C_i}[phi(P_i^c, P'^c)], phi the Euclidean distance between the client's class prototype and
the global one) beside the official code's per-sample MSE (``client_reg: mse``, the default)."""
import math

import pytest
import torch

from algorithms.prototype_maths import prototype_distance_regulariser
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare
from raysim.runner.runners import make_algorithm
from raysim.errors import ConfigError
from raysim.shared_maths import prototype_regulariser

# a batch of 3 samples in d = 2, classes 0, 0, 1 of C = 3; global prototypes P'_0 = (1, 1), P'_1 = (0, 0),
# P'_2 = (5, 5). By hand: P_i^0 = mean((0, 0), (2, 0)) = (1, 0), ||(1, 0) - (1, 1)|| = 1; P_i^1 = (0, 3),
# ||(0, 3) - (0, 0)|| = 3; class 2 is not in the batch. The seed's term: (1 + 3) / 2 = 2.
# The official MSE: per sample (z - P'_y)^2 summed = 2, 2, 9 over 3 x 2 elements = 13 / 6.
Z = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
Y = torch.tensor([0, 0, 1])
P = torch.tensor([[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]])


def test_seed_regulariser_by_hand():
    assert float(prototype_distance_regulariser(Z, Y, P)) == pytest.approx(2.0)
    assert float(prototype_regulariser(Z, Y, P, None)) == pytest.approx(13 / 6)


def test_seed_regulariser_skips_classes_without_a_global_prototype():
    mask = torch.tensor([True, False, True])  # no global prototype of class 1: only class 0's distance, 1
    assert float(prototype_distance_regulariser(Z, Y, P, mask)) == pytest.approx(1.0)
    none = torch.tensor([False, False, True])  # no class of the batch has one: 0
    assert float(prototype_distance_regulariser(Z, Y, P, none)) == 0.0


def test_seed_regulariser_gradient_by_hand_and_finite_at_zero():
    z = Z.clone().requires_grad_(True)
    prototype_distance_regulariser(z, Y, P).backward()
    # d/dz_b of (1/2) ||mean_c - P'_c|| = (1/2) (1/n_c) (mean_c - P'_c) / ||.||: class 0 (n = 2): (1/4)(0, -1);
    # class 1 (n = 1): (1/2)(0, 3)/3 = (0, 1/2)
    assert torch.allclose(z.grad, torch.tensor([[0.0, -0.25], [0.0, -0.25], [0.0, 0.5]]))
    z0 = torch.tensor([[1.0, 1.0]], requires_grad=True)  # the class mean on its global prototype: distance 0
    prototype_distance_regulariser(z0, torch.tensor([0]), P).backward()
    assert torch.isfinite(z0.grad).all() and float(z0.grad.abs().sum()) == 0.0


def test_seed_regulariser_under_vmap_matches_the_loop():
    zs = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
    ys = torch.tensor([[0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0], [3, 1, 3, 1, 3, 1], [2, 2, 0, 0, 1, 3]])
    protos = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    batched = torch.func.vmap(lambda z, y: prototype_distance_regulariser(z, y, protos))(zs, ys)
    loop = torch.stack([prototype_distance_regulariser(z, y, protos) for z, y in zip(zs, ys)])
    assert torch.allclose(batched, loop)


@pytest.mark.parametrize("client_reg, expected", [("mse", 13 / 6), ("seed", 2.0)])
def test_fedtgp_uses_the_chosen_regulariser(tiny, client_reg, expected):
    prep = prepare(tiny(algorithm={"name": "fedtgp", "params": {"client_reg": client_reg}}))
    algo = make_algorithm(prep.spec)
    assert float(algo.client_regulariser(Z, Y, P, None)) == pytest.approx(expected)


def test_fedtgp_client_reg_default_is_the_official_mse_and_rejects_others(tiny):
    prep = prepare(tiny(algorithm={"name": "fedtgp", "params": {}}))
    assert make_algorithm(prep.spec).params.client_reg == "mse"
    with pytest.raises(ConfigError):
        prepare(tiny(algorithm={"name": "fedtgp", "params": {"client_reg": "l2"}}))


def test_fedtgp_seed_regulariser_runs_and_differs_from_mse(tiny, tmp_path):
    finals = {}
    for reg in ("mse", "seed"):
        cfg = tiny(rounds=3, algorithm={"name": "fedtgp", "params": {"server_epochs": 1, "client_reg": reg, "lam": 5.0}})
        t = run_experiment(cfg, out_dir=tmp_path / reg).table
        sel = t[(t.metric == "test_acc_proto") & (t.scope == "client")]
        assert len(sel) and all(math.isfinite(float(v)) for v in sel["value"])
        finals[reg] = t[t.metric == "tgp_max_dist"].sort_values("round")["value"].tolist()
    assert finals["mse"][0] == finals["seed"][0]  # round 0: no global prototypes yet, the same CE-only training
    assert finals["mse"][1:] != finals["seed"][1:]
