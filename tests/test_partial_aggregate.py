"""Partial aggregates (``backend.partial_aggregate``): each client runner merges its clients' uploads into one when
the method's server step declares a merge. One runner (the sequential backend, Ray with one actor): the table is
the table without merging, bit for bit; several actors: within the stated tolerance; the accounted per-client
messages never change; what travels through Ray's object store per round is counted and drops to one upload per
actor."""
import pandas as pd
import pytest
import torch

from raysim.algorithm import upload_merger
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare
from raysim.runner.runners import make_algorithm
from raysim.io.results import without_timing
from raysim.messages import Message, tensor_bytes
from raysim.steps import CLASSIC_ROUND
from tests.conftest import method_overrides

MERGED = ["fedavg", "fedprox", "fedper", "lgfedavg", "fedproto"]


def _over(name, **more):
    return {**method_overrides(name), "algorithm": {"name": name, "params": {}}, "rounds": 3, "clients_per_round": 5,
            **more}


def table(cfg):
    """The table without wall time and run id (partial_aggregate is part of the run's identity)."""
    return without_timing(run_experiment(cfg, write=False).table).drop(columns="run_id")


def _algorithm(tiny, name, **params):
    prep = prepare(tiny(**dict(method_overrides(name), algorithm={"name": name, "params": params})))
    return make_algorithm(prep.spec)


@pytest.mark.parametrize("name", MERGED)
def test_one_runner_merging_gives_the_table_bit_for_bit(tiny, name):
    """The sequential backend hosts every client in one runner: its one merged upload is what the server step
    would have computed from the per-client uploads, so the table (message accounting included) is unchanged."""
    plain = table(tiny(**_over(name, backend={"name": "sequential", "partial_aggregate": False})))
    merged = table(tiny(**_over(name, backend={"name": "sequential", "partial_aggregate": True})))
    pd.testing.assert_frame_equal(plain, merged, check_exact=True)
    pd.testing.assert_frame_equal(plain, table(tiny(**_over(name))), check_exact=True)  # auto (the default) merges


def test_which_methods_merge(tiny):
    """A merge applies where the class defining it also defines (or inherits from below) the aggregation: FedAvg,
    FedProx (FedAvg's aggregate), FedPer, LG-FedAvg, FedProto with the paper's weighted rule; not SCAFFOLD or VHL
    (they override FedAvg's aggregate), not FedTGP (a server-trained generator), not FedProto's ``mean`` rule."""
    server_step = CLASSIC_ROUND[1]
    for name in MERGED:
        assert upload_merger(_algorithm(tiny, name), server_step) is not None, name
    for name in ("scaffold", "vhl", "fedtgp", "local"):
        assert upload_merger(_algorithm(tiny, name), server_step) is None, name
    proto_mean = _algorithm(tiny, "fedproto", proto_agg="mean")
    assert proto_mean.merge_uploads({0: None, 1: None}) is None


def _weights(values, n):
    return {"model": Message("weights", {"w": torch.tensor(values, dtype=torch.float32)}),
            "num_samples": Message("num_samples", {"n": torch.tensor([n], dtype=torch.int64)})}


def test_fedavg_partials_combine_to_the_weighted_average(tiny):
    """Hand-computed: clients (w, n) = ([1, 2], 1), ([4, 8], 3), ([10, 0], 4); all: (1*[1,2] + 3*[4,8] + 4*[10,0]) / 8
    = [6.625, 3.25]. Partials {0, 1} -> ([3.25, 6.5], 4) and {2} -> itself; their weighted average: the same."""
    algo = _algorithm(tiny, "fedavg")
    ups = {0: _weights([1.0, 2.0], 1), 1: _weights([4.0, 8.0], 3), 2: _weights([10.0, 0.0], 4)}
    part = algo.merge_uploads({0: ups[0], 1: ups[1]})
    assert part["model"].kind == "weights" and int(part["num_samples"]["n"][0]) == 4
    assert part["model"]["w"].tolist() == [3.25, 6.5]
    state, _ = algo.aggregate({}, {0: part, 2: ups[2]}, None)
    assert state["model"]["w"].tolist() == [6.625, 3.25]
    full, _ = algo.aggregate({}, ups, None)
    assert torch.equal(full["model"]["w"], state["model"]["w"])


def test_fedproto_partials_keep_per_class_counts(tiny):
    """Hand-computed weighted prototypes: client 0 has class 0 (n=1, p=[2]) and class 1 (n=2, p=[4]); client 1 has
    class 1 (n=2, p=[8]). Merged: class 0 -> ([2], 1), class 1 -> ((2*4 + 2*8) / 4 = [6], 4)."""
    algo = _algorithm(tiny, "fedproto")
    d = algo.embed_dim()

    def up(classes, protos, counts):
        p = torch.zeros(len(classes), d)
        p[:, 0] = torch.tensor(protos)
        return {"protos": Message("prototypes", {"protos": p, "classes": torch.tensor(classes),
                                                 "counts": torch.tensor(counts)})}

    merged = algo.merge_uploads({0: up([0, 1], [2.0, 4.0], [1, 2]), 1: up([1], [8.0], [2])})["protos"]
    assert merged["classes"].tolist() == [0, 1] and merged["counts"].tolist() == [1, 4]
    assert merged["protos"][:, 0].tolist() == [2.0, 6.0]


def test_tensor_bytes_counts_every_tensor():
    msg = Message("weights", {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int64)})
    assert tensor_bytes({"m": msg, "x": [torch.zeros(4, dtype=torch.float64)], "s": "text"}) == 12 + 16 + 32


@pytest.mark.ray
def test_ray_partial_aggregates_one_upload_per_actor(ray_session, tiny):
    """FedAvg on Ray with 2 actors: with partial aggregates a round's training traffic through the object store is
    one payload read and one upload per actor (<= 2 x actors x model bytes + the sample counts), against one upload
    per client without; the table stays within the stated tolerance of the per-client uploads' and its message
    accounting (client rows) is identical; with one actor ``auto`` merges and gives the sequential table bit for bit."""
    over = _over("fedavg", clients_per_round=6)
    plain = run_experiment(tiny(**over, backend={"name": "ray", "num_actors": 2, "num_cpus": 1}), write=False)
    part = run_experiment(tiny(**over, backend={"name": "ray", "num_actors": 2, "num_cpus": 1,
                                                "partial_aggregate": True}), write=False)
    model_bytes = tensor_bytes(make_algorithm(prepare(tiny(**over)).spec).task.build_model(0).state_dict())
    for res, per_round_up in ((plain, 6 * (model_bytes + 8)), (part, 2 * (model_bytes + 8))):
        rows = [r for r in res.metadata["object_store_bytes"] if r["round"] >= 0]
        assert len(rows) == 3
        for r in rows:
            assert r["train_down"] == 2 * model_bytes and r["train_up"] == per_round_up
    a, b = (without_timing(r.table).drop(columns="run_id") for r in (plain, part))
    bytes_rows = a["metric"].str.contains("bytes|floats")
    pd.testing.assert_frame_equal(a[bytes_rows], b[bytes_rows], check_exact=True)
    pd.testing.assert_series_equal(a["value"], b["value"], check_exact=False, atol=1e-4, rtol=0)
    # one actor: auto (the default) merges, and the table is the sequential one bit for bit; false sends every upload
    for mode, ups in (("auto", 1), (False, 6)):
        res = run_experiment(tiny(**over, backend={"name": "ray", "num_actors": 1, "num_cpus": 1,
                                                   "partial_aggregate": mode}), write=False)
        assert {r["train_up"] for r in res.metadata["object_store_bytes"] if r["round"] >= 0} == {ups * (model_bytes + 8)}
        pd.testing.assert_frame_equal(table(tiny(**over)), without_timing(res.table).drop(columns="run_id"),
                                      check_exact=True)
