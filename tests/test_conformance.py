"""Conformance suite: every registered algorithm runs end to end on tiny data with finite metrics and picklable
state, gives an identical table for the same seed, with every client state spilled to disk (state_memory_mb: 0),
after a resume from a checkpoint, and (Ray tests) on the Ray backend with 1 and 2 actors; and survives an
aggregation round with no uploads."""
import math
import pickle

import pandas as pd
import pytest

from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.registry import ALGORITHMS
from raysim.engine.runners import ClientRunner, ServerRunner
from raysim.steps import CLASSIC_ROUND, EVALUATION

NAMES = sorted(n for n, target in ALGORITHMS.items() if target.startswith("algorithms."))  # the shipped methods


def same(a, b):
    """Identical tables but for the wall-time rows (round_s, step_s@*), which differ run to run."""
    pd.testing.assert_frame_equal(without_timing(a), without_timing(b))


_SEQUENTIAL: dict = {}  # method -> its sequential table (the conformance test's run, reused by the Ray test)


def sequential_table(tiny, name) -> pd.DataFrame:
    if name not in _SEQUENTIAL:
        _SEQUENTIAL[name] = run_experiment(cfg_for(tiny, name), write=False).table
    return _SEQUENTIAL[name].copy()


def cfg_for(tiny, name, **over):
    from tests.conftest import method_overrides

    return tiny(rounds=3, clients_per_round=4, algorithm={"name": name, "params": {}}, **{**method_overrides(name), **over})


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_conformance(tiny, name, tmp_path):
    cfg = cfg_for(tiny, name)
    a = run_experiment(cfg, write=False)
    _SEQUENTIAL[name] = a.table
    b = run_experiment(cfg, write=False)
    same(a.table, b.table)
    vals = a.table["value"]
    assert all(math.isfinite(v) for v in vals), a.table[~vals.map(math.isfinite)]
    assert (a.table["metric"] == "test_acc").any()
    # every state spilled to disk after each commit: identical
    spilled = run_experiment(cfg_for(tiny, name, backend={"name": "sequential", "state_memory_mb": 0,
                                                          "state_dir": str(tmp_path / "states")}), write=False)
    same(a.table, spilled.table)
    # stop after 2 rounds (checkpoint every round), resume to 3: identical to the uninterrupted run
    short = cfg_for(tiny, name, output={"progress": False, "checkpoint_every": 1})
    short = type(short)(**{**short.__dict__, "rounds": 2})
    run_experiment(short, out_dir=tmp_path / "run")
    resumed = run_experiment(cfg_for(tiny, name, output={"progress": False, "checkpoint_every": 1}),
                             resume=tmp_path / "run")
    same(a.table.drop(columns="run_id"), resumed.table.drop(columns="run_id"))

    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    pickle.dumps(server.state)
    pickle.dumps([clients.state(c) for c in clients.client_ids()])
    # a round in which nobody uploads (everyone dropped) leaves the server usable
    payload, _ = server.run_server_step(CLASSIC_ROUND[1], 0, 0, [], {}, keep=[])
    payload = payload if payload is not None else server.initial_payload(1)
    pickle.dumps(payload)
    _, reports = clients.run_client_step(EVALUATION[0], payload, 1, 0, clients.client_ids())
    assert all(r.ok for r in reports), [r.error for r in reports if not r.ok]


@pytest.mark.ray
@pytest.mark.parametrize("name", NAMES)
def test_sequential_equals_ray_for_every_method(ray_session, tiny, name):
    seq = sequential_table(tiny, name)
    for actors in (1, 2):
        r = run_experiment(cfg_for(tiny, name, backend={"name": "ray", "num_actors": actors, "num_cpus": 1,
                                                        "state_memory_mb": 0 if actors == 2 else 1024}),
                           write=False).table
        same(seq, r)
