"""Conformance suite: every registered algorithm runs end to end on tiny data with finite metrics, picklable state,
an identical table for the same seed, and survives an aggregation round with no uploads."""
import math
import pickle

import pandas as pd
import pytest

from raysim import rng as rngmod
from raysim.algorithm import Context
from raysim.registry import ALGORITHMS
from raysim.runtime import ClientRunner, ServerRunner
from raysim.server import prepare, run_experiment

NAMES = sorted(n for n in ALGORITHMS if not n.startswith("failing"))


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_conformance(tiny, name):
    cfg = tiny(rounds=2, algorithm={"name": name, "params": {}})
    a = run_experiment(cfg, write=False)
    b = run_experiment(cfg, write=False)
    pd.testing.assert_frame_equal(a.table, b.table)
    vals = a.table["value"]
    assert all(math.isfinite(v) for v in vals), a.table[~vals.map(math.isfinite)]
    assert (a.table["metric"] == "test_acc").any()

    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    pickle.dumps(server.get_state())
    pickle.dumps(clients.get_states())
    # a round in which nobody uploads (everyone dropped) leaves the server usable
    server.aggregate(0, [], {})
    payload = server.broadcast(1)
    pickle.dumps(payload)
    reports = clients.evaluate(payload, 1, clients.client_ids())
    assert all(r.ok for r in reports), [r.error for r in reports if not r.ok]
