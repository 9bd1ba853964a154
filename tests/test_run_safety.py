"""Run safety and everyday use (issue 9): divergence, run directories (locking, never overwriting, kill -9 and
resume, Ctrl-C), YAML numbers, switching method, one std, the results API, ``raysim runs`` / ``--dry-run`` /
``list``, and reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from raysim.io import results
from raysim.io import rundir
from raysim.io import runs
from raysim.runner import safety
from raysim.app.cli import main
from raysim.config import load_config, make_config
from raysim.errors import ConfigError
from raysim.messages import Message
from raysim.engine.callbacks import EvalCallback
from raysim.engine.loop import run_experiment
from tests.conftest import register_for_test, tiny_config


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, nan_fedavg="tests.failing_algo:NaNFedAvg")


ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


# ---------------------------------------------------------------------------------------------------------------
# divergence


def test_check_update_finds_nan_losses_and_inf_uploads():
    ok = {"w": Message("weights", {"a": torch.ones(3), "ids": torch.arange(3)})}
    bad = {"w": Message("weights", {"a": torch.tensor([1.0, float("inf"), float("nan")])})}
    assert safety.check_update({"train_loss": 0.5, "test_acc": float("nan")}, ok) is None  # acc may be undefined
    assert safety.check_update({"train_loss": (float("nan"), 3.0)}, ok) == "train_loss=nan"
    assert safety.check_update({"train_loss": 1.0}, bad) == "upload 'w'['a']: 2 of 3 values non-finite"
    # the fast path (a float64 sum) neither misses a lone NaN/inf nor flags finite values whose float32 sum overflows
    big = torch.full((1000,), 3.0e38)
    assert safety.nonfinite_upload({"w": Message("weights", {"a": big})}) is None
    for v in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(10_000)
        t[4321] = v
        assert safety.nonfinite_upload({"w": Message("weights", {"a": t})}) == "upload 'w'['a']: 1 of 10000 values non-finite"
    huge = torch.tensor([1.7e308, 1.7e308], dtype=torch.float64)  # the float64 sum overflows: the exact check decides
    assert safety.nonfinite_upload({"w": Message("weights", {"a": huge})}) is None


@pytest.mark.parametrize("where", ["loss", "upload"])
def test_on_nonfinite_stop_names_round_client_and_stage(tiny, tmp_path, where):
    cfg = tiny(rounds=3, algorithm={"name": "nan_fedavg", "params": {"nan_clients": [4], "nan_round": 1,
                                                                        "where": where}})
    with pytest.raises(safety.NonFiniteError) as e:
        run_experiment(cfg, out_dir=tmp_path / "run")
    assert e.value.event.record()["round"] == 1 and e.value.event.client_id == 4 and e.value.event.stage == "update"
    assert "round 1, client 4, stage 'update'" in str(e.value)
    info = json.loads((tmp_path / "run.incomplete" / "run.json").read_text())
    assert info["status"] == "diverged" and info["nonfinite"]["client_id"] == 4
    assert not (tmp_path / "run").exists() and not list(tmp_path.rglob("results.parquet"))


def test_on_nonfinite_skip_client_drops_the_update(tiny):
    cfg = tiny(rounds=3, on_nonfinite="skip_client",
               algorithm={"name": "nan_fedavg", "params": {"nan_clients": [4], "nan_round": 1, "where": "upload"}})
    res = run_experiment(cfg, write=False)
    f = [(x["round"], x["client_id"], x["stage"]) for x in res.metadata["failures"]]
    assert f == [(1, 4, "update"), (2, 4, "update")] and "non-finite" in res.metadata["failures"][0]["error"]
    g = res.table[res.table["metric"] == "global_test_acc"]["value"]
    assert g.notna().all() and res.table[res.table["scope"] == "mean"]["value"].notna().all()


def test_every_client_nonfinite_with_skip_client_stops(tiny):
    from raysim.errors import SimulationError

    cfg = tiny(rounds=2, on_nonfinite="skip_client",
               algorithm={"name": "nan_fedavg", "params": {"nan_clients": list(range(6)), "nan_round": 0}})
    with pytest.raises(SimulationError, match="6 of 6 clients failed.*non-finite train_loss=nan"):
        run_experiment(cfg, write=False)


def test_on_client_failure_raise_is_an_alias_of_stop():
    assert make_config({"on_client_failure": "raise"}).on_client_failure == "stop"


# ---------------------------------------------------------------------------------------------------------------
# run directories


def test_a_finished_run_is_never_overwritten(tiny, tmp_path, capsys):
    a = run_experiment(tiny(rounds=1), out_dir=tmp_path / "run")
    b = run_experiment(tiny(rounds=1), out_dir=tmp_path / "run")
    assert a.out_dir == tmp_path / "run" and b.out_dir == tmp_path / "run-2"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a finished run" in err and "run-2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-2"]


def test_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    held = rundir.RunDir.claim(tmp_path / "r")
    assert rundir.holder(held.work).startswith(f"pid {os.getpid()}")
    with pytest.raises(ConfigError, match="being written by a running run"):
        rundir.RunDir.claim(tmp_path / "r")
    held.abandon(keep=False)
    assert not any(tmp_path.iterdir())
    # a lock file left by a killed process is not held: the directory is reused (no checkpoints) ...
    (tmp_path / "r.incomplete").mkdir()
    (tmp_path / "r.incomplete" / ".lock").write_text("pid 1 on gone")
    (tmp_path / "r.incomplete" / "junk").write_text("x")
    rundir.mark(tmp_path / "r.incomplete")  # raysim made it (issue 50: only such a directory is reused)
    rd = rundir.RunDir.claim(tmp_path / "r")
    assert rd.work == tmp_path / "r.incomplete" and not (rd.work / "junk").exists()
    # ... or, holding checkpoints, kept for a resume while the new run takes the next name
    (rd.work / "checkpoints" / "round_00000").mkdir(parents=True)
    (rd.work / "checkpoints" / "round_00000" / "meta.pt").write_text("x")
    rd.abandon(keep=True)
    notes = []
    rd2 = rundir.RunDir.claim(tmp_path / "r", notify=notes.append)
    assert rd2.final == tmp_path / "r-2" and "--resume" in notes[0]
    assert rd2.finalise() == tmp_path / "r-2" and not (tmp_path / "r-2" / ".lock").exists()


def test_run_index_and_report_skip_unfinished_and_hidden_dirs(tiny, tmp_path):
    run_experiment(tiny(rounds=1), out_dir=tmp_path / "a")
    for name in ("b.incomplete", ".hidden", ".tmp-c"):  # e.g. a crash between writing results and the rename
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.parquet").write_bytes((tmp_path / "a" / "results.parquet").read_bytes())
    assert results.run_index(tmp_path)["path"].tolist() == [str(tmp_path / "a")]
    with pytest.raises(FileNotFoundError, match="unfinished run"):
        results.load(tmp_path / "b.incomplete")
    assert [r["path"] for r in runs.list_runs(tmp_path)] == [str(tmp_path / "a"), str(tmp_path / "b.incomplete")]


HOLDER = """
import os, sys, time
from raysim.config import load_config
from raysim.engine.callbacks import EvalCallback
from raysim.engine.loop import run_experiment
def hold(round_idx, table):  # the run stays in its first round until the test has tried the second run
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.02)
    return False
run_experiment(load_config(sys.argv[1]), out_dir=sys.argv[2], callbacks=[EvalCallback(hold)])
"""


def test_simultaneous_runs_into_one_out(tmp_path):
    """The first run holds <out>.incomplete; a second one into the same --out fails at once (exit 2)."""
    cfg = write(tmp_path, tiny_config(rounds=2, data={"dataset": "synthetic", "num_clients": 6, "partition": "iid",
                                                       "partition_params": {}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    release = tmp_path / "release"
    cmd = [sys.executable, "-c", HOLDER, str(cfg), str(tmp_path / "out"), str(release)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while rundir.holder(tmp_path / "out.incomplete") is None and first.poll() is None and time.time() - t0 < 120:
            time.sleep(0.02)
        assert first.poll() is None, "the first run ended before the second started: " + first.communicate()[1][-2000:]
        assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
    finally:
        release.touch()
    assert first.wait(timeout=120) == 0
    assert (tmp_path / "out" / "results.parquet").exists() and not (tmp_path / "out.incomplete").exists()


KILLER = """
import os, signal, sys
from raysim.config import load_config
from raysim.engine.callbacks import EvalCallback
from raysim.engine.loop import run_experiment
def die(round_idx, table):
    if round_idx == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return False
run_experiment(load_config(sys.argv[1]), out_dir=sys.argv[2], callbacks=[EvalCallback(die)])
"""


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config(rounds=6, output={"progress": False, "checkpoint_every": 2}))
    full = run_experiment(load_config(cfg), write=False)
    p = subprocess.run([sys.executable, "-c", KILLER, str(cfg), str(tmp_path / "run")], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == -9
    kept = tmp_path / "run.incomplete"  # visible, unlocked, with the checkpoints of rounds 1 and 3
    done = sorted(x.name for x in (kept / "checkpoints").iterdir() if (x / "meta.pt").exists() and x.suffix != ".tmp")
    assert done == ["round_00001", "round_00003"]
    assert rundir.holder(kept) is None
    with pytest.raises(FileNotFoundError):  # an unfinished run is not a run to analyse
        results.run_index(tmp_path)
    assert main(["runs", str(tmp_path)]) == 0 and "killed (resumable)" in capsys.readouterr().out
    assert main(["run", str(cfg), "--resume", str(kept), "--no-progress"]) == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.yaml", "run"]
    pd.testing.assert_frame_equal(results.without_timing(results.load(tmp_path / "run")), results.without_timing(full.table), check_exact=True)


def test_ctrl_c_keeps_checkpoints_and_prints_the_resume_command(tmp_path, capsys, monkeypatch):
    import raysim.engine.loop

    cfg = write(tmp_path, tiny_config(rounds=4, output={"progress": False, "checkpoint_every": 1}))
    real = raysim.engine.loop.run_experiment

    def interrupted(*a, **k):
        def ctrl_c(round_idx, table):
            if round_idx == 2:
                raise KeyboardInterrupt
            return False
        return real(*a, callbacks=[EvalCallback(ctrl_c)], **k)

    monkeypatch.setattr(raysim.engine.loop, "run_experiment", interrupted)
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "--set", "eval.every=1"]) == 130
    err = capsys.readouterr().err
    assert f"raysim run {cfg} --set eval.every=1 --resume {tmp_path / 'run.incomplete'}" in err
    assert json.loads((tmp_path / "run.incomplete" / "run.json").read_text())["status"] == "interrupted"
    monkeypatch.setattr(raysim.engine.loop, "run_experiment", real)
    # the intended name works too, and the run finishes into it
    assert main(["run", str(cfg), "--set", "eval.every=1", "--resume", str(tmp_path / "run"), "--no-progress"]) == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.yaml", "run"]


# ---------------------------------------------------------------------------------------------------------------
# config and CLI


def test_yaml_numbers_in_files_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: {lr: 1e-3, weight_decay: 5e-4}\nalgorithm: {name: fedproto, params: {lam: 1E6}}\n"
                 "rounds: 1e1\n")
    cfg = load_config(p, ["train.momentum=5e-1"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.momentum) == (1e-3, 5e-4, 0.5)
    assert cfg.algorithm.params["lam"] == 1e6 and cfg.rounds == 10


def test_switching_method_drops_parameters_it_lacks(capsys):
    cfg = load_config(ROOT / "configs" / "fedtgp_fmnist_zoo.yaml", ["algorithm.name=fedproto"])
    assert cfg.algorithm.params == {"lam": 10.0, "restrict_local_classes": False}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dropped algorithm.params margin_threshold, margin, server_epochs" in err
    # what the user sets explicitly is kept (and then checked against the new method)
    cfg = load_config(ROOT / "configs" / "fedtgp_fmnist_zoo.yaml", ["algorithm.name=fedprox", "algorithm.params.mu=0.1"])
    assert cfg.algorithm.params == {"mu": 0.1}


def test_cli_prints_the_sample_std_and_says_so(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config(rounds=1))
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    fin = results.final(results.load(tmp_path / "r"), "test_acc")
    assert f"± {fin['std'].iloc[0]:.4f} (sample std over 6 clients)" in out
    std_row = results.load(tmp_path / "r").query("scope == 'std' and metric == 'test_acc'")["value"].iloc[0]
    assert std_row == pytest.approx(fin["std"].iloc[0])


def test_dry_run_validates_and_writes_nothing(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "on_nonfinite: stop" in out and "# data split: 6 clients" in out
    assert "client   5:" in out and "nothing was trained or written" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_list_shows_defaults_and_meanings(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "lam = 1.0: weight of the prototype regulariser" in out and "mu = 0.01: weight of the proximal term" in out


# ---------------------------------------------------------------------------------------------------------------
# results API and reports


def test_results_api_takes_the_metric_first(tiny):
    df = run_experiment(tiny(rounds=3), write=False).table
    new = results.rounds_to_target(df, "test_acc", 0.0)
    assert new["round"].tolist() == [0] and new["rounds"].tolist() == [1]
    with pytest.raises(TypeError, match="metric must be a metric name"):  # the old order (df, target, metric)
        results.rounds_to_target(df, 0.0, "test_acc")
    with pytest.raises(results.MetricError, match="no client metric 'test_accc'.*test_acc"):
        results.final(df, "test_accc")
    with pytest.raises(KeyError):  # MetricError is a KeyError: callers that caught KeyError still do
        results.best(df, "nope")


def test_report_labels_several_metrics_per_client_and_missing_metric(tiny, tmp_path, capsys):
    run_experiment(tiny(rounds=2), out_dir=tmp_path / "runs" / "p")
    run_experiment(tiny(rounds=2, algorithm={"name": "fedavg", "params": {}}), out_dir=tmp_path / "runs" / "a")
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--metric", "test_acc_proto"]) == 2
    err = capsys.readouterr().err
    assert "run tiny-s7-" in err and "has no client metric 'test_acc_proto'" in err and str(tmp_path / "runs" / "a") in err
    # FedAvg's test_acc is the global model, FedProto's the client's own (issue 52): compared only knowingly
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--metric", "test_acc,train_loss",
                 "--per-client"]) == 2
    assert "--mixed-metrics" in capsys.readouterr().err and not (tmp_path / "rep" / "summary.md").exists()
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--metric", "test_acc,train_loss",
                 "--per-client", "--mixed-metrics"]) == 0
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| fedavg |" in md and "| fedproto |" in md and "## train_loss" in md
    for name in ("test_acc_vs_round.png", "train_loss_vs_bytes.png", "test_acc_per_client.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:4] == b"\x89PNG"


WATCHED_DRIVER = """
import subprocess, sys, time
from raysim.backends import ray_watchdog
child = subprocess.Popen(["bash", "-c", "exec -a ray::FakeWorker sleep 3600"])  # ends only if it is ended
ray_watchdog.start()
print(child.pid, flush=True)
time.sleep(3600)  # until the test kills it
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")
def test_watchdog_ends_ray_processes_of_a_killed_driver(tmp_path):
    """kill -9 of a driver: the Ray processes it started (here a stand-in named ray::FakeWorker) are ended by the
    watchdog (the stand-in sleeps an hour: nothing else ends it while the test waits)."""
    import signal

    status = tmp_path / "watched"
    driver = subprocess.Popen([sys.executable, "-c", WATCHED_DRIVER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), RAYSIM_WATCHDOG_STATUS=str(status)))
    child = int(driver.stdout.readline())

    def recorded():
        return status.exists() and str(child) in status.read_text().split()

    def alive(pid):  # a zombie (ended, not yet reaped by its new parent) counts as gone
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 120  # wait until the watchdog has recorded the stand-in (not a fixed sleep)
        while not recorded() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorded(), "the watchdog never recorded the driver's Ray process"
        assert driver.poll() is None and alive(child)  # both still running: what ends the stand-in is the kill below
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 60  # only so a broken watchdog fails instead of hanging (the stand-in sleeps 1 h)
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the driver's Ray process outlived it"
    finally:  # never leave the stand-in or the driver behind, whatever failed
        for pid in (child, driver.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        driver.wait()


def test_divergence_error_survives_pickling():
    """A diverged run inside a process pool or a Ray task reaches the caller as the same error (it failed to
    unpickle before: its constructor takes the event, not the message)."""
    import pickle

    from raysim.runner.safety import NonFinite, NonFiniteError

    e = pickle.loads(pickle.dumps(NonFiniteError(NonFinite(3, 1, "update", "train_loss=nan"))))
    assert isinstance(e, NonFiniteError) and e.event.round_idx == 3
    assert str(e).startswith("diverged: round 3, client 1, stage 'update': train_loss=nan")
