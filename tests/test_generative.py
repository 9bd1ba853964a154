"""Issue 15: SCAFFOLD, MOON, SlaugFL, FedGen, VHL — the maths against hand-computed numbers, message sizes, and
sequential == ray (the Ray part also runs for every method in tests/test_conformance.py)."""
import math

import pandas as pd
import pytest
import torch

from raysim.config import ConfigError, make_config
from raysim.driver import run_experiment
from tests.conftest import tiny_config


def run(name, params=None, **over):
    return run_experiment(make_config(tiny_config(algorithm={"name": name, "params": params or {}}, **over)),
                          write=False).table


def total(table, metric, round_idx=None):
    t = table[(table["scope"] == "total") & (table["metric"] == metric)]
    if round_idx is not None:
        t = t[t["round"] == round_idx]
    return float(t["value"].sum())


def mlp_floats(in_dim=64, hidden=32, embed=16, classes=10):
    return in_dim * hidden + hidden + hidden * embed + embed + embed * classes + classes


# -- SCAFFOLD ---------------------------------------------------------------------------------------------------------
def test_scaffold_effective_steps_and_control_update_by_hand():
    from algorithms.scaffold import control_update, effective_steps, server_update

    assert effective_steps(3, 0.0) == 3.0
    assert effective_steps(2, 0.5) == pytest.approx(1.0 + 1.5)  # (1-.5)/.5 + (1-.25)/.5
    t = lambda v: {"w": torch.tensor([v])}
    # c_i+ = c_i - c + (x - y) / (K lr) = 0.1 - 0.3 + 0.6 / (3 * 0.1) = 1.8
    assert float(control_update(t(0.1), t(0.3), t(1.0), t(0.4), 3.0, 0.1)["w"]) == pytest.approx(1.8)
    # x + lr_g * mean(dy) = 1 + 0.5 * (0.2 + 0.4) / 2 = 1.15; c + sum(dc) / N = 0.3 + (0.1 + 0.5) / 4 = 0.45
    x, c = server_update(t(1.0), t(0.3), [t(0.2), t(0.4)], [t(0.1), t(0.5)], 4, 0.5)
    assert float(x["w"]) == pytest.approx(1.15) and float(c["w"]) == pytest.approx(0.45)


def test_scaffold_one_full_batch_step_gives_the_local_gradient():
    """With one plain-SGD step on the full batch, y = x - lr (g(x) + c - c_i), so option II gives c_i+ = g(x):
    the correction has the right sign and K_eff is right."""
    from algorithms.scaffold import Scaffold
    from raysim.driver import prepare
    from raysim.runtime import ClientRunner, ServerRunner
    from raysim.messages import state_message

    cfg = make_config(tiny_config(algorithm={"name": "scaffold", "params": {}},
                                  train={"local_epochs": 1, "batch_size": 1000, "lr": 0.1, "momentum": 0.0}))
    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    alg: Scaffold = clients.algorithm
    payload = server.initial_payload(0)
    g = torch.Generator().manual_seed(3)
    control = {n: 0.01 * torch.randn(v.shape, generator=g) for n, v in payload["control"].tensors.items()}
    payload = {**payload, "control": state_message("control_variate", control)}
    cid = clients.client_ids()[0]
    c_i = {n: 0.02 * torch.randn(v.shape, generator=g) for n, v in control.items()}
    state = {"control": c_i}
    data = clients._data(cid)
    ctx = clients._ctx(0, cid, "update")
    res = alg.client_update(payload, state, data, ctx)
    model = alg.task.build_model(cid)
    model.load_state_dict(payload["model"].tensors)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(data.x_train), data.y_train)  # the mlp has no dropout
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    for n, gr in grads.items():
        torch.testing.assert_close(res.state["control"][n], gr, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.upload["delta_c"][n], gr - c_i[n], rtol=1e-4, atol=1e-5)


def test_scaffold_accounting_doubles_fedavg():
    sc, fa = run("scaffold"), run("fedavg")
    w = mlp_floats()
    for t in (sc,):
        per_round = total(t, "participants", 0)
        assert total(t, "up_floats", 0) == 2 * w * per_round
        assert total(t, "down_floats", 0) == 2 * w * per_round
    assert total(fa, "down_floats", 0) == w * total(fa, "participants", 0)


def test_scaffold_bad_input():
    with pytest.raises(ConfigError, match="server_lr"):
        run("scaffold", {"server_lr": -1.0})


# -- MOON -------------------------------------------------------------------------------------------------------------
def test_moon_contrastive_by_hand():
    from algorithms.moon import moon_contrastive

    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    zg = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    zp = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    # sample 1: pos cos 1, neg cos 0 -> log(1 + e^{(0-1)/0.5}); sample 2: pos cos 1/sqrt2, neg cos 1
    l1 = math.log(1 + math.exp(-2.0))
    l2 = math.log(1 + math.exp((1.0 - 1 / math.sqrt(2)) / 0.5))
    assert float(moon_contrastive(z, zg, zp, 0.5)) == pytest.approx((l1 + l2) / 2, rel=1e-6)
    # identical references: log 2 whatever z is
    assert float(moon_contrastive(z, zg, zg, 0.7)) == pytest.approx(math.log(2), rel=1e-6)


def test_moon_keeps_the_previous_model_in_client_state_and_sends_fedavg_traffic():
    t = run("moon", {"mu": 1.0, "tau": 0.5})
    fa = run("fedavg")
    for m in ("up_floats", "down_floats"):
        assert total(t, m) == total(fa, m)
    con = t[(t["metric"] == "train_con") & (t["scope"] == "client")]
    first = con[con["round"] == 0]["value"]
    assert (first - math.log(2)).abs().max() < 1e-6  # first round: previous model = global model
    assert (con[con["round"] == 2]["value"] - math.log(2)).abs().max() > 1e-4  # later: a real previous model
    with pytest.raises(ConfigError, match="tau"):
        run("moon", {"tau": 0.0})
