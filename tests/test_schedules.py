"""Step schedules: a toy method with a setup phase and two exchanges per round (tests/toy_algo.py) end to end on
both backends, its accounting checked by hand, setup never re-run on resume; the state store; identity hashes."""
import pandas as pd
import pytest
import torch

from raysim.config import make_config
from raysim.engine.prepare import prepare
from raysim.engine.callbacks import EvalCallback
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.io.checkpoints import load_checkpoint
from raysim.steps import ClientStep, Repeat, ServerStep, flatten
from raysim.runner.store import StateStore
from tests.conftest import register_for_test


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, toy_two_exchange="tests.toy_algo:ToyTwoExchange")



def toy(tiny, **over):
    return tiny(**{"rounds": 3, "clients_per_round": 4, "algorithm": {"name": "toy_two_exchange", "params": {}}, **over})


def rows(df, metric, scope="client"):
    return df[(df["scope"] == scope) & (df["metric"] == metric)]


def test_flatten_repeats_in_order():
    s = (ClientStep("a"), Repeat(2, (ClientStep("b"), ServerStep("c"))), ServerStep("d"))
    assert [(x.name, i) for x, i in flatten(s)] == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("d", 0)]


def test_wall_time_rows_per_round_and_step(tiny, tmp_path):
    """round_s per round (round -1: the setup phase) and step_s@<step> per step of the round's schedule (a Repeat's
    iterations summed) and of the evaluation, scope total; without_timing drops exactly them; results.timing pivots
    them; they travel through the written table."""
    from raysim.io import results

    cfg = toy(tiny, rounds=2)
    res = run_experiment(cfg, out_dir=tmp_path / "run")
    df = res.table
    t = df[df["metric"].map(results.is_timing)]
    assert set(t["scope"]) == {"total"} and set(t["client_id"]) == {-1} and (t["value"] >= 0).all()
    names = {r: set(g["metric"]) for r, g in t.groupby("round")}
    assert names[-1] == {"round_s", "step_s@setup_send", "step_s@setup_recv", "step_s@setup_collect"}
    round_steps = {"round_s"} | {f"step_s@{s}" for s in ("local", "combine", "refine", "merge", "finish",
                                                        "evaluate", "evaluate_server")}
    assert names[0] == names[1] == round_steps
    assert not t.duplicated(["round", "metric"]).any()  # the Repeat's iterations are summed into one row
    wide = results.timing(df)
    assert wide["round"].tolist() == [-1, 0, 1] and list(wide.columns[:3]) == ["run_id", "round", "round_s"]
    steps = wide.loc[wide["round"] >= 0, [c for c in wide.columns if c.startswith("step_s@")]].sum(axis=1)
    assert (steps <= wide.loc[wide["round"] >= 0, "round_s"] + 1e-9).all()  # the steps happen inside the round
    rest = results.without_timing(df)
    assert len(rest) == len(df) - len(t) and not rest["metric"].map(results.is_timing).any()
    assert list(rest.index) == list(range(len(rest)))
    pd.testing.assert_frame_equal(results.load(tmp_path / "run"), df, check_exact=True)
    assert results.cumulative(df, "round_s")["x"].is_monotonic_increasing  # a wall-clock axis for reports


def test_toy_accounting_by_hand(tiny):
    cfg = toy(tiny)
    df = run_experiment(cfg, write=False).table
    n = cfg.data.num_clients
    # setup: every client, round -1: down 7 floats (28 B), up 3 floats + one int64 (12 + 8 B)
    for metric, value in [("down_floats", 7), ("down_bytes", 28), ("up_floats", 3), ("up_bytes", 20),
                          ("down_floats@setup_recv", 7), ("up_bytes:num_samples", 8)]:
        r = rows(df, metric)
        r = r[r["round"] == -1]
        assert len(r) == n and r["value"].eq(value).all(), (metric, r)
    assert rows(df, "up_bytes", "total").query("round == -1")["value"].tolist() == [n * 20]
    # rounds: 4 sampled clients, down 4 + 2*5 floats, up 2 + 2*1 floats
    for metric, value in [("down_floats", 14), ("up_floats", 4), ("down_bytes", 56), ("up_bytes", 16),
                          ("down_floats@local", 4), ("down_floats@refine", 10), ("up_floats@refine", 2),
                          ("up_floats:stat", 2), ("down_floats:combined", 10)]:
        r = rows(df, metric)
        r = r[r["round"] >= 0]
        assert len(r) == 3 * 4 and r["value"].eq(value).all(), (metric, r)
    tot = rows(df, "down_floats", "total")
    assert tot.set_index("round")["value"].to_dict() == {-1: 7 * n, 0: 56, 1: 56, 2: 56}
    assert rows(df, "participants", "total").query("round == -1")["value"].tolist() == [n]
    # both repetitions ran and reported; the refine counter of a client sampled every round would be 2 per round
    srv = df[df["scope"] == "server"]
    assert set(srv["metric"]) >= {"setup_clients", "combine_sum", "merge_0", "merge_1"}
    assert srv.query("metric == 'setup_clients'")["value"].tolist() == [n]
    refines = rows(df, "refines").query("round == 2")
    sampled = rows(df, "up_floats").query("round >= 0").groupby("client_id").size()
    for cid, k in sampled.items():
        assert refines.query("client_id == @cid")["value"].item() == 2 * k


@pytest.mark.ray
def test_toy_identical_on_both_backends(ray_session, tiny):
    seq = run_experiment(toy(tiny), write=False).table
    for actors, mem in ((1, 1024), (2, 0)):
        r = run_experiment(toy(tiny, backend={"name": "ray", "num_actors": actors, "state_memory_mb": mem}),
                           write=False).table
        pd.testing.assert_frame_equal(without_timing(seq), without_timing(r), check_exact=True)


def test_toy_store_setting_and_resume_identical_setup_not_rerun(tiny, tmp_path):
    full = run_experiment(toy(tiny), write=False).table
    spilled = run_experiment(toy(tiny, backend={"name": "sequential", "state_memory_mb": 0}), write=False).table
    pd.testing.assert_frame_equal(without_timing(full), without_timing(spilled), check_exact=True)

    over = {"output": {"progress": False, "checkpoint_every": 1, "keep_checkpoints": 0}}  # the setup one stays too

    def crash(round_idx, table):
        if round_idx == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(toy(tiny, **over), out_dir=tmp_path / "run", callbacks=[EvalCallback(crash)])
    kept = tmp_path / "run.incomplete"
    assert (kept / "checkpoints" / "setup" / "meta.pt").exists()
    resumed = run_experiment(toy(tiny, **over), resume=kept)
    pd.testing.assert_frame_equal(without_timing(full), without_timing(resumed.table), check_exact=True)
    ck = load_checkpoint(resumed.out_dir / "checkpoints" / "final")
    assert ck["server_state"]["setup_runs"] == 1  # the setup phase ran once, never again on resume
    sampled = rows(full, "up_floats").query("round >= 0")["client_id"].unique()
    assert sorted(ck["server_state"]["last"]) == sorted(sampled.tolist())  # per-client state kept by the server


def test_store_spills_lru_and_commits_only_when_told(tmp_path):
    st = StateStore(memory_bytes=2 * 40, directory=tmp_path)  # room for two states of 10 float32
    for cid in range(3):
        st.put_initial(cid, {"w": torch.full((10,), float(cid))})
    assert st.spills == 1 and (tmp_path / "client_0.pt").exists()  # the least recently used went to disk
    assert torch.equal(st.get(0)["w"], torch.zeros(10))  # exact reload
    st.stage(1, {"w": torch.full((10,), 9.0)})
    assert st.get(1)["w"][0] == 1.0  # pending is not visible
    st.commit([1])
    assert st.get(1)["w"][0] == 9.0
    st.stage(2, {"w": torch.full((10,), 7.0)})
    st.discard([2])
    assert st.get(2)["w"][0] == 2.0
    shard = tmp_path / "shard.pt"
    assert st.save_shard(shard) == [0, 1, 2]
    other = StateStore(0, tmp_path / "b")
    assert other.load_shard(shard, keep={1, 2}) == [1, 2] and 0 not in other
    assert other.memory_in_use() == 0 and torch.equal(other.get(1)["w"], torch.full((10,), 9.0))


def test_cnn_mnist_state_bytes(tiny):
    """FedProto's client state for cnn_mnist: its weights, float32 (21,840 parameters -> 87,360 bytes)."""
    from raysim.runner.store import state_nbytes
    from raysim.training import clone_state

    from raysim.models import build_model
    from raysim.config import ArchSpec

    m = build_model(ArchSpec("cnn_mnist", {}), (1, 28, 28), 10)
    assert state_nbytes({"model": clone_state(m)}) == 87_360


def test_identity_hash_ignores_defaults_and_tracks_changes(tiny):
    base = {"data": {"dataset": "synthetic", "num_clients": 4}, "algorithm": {"name": "fedproto", "params": {}}}
    a = make_config(base)
    # writing out defaults (as if the key were new with a behaviour-preserving default) keeps the identity
    explicit = make_config({**base, "train": {"persist_optimizer": False, "momentum": 0.5},
                            "algorithm": {"name": "fedproto", "params": {"lam": 1.0, "proto_agg": "weighted"}},
                            "backend": {"state_memory_mb": 0}})
    assert a.config_hash() == explicit.config_hash() and a.run_id() == explicit.run_id()
    seen = {a.config_hash()}
    for change in ({"train": {"lr": 0.02}}, {"train": {"persist_optimizer": True}}, {"seed": 2}, {"rounds": 7},
                   {"algorithm": {"name": "fedproto", "params": {"lam": 0.5}}},
                   {"data": {"dataset": "synthetic", "num_clients": 4, "partition_params": {"ways": 2}}},
                   {"model": {"arch": "mlp"}}, {"on_client_failure": "stop"}):
        h = make_config({**base, **change}).config_hash()
        assert h not in seen, change
        seen.add(h)
    assert make_config({**base, "on_client_failure": "raise"}).config_hash() == \
        make_config({**base, "on_client_failure": "stop"}).config_hash()


def test_validation_happens_once_on_the_driver(tiny, monkeypatch):
    """Runners get typed Params: no validate calls outside prepare()."""
    from algorithms.fedproto import FedProto

    calls = []
    real = FedProto.validate
    monkeypatch.setattr(FedProto, "validate", lambda self: calls.append(1) or real(self))
    run_experiment(tiny(rounds=1), write=False)
    assert len(calls) == 1


@pytest.mark.ray
def test_failing_downlink_is_a_per_client_failure_on_both_backends(ray_session, tiny, monkeypatch):
    register_for_test(monkeypatch, failing_downlink="tests.failing_algo:FailingDownlinkFedAvg")
    over = dict(rounds=3, algorithm={"name": "failing_downlink", "params": {"fail_clients": [3]}})
    seq = run_experiment(tiny(**over), write=False)
    ray_res = run_experiment(tiny(**over, backend={"name": "ray", "num_actors": 2}), write=False)
    pd.testing.assert_frame_equal(without_timing(seq.table), without_timing(ray_res.table), check_exact=True)
    assert [(f["round"], f["client_id"]) for f in seq.metadata["failures"] if f["stage"] == "update"] == [(1, 3), (2, 3)]
    assert "downlink failed" in seq.metadata["failures"][0]["error"]


def test_client_data_stays_uint8_in_runners_and_decodes_exactly():
    from raysim.config import DataConfig
    from raysim.data.federated import build_federated_data

    fd = build_federated_data(DataConfig(dataset="mnist5k", num_clients=4, rotations=[0, 90]), 1)
    for built in fd.clients:
        assert built.is_compact  # built as uint8 pixels (right-angle rotations are exact)
        c = built.to("cpu")  # decoded float images
        k = c.compact()
        assert k.x_train.dtype == torch.uint8 and k.x_train.element_size() * 4 == c.x_train.element_size()
        assert torch.equal(k.x_train, built.x_train) and torch.equal(k.x_test, built.x_test)
        d = k.to("cpu")
        assert torch.equal(d.x_train, c.x_train) and torch.equal(d.x_test, c.x_test)
    syn = build_federated_data(DataConfig(dataset="synthetic", num_clients=2, partition="iid"), 1)
    assert syn.clients[0].compact().x_train.dtype == torch.float32  # float sources stay float


def test_setup_bytes_count_in_totals_not_in_rounds(tiny):
    from raysim.io import results

    df = run_experiment(toy(tiny), write=False).table
    c = results.communication(df).set_index("metric")
    n = 6
    assert c.loc["down_floats", "setup"] == 7 * n and c.loc["down_floats", "per_round"] == 56
    assert c.loc["down_floats", "total"] == 7 * n + 3 * 56
    assert results.final(df)["round"].iloc[0] == 2


def test_user_callbacks_see_every_round_and_can_stop(tiny):
    from raysim.engine.callbacks import Callback

    class Logger(Callback):
        def __init__(self):
            self.events = []

        def on_run_start(self, run):
            self.events.append(("start", run.start_round))

        def on_setup_end(self, run):
            self.events.append(("setup", len(run.table.rows) > 0))

        def on_round_end(self, run, round_idx, evaluated):
            self.events.append(("round", round_idx, evaluated))
            return round_idx == 1  # stop after round 1

        def on_run_end(self, run, result):
            self.events.append(("end", result.metadata["stopped_early"]))

    log = Logger()
    res = run_experiment(toy(tiny, rounds=5, eval={"every": 2}), write=False, callbacks=[log])
    assert log.events == [("start", 0), ("setup", True), ("round", 0, False), ("round", 1, True), ("end", True)]
    assert res.table["round"].max() == 1


@pytest.mark.ray
def test_checkpoint_from_two_actors_resumes_on_one_runner(ray_session, tiny, tmp_path):
    """Shards are keyed by client id: a run checkpointed by 2 Ray actors resumes on the sequential backend (and
    vice versa) with the table of an uninterrupted run."""
    over = {"output": {"progress": False, "checkpoint_every": 1}}
    full = run_experiment(toy(tiny), write=False).table

    def crash(round_idx, table):
        if round_idx == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(toy(tiny, backend={"name": "ray", "num_actors": 2}, **over), out_dir=tmp_path / "a", callbacks=[EvalCallback(crash)])
    assert sorted(p.name for p in (tmp_path / "a.incomplete" / "checkpoints" / "round_00001").iterdir()) == [
        "clients-0.pt", "clients-1.pt", "meta.pt", "server.pt"]
    seq = run_experiment(toy(tiny, **over), resume=tmp_path / "a.incomplete").table
    pd.testing.assert_frame_equal(without_timing(full), without_timing(seq), check_exact=True)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(toy(tiny, **over), out_dir=tmp_path / "b", callbacks=[EvalCallback(crash)])
    r = run_experiment(toy(tiny, backend={"name": "ray", "num_actors": 2}, **over), resume=tmp_path / "b.incomplete").table
    pd.testing.assert_frame_equal(without_timing(full), without_timing(r), check_exact=True)


def test_new_state_is_committed_only_when_the_driver_says_so(tiny):
    from raysim.runner.runners import ClientRunner, ServerRunner
    from raysim.steps import CLASSIC_ROUND

    prep = prepare(tiny(algorithm={"name": "local", "params": {}}))
    runner, srv = ClientRunner(prep.spec, prep.fed_data.clients), ServerRunner(prep.spec)
    before = runner.state(0)["model"]
    ups, reps = runner.run_client_step(CLASSIC_ROUND[0], srv.initial_payload(0), 0, 0, [0])
    assert reps[0].ok and runner.state(0)["model"] is before  # pending: the previous version is still the one read
    runner.commit([0])
    after = runner.state(0)["model"]
    assert after is not before and any(not torch.equal(after[k], before[k]) for k in after)
