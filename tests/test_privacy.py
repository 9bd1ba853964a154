"""The privacy boundary: for every registered method, what reaches the server is only the message kinds the method
declares, never a client's data, and its size is exactly what the table accounts."""
import pytest

from raysim.driver import prepare, run_experiment
from raysim.registry import ALGORITHMS
from raysim.runtime import ServerRunner

NAMES = sorted(n for n, t in ALGORITHMS.items() if t.startswith("algorithms."))


@pytest.mark.parametrize("name", NAMES)
def test_only_declared_kinds_reach_the_server(tiny, name, monkeypatch):
    from tests.conftest import method_overrides

    cfg = tiny(rounds=2, clients_per_round=4, algorithm={"name": name, "params": {}}, **method_overrides(name))
    prep = prepare(cfg)
    declared = prep.algorithm.declared_uploads()
    assert declared is not None, f"{name} does not declare its uploads"
    seen = []  # (round, client, kind, floats, bytes, tensors)
    real = ServerRunner.run_server_step

    def spy(self, step, round_idx, iteration, failures, *groups, keep=None):
        for g in groups:
            for cid, payload in (g or {}).items():
                for msg in payload.values():
                    seen.append((round_idx, cid, msg.kind, msg.num_floats, msg.num_bytes, list(msg.tensors.values())))
        return real(self, step, round_idx, iteration, failures, *groups, keep=keep)

    monkeypatch.setattr(ServerRunner, "run_server_step", spy)
    df = run_experiment(cfg, write=False).table
    assert {k for _, _, k, *_ in seen} <= declared, {k for _, _, k, *_ in seen} - declared
    # no upload holds a client's raw samples (private data) or labels vector
    rows = {bytes(x.flatten().numpy().tobytes()) for c in prep.fed_data.clients for x in c.x_train}
    width = prep.fed_data.clients[0].x_train[0].numel()
    for *_, tensors in seen:
        for t in tensors:
            if t.is_floating_point() and t.numel() >= width and t.numel() % width == 0:
                for r in t.reshape(-1, width):
                    assert bytes(r.contiguous().numpy().tobytes()) not in rows
    # exact sizes: what the server received per client and round is the table's up_bytes / up_floats
    up = df[(df["scope"] == "client") & (df["metric"] == "up_bytes")].set_index(["round", "client_id"])["value"]
    upf = df[(df["scope"] == "client") & (df["metric"] == "up_floats")].set_index(["round", "client_id"])["value"]
    got_b, got_f = {}, {}
    for r, c, _, f, b, _ in seen:
        got_b[(r, c)] = got_b.get((r, c), 0) + b
        got_f[(r, c)] = got_f.get((r, c), 0) + f
    for key, b in got_b.items():
        assert up[key] == b and upf[key] == got_f[key], (key, b, up[key])
    if declared:
        assert got_b, f"{name} declared uploads but sent nothing"
    else:
        assert up.eq(0).all()


def test_client_data_is_tagged_private_and_public_data_public(tiny):
    prep = prepare(tiny(data={"dataset": "synthetic", "num_clients": 3, "partition": "iid",
                              "public": {"dataset": "digits", "size": 20}}))
    assert all(c.provenance == "private" for c in prep.fed_data.clients)
    assert prep.fed_data.public.provenance == "public" and prep.task.public is prep.fed_data.public
