"""server.mode: async (issue 36): the rules' maths by hand, the contract attribute, the determinism rule (sequential
== Ray with 1 and 2 actors == spilled states, ties by client id), the result rows, time_to_target on the simulated
clock, and bad input (one line naming the key, exit 2)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from raysim import asyncrules
from raysim.algorithm import ServerContext
from raysim.config import make_config
from raysim.errors import ConfigError
from raysim.engine.callbacks import Callback
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare
from raysim.io import results
from raysim.config import registry
from raysim import rng as rngmod
from tests.conftest import tiny_config

SUPPORTED = {"fedavg", "fedprox", "fedper", "lgfedavg", "fedproto", "fedtgp"}


def async_cfg(rule="fedbuff", alg="fedproto", rounds=5, n=10, params=None, backend=None, env=None, stdev=1,
              extra=None, **server):
    s = {"mode": "async", "rule": rule, "concurrency": 5, "buffer_size": 2,
         "staleness": {"fn": "polynomial", "a": 0.5}, **server}
    data = {"dataset": "synthetic", "num_clients": n, "partition": "nway_kshot",
            "partition_params": {"ways": 3, "shots": 10, "stdev": stdev, "test_shots": 5}}
    return make_config(tiny_config(rounds=rounds, data=data, algorithm={"name": alg, "params": params or {}},
                                   env=env or {"preset": "mobile-heterogeneous", "participation": {"dropout": 0.2}},
                                   server=s, backend=backend or {"name": "sequential"}, **(extra or {})))


def table(cfg):
    return results.without_timing(run_experiment(cfg, write=False, progress=False).table)


# -- the maths, by hand ---------------------------------------------------------------------------------------------
def test_staleness_functions_by_hand():
    w = asyncrules.staleness_weight
    assert w(7, "constant") == 1.0
    assert w(3, "polynomial", a=0.5) == 0.5  # (1 + 3)^-0.5
    assert w(0, "polynomial", a=2.0) == 1.0
    assert w(1, "polynomial", a=2.0) == 0.25
    assert w(2, "hinge", a=0.5, b=2) == 1.0  # within b: no discount
    assert w(4, "hinge", a=0.5, b=2) == 0.5  # 1 / (0.5 * (4 - 2) + 1)
    assert w(6, "hinge", a=1.0, b=2) == 0.2  # 1 / (1 * 4 + 1)
    mw = asyncrules.mixing_weight
    assert mw("fedasync", [w(3, "polynomial", a=0.5)], alpha=0.6) == pytest.approx(0.3)
    assert mw("fedbuff", [w(t, "polynomial", a=0.5) for t in (0, 3)], server_lr=0.5) == 0.375  # 0.5 * (1 + 0.5) / 2
    assert mw("fedbuff", [w(t) for t in (0, 9)], server_lr=1.0) == 1.0  # constant s: plain FedBuff


@pytest.fixture(scope="module")
def fedavg_prep():
    return prepare(make_config(tiny_config(algorithm={"name": "fedavg", "params": {}})))


def _fill(state, v):
    return {k: torch.full_like(t, float(v)) if torch.is_floating_point(t) else t.clone() for k, t in state.items()}


def _fedavg_step(prep, server_state, uploads, rule, taus, **kw):
    from raysim.messages import Message, state_message

    alg = prep.algorithm
    ups = {c: {"model": state_message("weights", _fill(server_state["model"], v)),
               "num_samples": Message("num_samples", {"n": torch.tensor([n], dtype=torch.int64)})}
           for c, (v, n) in uploads.items()}
    s = {k: kw[k] for k in ("fn", "a", "b") if k in kw}
    weights = {c: asyncrules.staleness_weight(t, **s) for c, t in taus.items()}
    mix = asyncrules.mixing_weight(rule, [weights[c] for c in sorted(ups)],
                                   **{k: kw[k] for k in ("alpha", "server_lr") if k in kw})
    ctx = ServerContext(0, rngmod.SERVER, 1, torch.device("cpu"), prep.task,
                        asynchronous={"rule": rule, "mix": mix, "staleness": taus, "weights": weights})
    return alg.async_aggregate(server_state, ups, ctx)


def test_fedbuff_and_fedasync_by_hand(fedavg_prep):
    x0 = {"model": _fill(fedavg_prep.algorithm.init_server_state(None)["model"], 0.0)}
    # FedBuff: buffer {client 1: ones, 1 sample; client 2: threes, 3 samples} -> aggregate 2.5; server_lr 0.5,
    # staleness (1 + tau)^-0.5 at tau 0 and 3 -> mean 0.75: x = 0 + 0.5 * 0.75 * (2.5 - 0) = 0.9375
    out = _fedavg_step(fedavg_prep, x0, {1: (1.0, 1), 2: (3.0, 3)}, "fedbuff", {1: 0, 2: 3}, server_lr=0.5,
                       fn="polynomial", a=0.5)
    for t in out.state["model"].values():
        if torch.is_floating_point(t):
            assert torch.all(t == 0.9375)
    assert torch.all(next(iter(out.payload["model"].tensors.values())) == 0.9375)  # the next version's broadcast
    # FedAsync from x = 1 with one update of 3: x = (1 - a_t) * 1 + a_t * 3, a_t = alpha * s(tau)
    x1 = {"model": _fill(x0["model"], 1.0)}
    for fn, tau, a, b, expect in (("constant", 5, 0.5, 4, 1 + 0.6 * 2),  # s = 1
                                  ("polynomial", 3, 0.5, 4, 1 + 0.6 * 0.5 * 2),  # s = (1 + 3)^-0.5
                                  ("hinge", 4, 0.5, 2, 1 + 0.6 * 0.5 * 2),  # s = 1 / (0.5 * 2 + 1)
                                  ("hinge", 2, 0.5, 2, 1 + 0.6 * 2)):  # within b
        out = _fedavg_step(fedavg_prep, x1, {4: (3.0, 7)}, "fedasync", {4: tau}, alpha=0.6, fn=fn, a=a, b=b)
        got = next(t for t in out.state["model"].values() if torch.is_floating_point(t))
        assert torch.allclose(got, torch.full_like(got, expect), rtol=0, atol=1e-6), (fn, tau)


def test_fedbuff_applies_deltas_against_dispatch_versions_by_hand(fedavg_prep):
    """Nguyen et al. 2022: x <- x + eta_g * (weighted mean of y_i - x_{v_i}), each delta against the version the
    client was dispatched with, through the server runner's per-version states (kept while referenced)."""
    from raysim.engine.async_loop import AsyncServerStep
    from raysim.runner.runners import ServerRunner
    from raysim.messages import Message, state_message

    runner = ServerRunner(fedavg_prep.spec)
    x0 = {"model": _fill(runner.state["model"], 0.0)}
    runner.state = x0

    def upload(v, n):
        return {"model": state_message("weights", _fill(x0["model"], v)),
                "num_samples": Message("num_samples", {"n": torch.tensor([n], dtype=torch.int64)})}

    def step(version, ups, dispatch, live):
        taus = {c: version - v for c, v in dispatch.items()}
        info = {"rule": "fedbuff", "mix": 0.5, "staleness": taus, "weights": dict.fromkeys(taus, 1.0),
                "version": version, "dispatch": dispatch, "live": live}
        runner.run_server_step(AsyncServerStep("async_aggregate", "async_aggregate", asynchronous=info), version, 0,
                               [], ups, keep=sorted(ups))
        return next(t for t in runner.state["model"].values() if torch.is_floating_point(t))

    # version 0 -> 1: client 5 (dispatched at 0, y = 2, n = 1); client 1, dispatched at 0, is still in flight
    assert torch.all(step(0, {5: upload(2.0, 1)}, {5: 0}, [0]) == 1.0)  # 0 + 0.5 * (2 - 0)
    assert sorted(runner.versions) == [0]  # version 0's state, kept for client 1
    assert all(torch.all(t == 0.0) for t in runner.versions[0]["model"].values() if torch.is_floating_point(t))
    # version 1 -> 2: client 1 (dispatched at 0: y = 4, n = 1, delta 4 - 0) and client 2 (at 1: y = 3, n = 3,
    # delta 3 - 1); weighted mean (1 * 4 + 3 * 2) / 4 = 2.5: x = 1 + 0.5 * 2.5 = 2.25. The rule that steps toward
    # the aggregate of the y_i from the current state would give 1 + 0.5 * ((4 + 9) / 4 - 1) = 2.125
    got = step(1, {1: upload(4.0, 1), 2: upload(3.0, 3)}, {1: 0, 2: 1}, [])
    assert torch.all(got == 2.25), got
    assert runner.versions == {}  # nobody in flight refers to version 0 any more: dropped


@pytest.mark.parametrize("alg", sorted(SUPPORTED))
def test_async_rebase_by_hand(alg):
    """A stale upload y = 5 from dispatch version x_v = 2, current x = 1: x + (y - x_v) = 4 on every floating tensor
    of the state the method uploads a trained copy of; prototype methods' uploads stay as they are."""
    from raysim.messages import Message, state_message
    from tests.conftest import method_overrides

    over = method_overrides(alg) if alg == "fedper" else {}
    alg_cfg = {"name": alg, "params": {"shared": "body"} if alg == "fedper" else {}}
    a = prepare(make_config(tiny_config(algorithm=alg_cfg, **over))).algorithm
    state = a.init_server_state(None)
    key = "shared" if "shared" in state else "model" if "model" in state else None
    if key is None:  # FedProto, FedTGP: prototypes
        up = {"protos": Message("prototypes", {"protos": torch.ones(2, 3), "classes": torch.tensor([0, 1])})}
        assert a.async_rebase(up, state, state, None) is up
        return

    def fill(v):
        return {k: torch.full_like(t, v) if torch.is_floating_point(t) else t for k, t in state[key].items()}

    up = {key: state_message("weights", fill(5.0)), "num_samples": Message("num_samples", {"n": torch.tensor([1])})}
    out = a.async_rebase(up, {key: fill(2.0)}, {key: fill(1.0)}, None)
    floats = [t for t in out[key].tensors.values() if torch.is_floating_point(t)]
    assert floats and all(torch.all(t == 4.0) for t in floats) and out["num_samples"] is up["num_samples"]


def test_fedbuff_keeps_one_state_per_version_in_flight(monkeypatch):
    """The server holds one state per older dispatch version still referenced by a client in flight (not one per
    client) and FedBuff's stale uploads get their version's state as the base."""
    from raysim.runner import runners

    seen = []
    orig = runners.ServerRunner.run_server_step

    def spy(self, step, round_idx, *a, **kw):
        info = getattr(step, "asynchronous", None)
        out = orig(self, step, round_idx, *a, **kw)
        if info is not None:
            seen.append((dict(info["dispatch"]), list(info["live"]), sorted(self.versions), info["version"]))
        return out

    monkeypatch.setattr(runners.ServerRunner, "run_server_step", spy)
    table(async_cfg("fedbuff", "fedavg", rounds=6, concurrency=6, buffer_size=3))
    assert len(seen) == 6
    stale = 0
    for dispatch, live, held, version in seen:
        assert held == [v for v in live if v <= version]  # exactly the versions still referenced, once each
        stale += sum(v < version for v in dispatch.values())
    assert stale > 0 and max(len(h) for _, _, h, _ in seen) >= 1


def test_fedproto_staleness_weighted_prototypes_by_hand():
    prep = prepare(make_config(tiny_config()))
    alg = prep.algorithm
    old = {"protos": torch.tensor([[0.0, 0.0], [9.0, 9.0], [5.0, 5.0]]), "mask": torch.tensor([True, False, True])}
    new = {"protos": torch.tensor([[2.0, 2.0], [4.0, 4.0], [5.0, 5.0]]), "mask": torch.tensor([True, True, True])}
    out = alg.async_mix(old, new, 0.25, None)
    # class 0 held by both: 0 + 0.25 * (2 - 0); class 1 first seen: taken; class 2 not uploaded (aggregate kept it)
    assert torch.equal(out["protos"], torch.tensor([[0.5, 0.5], [4.0, 4.0], [5.0, 5.0]]))
    assert out["mask"].tolist() == [True, True, True]


# -- the contract attribute ------------------------------------------------------------------------------------------
def test_methods_declare_async_support():
    declared = {name for name in registry.ALGORITHMS if getattr(registry.algorithm_class(name), "asynchronous", False)}
    assert declared == SUPPORTED


@pytest.mark.parametrize("rule", ["fedasync", "fedbuff"])
@pytest.mark.parametrize("alg", sorted(SUPPORTED))
def test_every_supporting_method_runs_async(alg, rule):
    params = {"shared": "body"} if alg == "fedper" else ({"server_epochs": 3} if alg == "fedtgp" else {})
    df = table(async_cfg(rule, alg, rounds=4, params=params))
    env = df[df.scope == "env"].pivot_table(index="round", columns="metric", values="value")
    assert list(env.index) == [0, 1, 2, 3] and (env["updates"] == (1 if rule == "fedasync" else 2)).all()
    if rule == "fedbuff":  # stale updates applied (rebased onto the current state where the method rebases)
        assert env["staleness_max"].max() > 0
    assert df[df.scope == "client"]["value"].notna().all()
    assert (df[(df.scope == "mean") & (df.metric == "test_acc")]["round"] == 3).any()


# -- determinism ----------------------------------------------------------------------------------------------------
def test_rows_keyed_by_server_version():
    df = table(async_cfg(rounds=6))
    env = df[df.scope == "env"].pivot_table(index="round", columns="metric", values="value")
    assert list(env.index) == list(range(6))
    assert (env["updates"] == 2).all() and env["sim_time"].is_monotonic_increasing
    assert (env["sim_round_s"].cumsum() - env["sim_time"]).abs().max() < 1e-9
    st = df[(df.scope == "client") & (df.metric == "staleness")]
    assert len(st) == 12 and st["value"].max() > 0  # per update; some stale
    assert env["dropped"].sum() > 0 and env["wasted_s"].sum() > 0  # dropouts recorded as wasted work
    # the mixing weight is the rule's: server_lr 1 * mean (1 + tau)^-0.5 over the buffer
    for r, g in st.groupby("round"):
        expect = sum((1 + t) ** -0.5 for t in g["value"]) / len(g)
        assert env.loc[r, "mix"] == pytest.approx(expect)
    assert (df[(df.scope == "total") & (df.metric == "up_bytes")]["value"] > 0).all()  # traffic per version


def test_same_seed_same_table_and_spill():
    cfg = async_cfg(rounds=5)
    a = table(cfg)
    pd.testing.assert_frame_equal(a, table(cfg), check_exact=True)
    spilled = async_cfg(rounds=5, backend={"name": "sequential", "state_memory_mb": 0})
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), table(spilled).drop(columns="run_id"), check_exact=True)
    import dataclasses

    assert not a.drop(columns="run_id").equals(table(dataclasses.replace(cfg, seed=8)).drop(columns="run_id"))


def test_sequential_equals_ray_one_and_two_actors(ray_session, monkeypatch):
    # identical devices (uniform preset) and clients of equal size: event times tie, the order is by client id;
    # batches of at most 3 clients (the initial 5 dispatches train in two client steps)
    from raysim.engine import async_loop

    monkeypatch.setattr(async_loop, "MAX_BATCH", 3)
    kw = dict(rounds=4, stdev=0, env={"preset": "uniform", "participation": {"dropout": 0.2}})
    seq = table(async_cfg(**kw))
    times = seq[(seq.scope == "client") & (seq.metric == "sim_finish_s")]["value"]
    assert times.duplicated().any() and seq[(seq.scope == "client") & (seq.metric == "staleness")]["value"].max() > 0
    for actors in (1, 2):
        ray_df = table(async_cfg(backend={"name": "ray", "num_actors": actors}, **kw))
        pd.testing.assert_frame_equal(seq.drop(columns="run_id"), ray_df.drop(columns="run_id"), check_exact=True)


def test_time_to_target_on_the_simulated_clock():
    df = table(async_cfg(rounds=6))
    tt = results.time_to_target(df, "test_acc", 0.0)
    clock = results.env_time(df).set_index("round")["sim_time"]
    assert tt["round"].iloc[0] == 0 and tt["sim_time"].iloc[0] == clock[0]
    assert pd.isna(results.time_to_target(df, "test_acc", 1.01)["sim_time"].iloc[0])


# -- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, key", [
    ({"buffer_size": 6}, "server.buffer_size"),
    ({"staleness": {"fn": "polynomial", "a": -0.5}}, "server.staleness.a"),
    ({"concurrency": 11}, "server.concurrency"),
])
def test_bad_server_config_names_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        async_cfg(**over)
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("alg, env, key", [
    ("scaffold", None, "server.mode"),
    ("local", None, "server.mode"),
    ("fedproto", {"preset": "mobile-heterogeneous", "participation": {"deadline_s": 30.0}},
     "env.participation.deadline_s"),
    # a round setting set explicitly (the preset's 1.3, a round default, is ignored: every other test runs on it)
    ("fedproto", {"preset": "mobile-heterogeneous", "participation": {"over_selection": 1.5}},
     "env.participation.over_selection"),
])
def test_unsupported_async_is_refused(alg, env, key):
    with pytest.raises(ConfigError) as e:
        prepare(async_cfg(alg=alg, env=env))
    assert key in str(e.value) and "\n" not in str(e.value)


# -- resume ---------------------------------------------------------------------------------------------------------
class _Crash(RuntimeError):
    pass


class _CrashAt(Callback):
    """Kills the run at the end of server version ``version`` (after the checkpointer, which runs before it)."""

    def __init__(self, version: int):
        self.version = version

    def on_round_end(self, run, round_idx, evaluated):
        if round_idx == self.version:
            raise _Crash("killed")


CHECKPOINTED = {"output__progress": False, "output__checkpoint_every": 3, "eval__every": 2}


def _interrupt(cfg, where, at=7):
    with pytest.raises(_Crash) as e:
        run_experiment(cfg, out_dir=where, callbacks=[_CrashAt(at)])
    assert "--resume" in "".join(getattr(e.value, "__notes__", []))
    return where.with_name(where.name + ".incomplete")


@pytest.mark.parametrize("rule, alg, at", [("fedbuff", "fedavg", 7), ("fedasync", "fedavg", 7),
                                           ("fedbuff", "fedproto", 4)])
def test_resume_equals_an_uninterrupted_run(tmp_path, rule, alg, at):
    """Checkpoints every 3 versions (after versions 2, 5, 8); killed after version ``at``, resumed from the
    checkpoint before it: the table of the uninterrupted run, exactly."""
    from raysim.io.checkpoints import find_checkpoint, read_checkpoint_meta
    from raysim.io.files import load_file

    cfg = async_cfg(rule, alg, rounds=10, extra=CHECKPOINTED)
    full = table(cfg)
    kept = _interrupt(cfg, tmp_path / "run", at)
    ck = find_checkpoint(kept)
    state = read_checkpoint_meta(ck)["extra"]["async"]
    v = state["version"]
    assert ck.name == f"round_{v - 1:05d}" and v == 3 * ((at + 1) // 3) and state["pending_dispatch"]
    # what it carried: the clients in flight, trained (their uploads in async.pt) and untrained (the payloads of
    # their dispatch versions), and FedBuff's states of the older versions they were dispatched with
    messages = load_file(ck / "async.pt")
    trained = [f for f in state["flights"] if f["batch"] >= 0 and f["report"]["ok"] and not f["dropped"]]
    untrained = [f for f in state["flights"] if f["batch"] < 0]
    assert trained and {f["cid"] for f in trained} == {c for g in messages["uploads"].values() for c in g}
    assert {f["version"] for f in untrained} | {v} <= set(messages["payloads"])
    held = sorted(load_file(ck / "server.pt").get("versions") or {})
    rebases = rule == "fedbuff" and alg == "fedavg"  # FedProto's prototypes are observations: no rebase, no states
    assert held == (sorted({f["version"] for f in state["flights"] if f["version"] < v}) if rebases else [])
    assert not rebases or held
    resumed = run_experiment(cfg, resume=kept)
    assert not kept.exists()
    pd.testing.assert_frame_equal(full, results.without_timing(resumed.table), check_exact=True)
    assert resumed.metadata["async"]["versions"] == 10


def test_resume_of_a_damaged_or_mismatched_async_checkpoint_is_one_line(tmp_path):
    import dataclasses
    import shutil

    from raysim.errors import DamagedFileError
    from raysim.io.files import atomic_save, load_file

    cfg = async_cfg("fedbuff", "fedavg", rounds=10, extra=CHECKPOINTED)
    kept = _interrupt(cfg, tmp_path / "run")
    ck = kept / "checkpoints" / "round_00005"

    def refused(c, error):
        with pytest.raises(error) as e:
            run_experiment(c, resume=kept)
        assert "\n" not in str(e.value), str(e.value)
        return str(e.value)

    # another rule, or a synchronous run: another configuration
    assert "different configuration" in refused(async_cfg("fedasync", "fedavg", rounds=10, extra=CHECKPOINTED),
                                                ConfigError)
    sync = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, mode="sync"))
    assert "different configuration" in refused(sync, ConfigError)
    # the messages shard's bytes changed
    saved = (ck / "async.pt").read_bytes()
    (ck / "async.pt").write_bytes(saved[:-7] + b"garbage")
    assert "async.pt" in refused(cfg, DamagedFileError)
    (ck / "async.pt").write_bytes(saved)
    # no event-loop state in the meta, or one that does not fit the messages shard
    meta = load_file(ck / "meta.pt")
    shutil.copy(ck / "meta.pt", tmp_path / "meta.pt")
    atomic_save({**meta, "extra": {k: v for k, v in meta["extra"].items() if k != "async"}}, ck / "meta.pt")
    assert "async server state" in refused(cfg, DamagedFileError)
    bad = {**meta["extra"]["async"], "payload_versions": [0]}
    atomic_save({**meta, "extra": {**meta["extra"], "async": bad}}, ck / "meta.pt")
    assert "does not fit this run" in refused(cfg, DamagedFileError)
    shutil.copy(tmp_path / "meta.pt", ck / "meta.pt")  # repaired: it resumes
    pd.testing.assert_frame_equal(table(cfg), results.without_timing(run_experiment(cfg, resume=kept).table),
                                  check_exact=True)


def test_resume_on_ray_equals_the_sequential_run(ray_session, tmp_path):
    """Checkpointed by 2 Ray actors (the messages shard written by the server actor), resumed on Ray with 2 actors
    and on the sequential backend: the uninterrupted sequential run's table."""
    import shutil

    cfg = async_cfg("fedbuff", "fedavg", rounds=10, extra=CHECKPOINTED)
    ray_cfg = async_cfg("fedbuff", "fedavg", rounds=10, extra=CHECKPOINTED, backend={"name": "ray", "num_actors": 2})
    kept = _interrupt(ray_cfg, tmp_path / "run")
    copy = shutil.copytree(kept, tmp_path / "copy.incomplete")
    full = table(cfg).drop(columns="run_id")
    for c, where in ((ray_cfg, kept), (cfg, copy)):
        resumed = run_experiment(c, resume=where)
        pd.testing.assert_frame_equal(full, results.without_timing(resumed.table).drop(columns="run_id"),
                                      check_exact=True)


def test_cli_exit_2_names_server_mode(tmp_path, capsys):
    from raysim.app.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: {name: scaffold}\ndata: {dataset: synthetic, num_clients: 6}\n"
                   "env: {preset: uniform}\nserver: {mode: async, concurrency: 3, buffer_size: 2}\n")
    assert main(["run", str(cfg), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "server.mode" in err and len(err.strip().splitlines()) == 1, err


def test_every_client_busy_and_nobody_online():
    # concurrency = population: a buffered client's slot stays empty until the aggregation frees it
    df = table(async_cfg(rounds=4, n=6, concurrency=6, buffer_size=3,
                         env={"preset": "uniform", "participation": {"idle_s": 0.0}}))
    assert df[(df.scope == "env") & (df.metric == "updates")]["value"].tolist() == [3.0] * 4
    # nobody online: the server waits, retrying every idle_s of simulated time, and the run still ends
    df = table(async_cfg(rounds=2, env={"preset": "uniform", "participation": {
        "availability": {"mode": "bernoulli", "p": 0.05}, "idle_s": 30.0}}))
    assert df[(df.scope == "env") & (df.metric == "sim_time")]["value"].max() >= 30.0


def test_report_plots_sync_and_async_against_simulated_time(tmp_path):
    from raysim.app.summary import ReportOptions, build_report

    base = tiny_config(rounds=3, env={"preset": "mobile-heterogeneous"}, data={
        "dataset": "synthetic", "num_clients": 10, "partition": "nway_kshot",
        "partition_params": {"ways": 3, "shots": 10, "stdev": 1, "test_shots": 5}})
    sync = make_config(base, ["clients_per_round=4"])
    asyn = make_config(base, ["server.mode=async", "server.concurrency=4", "server.buffer_size=2"])  # --set works
    for name, cfg in (("sync", sync), ("async", asyn)):
        run_experiment(cfg, out_dir=tmp_path / name, progress=False)
    out = build_report([tmp_path / "sync", tmp_path / "async"], tmp_path / "report", ReportOptions(target=0.0),
                       log=lambda *a: None)
    assert (tmp_path / "report" / "test_acc_vs_time.png").stat().st_size > 0
    text = (tmp_path / "report" / "summary.md").read_text()
    assert "server.mode=async" in text and "server.mode=sync" in text and "sim_round_s to 0" in text
    assert out


def test_server_time_per_aggregation_on_the_async_clock():
    """env.server_s: each aggregation takes that long on the simulated clock, and the slots it frees are refilled
    with the new version when it is done. Up to the first aggregation the runs are the same, so version 0 ends
    exactly server_s later."""
    def env_rows(server_s):
        env = {"preset": "mobile-heterogeneous", "participation": {"dropout": 0.2}, "server_s": server_s}
        df = table(async_cfg(rounds=5, env=env))
        return df[df.scope == "env"].pivot_table(index="round", columns="metric", values="value")

    base, slow = env_rows(0.0), env_rows(5.0)
    assert slow.loc[0, "sim_time"] == base.loc[0, "sim_time"] + 5.0
    assert (slow["sim_round_s"] >= 5.0).all() and (slow["sim_time"].diff().dropna() >= 5.0).all()
    assert slow["sim_time"].iloc[-1] > base["sim_time"].iloc[-1]


def test_max_staleness_discards_stale_updates():
    df = table(async_cfg("fedasync", "fedavg", rounds=6, max_staleness=0))
    env = df[df.scope == "env"].pivot_table(index="round", columns="metric", values="value")
    assert env["discarded"].sum() > 0 and env["staleness_max"].max() == 0  # only fresh updates were applied
    assert (df[(df.scope == "client") & (df.metric == "discarded")]["value"] > 0).sum() == env["discarded"].sum()
