"""Issue 34 item 4: FedTGP logs its adaptive margin delta(t) = min(distance, tau) every round as server metrics --
``tgp_margin`` (delta), ``tgp_max_dist`` (the distance before the cap) and ``tgp_margin_capped`` (1 when tau binds) --
so a run shows whether the margin adapts or is pinned at tau."""
import math

import pytest
import torch

import raysim.rng as rngmod
from raysim.algorithm import ServerContext
from raysim.runner.runners import make_algorithm
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare


def _algo(tiny, params):
    prep = prepare(tiny(algorithm={"name": "fedtgp", "params": params}))
    return make_algorithm(prep.spec), prep


def _uploads(d):
    """tests/test_faithful.py's two clients: Q_0 = (0, 0), Q_1 = (3, 0), Q_2 = (0, 4) in the first two coordinates.
    By hand: ||Q_0 - Q_1|| = 3, ||Q_0 - Q_2|| = 4, ||Q_1 - Q_2|| = 5."""
    from tests.test_faithful import _tgp_uploads

    return _tgp_uploads(d)


@pytest.mark.parametrize("params, delta, distance, capped", [
    # the seed's formula (default): largest pairwise distance = 5; tau 100 leaves it free
    ({}, 5.0, 5.0, 0.0),
    # tau 4.5 < 5: pinned at tau
    ({"margin_threshold": 4.5}, 4.5, 5.0, 1.0),
    # tau equal to the distance: delta = tau = distance, counted as capped
    ({"margin_threshold": 5.0}, 5.0, 5.0, 1.0),
    # the official code's formula: max over classes of the nearest other centre = max(3, 3, 4) = 4 < tau 4.5
    ({"margin_threshold": 4.5, "margin": "code"}, 4.0, 4.0, 0.0),
    # tau 1 (the value of the issue-10 runs): pinned
    ({"margin_threshold": 1.0}, 1.0, 5.0, 1.0),
])
def test_fedtgp_logs_delta_distance_and_cap_by_hand(tiny, params, delta, distance, capped):
    algo, prep = _algo(tiny, {"server_epochs": 0, **params})
    ctx = ServerContext(0, rngmod.SERVER, prep.task.seed, torch.device("cpu"), prep.task)
    _, m = algo.aggregate(algo.init_server_state(ctx), _uploads(prep.task.build_model(0).embed_dim), ctx)
    assert m["tgp_margin"] == pytest.approx(delta)
    assert m["tgp_max_dist"] == pytest.approx(distance)
    assert m["tgp_margin_capped"] == capped


@pytest.mark.parametrize("tau, pinned", [(1e-3, True), (1e6, False)])
def test_fedtgp_delta_is_a_server_metric_of_every_round(tiny, tmp_path, tau, pinned):
    rounds = 3
    cfg = tiny(rounds=rounds, algorithm={"name": "fedtgp", "params": {"server_epochs": 1, "margin_threshold": tau}})
    t = run_experiment(cfg, out_dir=tmp_path / "run").table
    rows = {}
    for name in ("tgp_margin", "tgp_max_dist", "tgp_margin_capped"):
        sel = t[t.metric == name].sort_values("round")
        assert list(sel["round"]) == list(range(rounds)), name  # one value per round
        rows[name] = [float(v) for v in sel["value"]]
    for delta, dist, capped in zip(rows["tgp_margin"], rows["tgp_max_dist"], rows["tgp_margin_capped"]):
        assert dist > 0 and math.isfinite(dist)
        assert delta == pytest.approx(min(dist, tau))
        assert capped == (1.0 if pinned else 0.0)
