"""Optuna studies over tiny synthetic runs: search-space validation, objective maths, pruning, divergence,
persistence and resume after a kill (no lost or duplicated trials), parallel trials on Ray."""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

from tests.conftest import tiny_config
from raysim.io import results
from raysim.app.cli import main
from raysim.config import load_config
from raysim.errors import ConfigError
from raysim.io.results import ResultTable
from tuning.space import apply_params, check_against_config, parse_space
from tuning.study import RoundMonitor, counted, nonfinite_loss, objective_value, open_storage, tune

ROOT = Path(__file__).resolve().parents[1]
QUIET = lambda *a: None  # noqa: E731

def vcfg(**over):
    """The tiny config with a validation split (tuning selects on val_* metrics)."""
    return tiny_config(data__val_fraction=0.2, **over)


LAM = {"algorithm.params.lam": {"type": "float", "low": 0.01, "high": 10.0, "log": True}}


def _states(res):
    return res.trials.set_index("number")["state"].to_dict()


# ---------------------------------------------------------------------------------------------------------------
# the search-space file


@pytest.mark.parametrize("space, field", [
    ({"params": {}}, "space.params"),
    ({"params": {"algorithm.params.lam": {"type": "float", "low": 1.0, "high": 1.0}}}, "space.params.algorithm.params.lam.high"),
    ({"params": {"algorithm.params.lam": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}}, "space.params.algorithm.params.lam.low"),
    ({"params": {"algorithm.params.lam": {"type": "uniform", "low": 0, "high": 1}}}, "space.params.algorithm.params.lam.type"),
    ({"params": {"train.batch_size": {"type": "int", "low": 1.5, "high": 8}}}, "space.params.train.batch_size.low"),
    ({"params": {"x": {"type": "categorical"}}}, "space.params.x.choices"),
    ({"params": LAM, "pruner": {"name": "hyperband2"}}, "space.pruner.name"),
    ({"params": LAM, "objective": {"mode": "time_to_target"}}, "space.objective.target"),
    ({"params": LAM, "objective": {"mode": "last"}}, "space.objective.mode"),
    ({"params": LAM, "sampler": {"name": "grid"}}, "space.params.algorithm.params.lam.type"),
    ({"params": LAM, "sampler": {"name": "grdi"}}, "space.sampler.name"),
    ({"params": LAM, "trial_seed": "random"}, "space.trial_seed"),
    ({"params": LAM, "prunner": {}}, "space.prunner"),
])
def test_space_errors_name_the_field(space, field):
    with pytest.raises(ConfigError) as e:
        parse_space(space)
    assert e.value.field == field


@pytest.mark.parametrize("params, field", [
    ({"algorithm.params.lamb": {"type": "float", "low": 0.1, "high": 1}}, "space.params.algorithm.params.lamb"),
    ({"algorithm.params.lam": {"type": "float", "low": -1.0, "high": 1}}, "space.params.algorithm.params.lam"),
    ({"train.lrr": {"type": "float", "low": 0.1, "high": 1}}, "space.params.train.lrr"),
    ({"train.lr": {"type": "float", "low": -0.1, "high": 1}}, "space.params.train.lr"),
])
def test_space_checked_against_the_config(params, field):
    with pytest.raises(ConfigError) as e:
        check_against_config(parse_space({"params": params}), vcfg())
    assert e.value.field == field


def test_apply_params_sets_dotted_keys_exactly():
    cfg = apply_params(vcfg(), {"algorithm.params.lam": 1e20, "train.batch_size": 3}, seed=11)
    assert cfg.algorithm.params["lam"] == 1e20 and isinstance(cfg.algorithm.params["lam"], float)
    assert cfg.train.batch_size == 3 and cfg.seed == 11
    assert vcfg()["algorithm"]["params"]["lam"] == 1.0  # the base is not modified


def test_bad_storage_url():
    with pytest.raises(ConfigError) as e:
        open_storage("study.txt")
    assert e.value.field == "--storage"


# ---------------------------------------------------------------------------------------------------------------
# objective and monitor maths on a hand-written table


def _table():
    """2 clients, rounds 0..3, evaluated at 1 and 3; client accs r1: 0.4, 0.6 (mean 0.5); r3: 0.7, 0.9 (0.8);
    bytes up+down per round 10, 20, 30, 40."""
    t = ResultTable("r")
    for rnd in range(4):
        t.add(rnd, -1, "total", "up_bytes", 4 * (rnd + 1))
        t.add(rnd, -1, "total", "down_bytes", 6 * (rnd + 1))
        t.add(rnd, 0, "client", "train_loss", 1.0)
    for rnd, accs in ((1, (0.4, 0.6)), (3, (0.7, 0.9))):
        for cid, a in enumerate(accs):
            t.add(rnd, cid, "client", "test_acc", a)
    return t.frame()


@pytest.mark.parametrize("objective, expected", [
    ({"mode": "final"}, 0.8),
    ({"mode": "best"}, 0.8),
    ({"mode": "time_to_target", "target": 0.45}, 2.0),  # reached after round 1: 2 rounds done
    ({"mode": "time_to_target", "target": 0.75, "time": "bytes"}, 100.0),  # 10+20+30+40
    ({"mode": "time_to_target", "target": 0.45, "time": "bytes"}, 30.0),
    ({"mode": "time_to_target", "target": 0.95}, 8.0),  # never: miss_penalty 2 x 4 rounds
])
def test_objective_value_hand_computed(objective, expected):
    space = parse_space({"params": LAM, "objective": objective})
    assert objective_value(_table(), space) == pytest.approx(expected)


def test_best_differs_from_final():
    df = _table()
    df.loc[(df["round"] == 3) & (df["metric"] == "test_acc"), "value"] = [0.3, 0.5]
    assert objective_value(df, parse_space({"params": LAM, "objective": {"mode": "best"}})) == pytest.approx(0.5)
    assert objective_value(df, parse_space({"params": LAM, "objective": {"mode": "final"}})) == pytest.approx(0.4)


class _FakeTrial:
    def __init__(self, prune_at=None):
        self.reports, self.prune_at = [], prune_at

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.prune_at is not None and self.reports[-1][0] >= self.prune_at


def test_round_monitor_reports_prunes_and_detects_nan():
    space = parse_space({"params": LAM, "objective": {"mode": "time_to_target", "target": 0.9}})
    t = ResultTable("r")
    trial = _FakeTrial(prune_at=3)
    mon = RoundMonitor(trial, space)
    t.add(0, 0, "client", "train_loss", 0.5)
    t.add(0, -1, "mean", "test_acc", 0.25)
    assert mon(0, t) is False
    t.add(1, -1, "mean", "test_acc", 0.5)
    assert mon(1, t) is False
    assert trial.reports == [(0, -0.25), (1, -0.5)]  # minimised objective: -accuracy
    t.add(3, -1, "mean", "test_acc", 0.6)
    assert mon(3, t) is True and mon.pruned_at == 3 and mon.diverged is None
    mon2 = RoundMonitor(_FakeTrial(), space)
    t.add(4, 2, "client", "train_proto", float("inf"))
    t.add(4, -1, "mean", "test_acc", 0.6)
    assert mon2(4, t) is True
    assert mon2.diverged == "diverged: train_proto=inf at round 4 (client 2)"


def test_nonfinite_loss_in_table():
    df = _table()
    assert nonfinite_loss(df) is None
    df.loc[(df["metric"] == "train_loss") & (df["round"] == 2), "value"] = math.nan
    assert nonfinite_loss(df) == "diverged: train_loss=nan at round 2 (client 0)"


# ---------------------------------------------------------------------------------------------------------------
# studies


def test_tiny_study_runs_prunes_and_exports(tmp_path):
    space = {"params": {"train.lr": {"type": "categorical", "choices": [0.05, 0.0005]}},
             "pruner": {"name": "median", "n_startup_trials": 1}, "sampler": {"name": "random", "seed": 0}}
    res = tune(vcfg(rounds=4), space, 4, out_dir=tmp_path / "s", log=QUIET)
    t = res.trials.set_index("number")
    # seed 0 draws lr 0.0005, 0.05, 0.0005, 0.0005: the first is a start-up trial, the last two fall below the
    # median of the finished ones at round 0 and stop there
    assert t["params_train.lr"].tolist() == [0.0005, 0.05, 0.0005, 0.0005]
    assert t["state"].tolist() == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"]
    assert t.loc[[2, 3], "last_round"].tolist() == [0, 0] and t.loc[[0, 1], "last_round"].tolist() == [3, 3]
    for n, row in t.iterrows():
        cfg = apply_params(vcfg(rounds=4, output__progress=False), {"train.lr": row["params_train.lr"]})
        assert row["seed"] == 7 and row["config_hash"] == cfg.config_hash()
        assert (Path(row["run_dir"]) / "results.parquet").exists()
    # the objective is the Parquet table's final mean client accuracy
    df = results.load(t.loc[1, "run_dir"])
    val = df[(df["scope"] == "client") & (df["metric"] == "val_acc")]
    assert t.loc[1, "value"] == pytest.approx(float(val[val["round"] == 3]["value"].mean()))  # by hand: last round
    exported = pd.read_parquet(res.files["trials"])
    assert len(exported) == 4 and set(exported["state"]) == {"COMPLETE", "PRUNED"}
    best = load_config(res.files["best"])
    assert best.train.lr == 0.05 and res.best_params == {"train.lr": 0.05}


def test_grid_study_runs_every_point_once_and_resumes(tmp_path):
    grid = {"params": {"algorithm.params.lam": {"type": "categorical", "choices": [0.1, 1.0]},
                       "train.lr": {"type": "categorical", "choices": [0.05, 0.01]}},
            "pruner": {"name": "none"}, "sampler": {"name": "grid", "seed": 0}}
    with pytest.raises(ConfigError) as e:
        tune(vcfg(rounds=1), grid, 5, out_dir=tmp_path / "g", log=QUIET)
    assert e.value.field == "--trials" and "4 points" in str(e.value)
    first = tune(vcfg(rounds=1), grid, 4, out_dir=tmp_path / "g", log=QUIET, stop_after=2)  # as if interrupted
    assert first.ran == 2
    res = tune(vcfg(rounds=1), grid, 4, out_dir=tmp_path / "g", log=QUIET)
    assert res.ran == 2
    points = sorted(zip(res.trials["params_algorithm.params.lam"], res.trials["params_train.lr"]))
    assert points == [(0.1, 0.01), (0.1, 0.05), (1.0, 0.01), (1.0, 0.05)]


def test_diverging_trial_fails_with_reason_and_study_goes_on(tmp_path):
    space = {"params": {"algorithm.params.lam": {"type": "categorical", "choices": [1.0, 1e8]}},
             "pruner": {"name": "none"}, "sampler": {"name": "random", "seed": 0}}
    res = tune(vcfg(rounds=3), space, 3, out_dir=tmp_path / "s", log=QUIET)
    t = res.trials.set_index("number")
    assert t["params_algorithm.params.lam"].tolist() == [1e8, 1.0, 1e8]
    assert t["state"].tolist() == ["FAIL", "COMPLETE", "FAIL"]
    assert t.loc[0, "outcome"] == "diverged" and ("=nan at round" in t.loc[0, "reason"]
                                                   or "=inf at round" in t.loc[0, "reason"])
    assert res.best_params == {"algorithm.params.lam": 1.0}
    # diverged trials count as finished: asking for 3 again runs nothing
    again = tune(vcfg(rounds=3), space, 3, out_dir=tmp_path / "s", log=QUIET)
    assert again.ran == 0 and len(again.trials) == 3


def test_resume_recovers_an_orphaned_trial(tmp_path):
    """A trial left RUNNING by a driver process that is gone is failed as interrupted and retried once."""
    space = {"params": LAM, "pruner": {"name": "none"}, "sampler": {"name": "random", "seed": 3}}
    out = tmp_path / "s"
    first = tune(vcfg(rounds=2), space, 5, out_dir=out, log=QUIET, stop_after=2)
    assert first.ran == 2
    pid_max = Path("/proc/sys/kernel/pid_max")
    if pid_max.exists():  # a PID above the kernel's largest is never alive (a just-exited one may be reused)
        pid = int(pid_max.read_text()) + 1
    else:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        pid = int(dead.stdout)
    study = optuna.load_study(study_name="tiny-tune", storage=open_storage(f"journal:{out / 'study.journal'}"))
    orphan = study.ask()
    orphan.set_user_attr("driver", f"{socket.gethostname()}:{pid}")
    lam = orphan.suggest_float("algorithm.params.lam", 0.01, 10.0, log=True)
    res = tune(vcfg(rounds=2), space, 5, out_dir=out, log=QUIET)
    t = res.trials.set_index("number")
    assert t.loc[2, "state"] == "FAIL" and t.loc[2, "outcome"] == "interrupted"
    assert t.loc[3, "retry_of"] == 2 and t.loc[3, "params_algorithm.params.lam"] == lam
    finished = t[t["state"].isin(["COMPLETE", "PRUNED"])]
    assert len(finished) == 5 and res.ran == 3
    assert finished["params_algorithm.params.lam"].is_unique  # a resumed sampler does not replay old draws


def test_killed_study_resumes_without_lost_or_duplicated_trials(tmp_path):
    cfg_file, space_file, out = tmp_path / "tiny.yaml", tmp_path / "space.yaml", tmp_path / "study"
    # the study's third trial waits in its second round (tests/failing_algo.py HoldFedProto): it is killed there, a
    # known point, after exactly two finished trials (no race with a trial that finishes as the kill comes)
    cfg_file.write_text(yaml.safe_dump(vcfg(rounds=6, algorithm={"name": "tests.failing_algo:HoldFedProto",
                                                                 "params": {"lam": 1.0}})))
    space_file.write_text(yaml.safe_dump({"params": LAM, "pruner": {"name": "none"},
                                          "sampler": {"name": "random", "seed": 5}}))
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    hold = tmp_path / "hold"
    hold.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               RAYSIM_TEST_HOLD_DIR=str(hold))
    cmd = [sys.executable, "-m", "raysim.app.cli", "tune", str(cfg_file), "--space", str(space_file), "--trials", "6",
           "--storage", storage, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600  # only so a study that never holds fails instead of hanging
        while not (hold / "holding").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (hold / "holding").exists(), ("the study ended before its third trial held" if proc.poll() is not None
                                             else "the third trial never reached its hold")
        proc.send_signal(signal.SIGKILL)  # mid-trial, no cleanup
    finally:
        proc.kill()
        proc.wait()
    S = optuna.trial.TrialState
    before = optuna.load_study(study_name="tiny-tune", storage=storage).get_trials()
    done_before = {t.number: t.params for t in before if t.state == S.COMPLETE}
    orphans = [t for t in before if t.state == S.RUNNING]
    assert len(done_before) == 2 and len(orphans) == 1
    res = tune(cfg_file, yaml.safe_load(space_file.read_text()), 6, storage=storage, out_dir=out, log=QUIET)
    t = res.trials.set_index("number")
    complete = t[t["state"] == "COMPLETE"]
    assert len(complete) == 6  # nothing lost
    assert res.ran == 6 - len(done_before)  # nothing finished before the kill ran again
    for n, params in done_before.items():
        assert t.loc[n, "state"] == "COMPLETE" and t.loc[n, "params_algorithm.params.lam"] == params["algorithm.params.lam"]
    o = orphans[0].number
    assert t.loc[o, "outcome"] == "interrupted"
    retry = t[t["retry_of"] == o]
    assert len(retry) == 1 and retry["state"].iloc[0] == "COMPLETE"
    assert retry["params_algorithm.params.lam"].iloc[0] == orphans[0].params["algorithm.params.lam"]
    assert complete["params_algorithm.params.lam"].is_unique
    runs = sorted(p.name for p in (out / "trials").iterdir())  # the killed run's .tmp directory is gone
    assert runs == [f"trial_{n:04d}" for n in sorted(complete.index)]


def test_first_trial_runs_the_given_baseline(tmp_path):
    space = {"params": LAM, "pruner": {"name": "none"}, "sampler": {"name": "random", "seed": 0}}
    with pytest.raises(ConfigError) as e:
        tune(vcfg(rounds=1), space, 2, out_dir=tmp_path, log=QUIET, first_params={"train.lr": 0.1})
    assert e.value.field == "--first" and not (tmp_path / "study.journal").exists()
    res = tune(vcfg(rounds=1), space, 2, out_dir=tmp_path, log=QUIET, first_params={"algorithm.params.lam": 1.0})
    lams = res.trials.sort_values("number")["params_algorithm.params.lam"].tolist()
    assert lams[0] == 1.0 and lams[1] != 1.0


def test_changed_space_refuses_to_resume(tmp_path):
    tune(vcfg(rounds=1), {"params": LAM, "pruner": {"name": "none"}}, 1, out_dir=tmp_path, log=QUIET)
    other = {"params": {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 1.0}}, "pruner": {"name": "none"}}
    with pytest.raises(ConfigError) as e:
        tune(vcfg(rounds=1), other, 2, out_dir=tmp_path, log=QUIET)
    assert e.value.field == "--study-name"


def test_cli_tune_bad_space_exit_code_2(tmp_path, capsys):
    cfg_file, space_file = tmp_path / "c.yaml", tmp_path / "s.yaml"
    cfg_file.write_text(yaml.safe_dump(vcfg()))
    space_file.write_text(yaml.safe_dump({"params": {"algorithm.params.lamda": {"low": 0.1, "high": 1.0}}}))
    assert main(["tune", str(cfg_file), "--space", str(space_file), "--trials", "2", "--out", str(tmp_path / "o")]) == 2
    assert "space.params.algorithm.params.lamda" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.ray
def test_parallel_trials_on_ray_match_in_process_runs(tmp_path, ray_session):
    from raysim.engine.loop import run_experiment

    space = {"params": LAM, "pruner": {"name": "none"}, "sampler": {"name": "random", "seed": 1},
             "trial_resources": {"num_cpus": 1, "num_gpus": 0.5}}  # the session declares 2 fake GPUs (no CUDA used)
    base = vcfg(rounds=2, backend__name="ray")  # trials run the sequential backend inside their task
    res = tune(base, space, 3, out_dir=tmp_path / "s", parallel=2, log=QUIET)
    t = res.trials.set_index("number")
    assert t["state"].tolist() == ["COMPLETE"] * 3 and res.ran == 3
    lam = t.loc[2, "params_algorithm.params.lam"]
    ref = run_experiment(apply_params(vcfg(rounds=2), {"algorithm.params.lam": lam}), write=False, progress=False)
    assert t.loc[2, "value"] == ref.final("val_acc")[0]
    assert counted(optuna.load_study(study_name="tiny-tune", storage=open_storage(
        f"journal:{tmp_path / 's' / 'study.journal'}")).get_trials()) == 3


@pytest.mark.ray
def test_parallel_trials_asking_for_missing_gpus_fail_fast(tmp_path, ray_session):
    space = {"params": LAM, "trial_resources": {"num_cpus": 1, "num_gpus": 3}}
    with pytest.raises(ConfigError) as e:
        tune(vcfg(rounds=1), space, 2, out_dir=tmp_path, parallel=2, log=QUIET)
    assert e.value.field == "space.trial_resources.num_gpus"
