"""raysim reproduce: manifests, the table beside the seed's numbers, reuse of finished runs, and bad input."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import yaml

from raysim.app import seed_experiments as rp
from raysim.app.reproduction_table import run_value
from raysim.app.cli import main
from raysim.errors import ConfigError
from tests.conftest import tiny_config


def _write_root(tmp_path, rounds=2):
    root = tmp_path / "configs"
    folder = root / "seed999_toy"
    folder.mkdir(parents=True)
    for algo in ("local", "fedproto"):
        cfg = tiny_config(name=f"toy_{algo}", rounds=rounds, algorithm={"name": algo, "params": {}})
        (folder / f"{algo}.yaml").write_text(yaml.safe_dump(cfg))
    manifest = {
        "toy_table": {
            "title": "toy", "source": "seed999.table1", "seeds": [1, 2], "metric": "test_acc",
            "extra_metrics": ["train_loss", "test_acc_proto"], "percent": True, "scaled": "toy size",
            "runs": [{"label": "Local", "config": "local.yaml", "paper": "local"},
                     {"label": "FedProto (λ=1)", "config": "fedproto.yaml", "set": ["algorithm.params.lam=1.0"],
                      "paper": "fedproto"}],
            "claims": [{"text": "FedProto beats Local", "better": "FedProto (λ=1)", "worse": "Local"}],
        },
        "toy_table_short": {"extends": "toy_table", "scaled": "one round", "set": ["rounds=1"]},
    }
    (folder / "experiments.yaml").write_text(yaml.safe_dump(manifest, allow_unicode=True, sort_keys=False))
    numbers = {"seed999": {"table1": {"source": "seed 999, Table 1", "values": {
        "local": {"test_acc": 50.0}, "fedproto": {"test_acc": 60.0}}}}}
    (root / "seed_numbers.yaml").write_text(yaml.safe_dump(numbers))
    return root


def test_slug_and_extends(tmp_path):
    assert rp.slug("FedProto (λ=1)") == "fedproto-1"
    assert rp.slug("MAFML a=10%") == "mafml-a-10"
    assert rp.slug("PN-ICFL+ lam=0.2") == "pn-icfl-plus-lam-0-2" != rp.slug("PN-ICFL lam=0.2")
    exps = rp.load_experiments(_write_root(tmp_path))
    short = exps["toy_table_short"]
    assert short.overrides == ("rounds=1",) and short.scaled == "one round"
    assert [r.label for r in short.runs] == ["Local", "FedProto (λ=1)"]
    assert short.run("FedProto (λ=1)").overrides == ("algorithm.params.lam=1.0",)


def test_run_value_by_hand():
    rows = []
    for rnd, vals, val in ((0, [0.2, 0.4], [0.5, 0.1]), (1, [0.6, 0.8], [0.3, 0.2]), (2, [0.5, 0.7], [0.2, 0.35])):
        for cid, (v, w) in enumerate(zip(vals, val)):
            rows.append(("r", rnd, cid, "client", "test_acc", v, 1.0))
            rows.append(("r", rnd, cid, "client", "val_acc", w, 1.0))
    rows.append(("r", 2, -1, "server", "ari", 0.75, 1.0))
    df = pd.DataFrame(rows, columns=["run_id", "round", "client_id", "scope", "metric", "value", "weight"])
    assert run_value(df, "test_acc") == pytest.approx(0.6)  # last round: (0.5 + 0.7) / 2
    # per run: val means 0.3, 0.25, 0.275 -> round 0 -> (0.2 + 0.4) / 2
    assert run_value(df, "test_acc", "val_acc") == pytest.approx(0.3)
    # per client: client 0 best at round 0 (0.5) -> 0.2; client 1 best at round 2 (0.35) -> 0.7
    assert run_value(df, "test_acc", "val_acc", "client") == pytest.approx(0.45)
    assert run_value(df, "ari") == pytest.approx(0.75) and run_value(df, "server:ari") == 0.75
    with pytest.raises(ConfigError, match="test_loss"):
        run_value(df, "test_loss")


def test_reproduce_table_reuse_and_mismatch(tmp_path, capsys):
    root = _write_root(tmp_path)
    out = tmp_path / "out"
    args = ["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report"]
    assert main(args) == 0
    table = (out / "toy_table" / "reproduction.md").read_text()
    assert "| Local | 2 |" in table and "seed 999, Table 1" in table and "50.00" in table
    assert "test_acc_proto" in table  # Local has no prototype accuracy: its cell is '–', FedProto's a number
    data = json.loads((out / "toy_table" / "reproduction.json").read_text())
    runs = pd.DataFrame(data["runs"])
    assert sorted(runs["seed"]) == [1, 1, 2, 2] and (runs["floats"][runs["label"] == "Local"] == 0).all()
    fp = runs[runs["label"] == "FedProto (λ=1)"]
    assert (fp["floats"] > 0).all()
    # the table's numbers are the runs' own (issue 51): the mean over the last 5 evaluated rounds (here every one) of
    # the mean over clients, x 100; the final round beside it
    from raysim.io import results

    got, final = [], []
    for seed in (1, 2):
        df = results.load(out / "toy_table" / "fedproto-1" / f"seed{seed}")
        acc = df[(df["scope"] == "client") & (df["metric"] == "test_acc")]
        per_round = acc.groupby("round")["value"].mean().sort_index()
        got.append(100 * per_round.iloc[-5:].mean())
        final.append(100 * per_round.iloc[-1])
        rec = [r for r in data["runs"] if r["label"] == "FedProto (λ=1)" and r["seed"] == seed][0]
        assert rec["window"] == min(5, len(per_round)) and len(rec["curve"]) == len(per_round)
    row = [r for r in data["table"] if r["label"] == "FedProto (λ=1)"][0]
    assert row["test_acc_mean"] == pytest.approx(sum(got) / 2)
    assert row["test_acc_final_mean"] == pytest.approx(sum(final) / 2)
    assert row["test_acc_paper"] == 60.0
    claim = data["claims"][0]
    assert claim["paper"] == pytest.approx(10.0)
    # two seeds are fewer than the default minimum (3): the claim has its paired numbers but no verdict
    assert claim["n"] == 2 and claim["min_n"] == 3 and claim["verdict"] == "n too small"
    assert sorted(claim["diffs"]) == ["1", "2"] and "n too small (2 of 3)" in table and "n = 2" in table
    # every run's record: seed, config hash, code version, numerics mode, CPU
    from raysim.engine.provenance import code_version

    assert all(r["code"] == code_version() and r["config_hash"] and r["numerics"] and r["cpu"] for r in data["runs"])
    assert f"source {code_version()['source']}" in table
    capsys.readouterr()
    # a second call reuses every finished run
    stamp = (out / "toy_table" / "local" / "seed1" / "results.parquet").stat().st_mtime_ns
    assert main(args) == 0
    assert "4 finished and reused, 0 to run" in capsys.readouterr().out
    assert (out / "toy_table" / "local" / "seed1" / "results.parquet").stat().st_mtime_ns == stamp
    # another configuration into the same place: refused, never mixed
    assert main(args + ["--set", "train.lr=0.01"]) == 2
    assert "another configuration" in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [
    (["reproduce", "nope"], "experiment"),
    (["reproduce", "toy_table", "--seeds", "1,x"], "--seeds"),
    (["reproduce", "toy_table", "--set", "data.dataset=fashion_mnist", "--set", "data.root=/nonexistent/fm"],
     "data.root"),
    (["reproduce"], "experiment"),
    (["reproduce", "toy_table", "--jobs", "0"], "--jobs"),
    (["reproduce", "toy_table", "--jobs", "2", "--backend", "ray"], "--jobs"),
])
def test_bad_input_one_line_nothing_written(tmp_path, capsys, argv, field):
    root = _write_root(tmp_path)
    out = tmp_path / "out"
    assert main(argv + ["--configs", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert not out.exists()


def test_shipped_manifests_load():
    """Every experiment shipped in configs/ resolves: its configs exist, labels are unique, claims name runs,
    sources and paper keys are in seed_numbers.yaml."""
    exps = rp.load_experiments()
    numbers = rp.load_numbers()
    for e in exps.values():
        rp.source_entry(e, numbers)
        for r in e.runs:
            for m in (e.metric, *e.extra_metrics):
                v = rp.paper_value(e, numbers, r, m.split(":", 1)[-1])
                assert r.paper is None or isinstance(v, float)
            assert not math.isnan(len(r.overrides))


def test_a_diverged_run_is_a_result_named_in_the_table_and_not_rerun(tmp_path, capsys):
    """One run of the experiment diverges (NaN under on_nonfinite: stop): the other runs finish, the table names the
    diverged run with its round and client, exit 0; a second reproduction with the same config skips it."""
    root = _write_root(tmp_path)
    manifest = yaml.safe_load((root / "seed999_toy" / "experiments.yaml").read_text())
    manifest["toy_diverge"] = {"extends": "toy_table", "runs": [
        {"label": "Local", "config": "local.yaml", "paper": "local"},
        {"label": "Local lr 1e30", "config": "local.yaml", "set": ["train.lr=1.0e+30"]}], "claims": []}
    (root / "seed999_toy" / "experiments.yaml").write_text(yaml.safe_dump(manifest, allow_unicode=True, sort_keys=False))
    out = tmp_path / "out"
    args = ["reproduce", "toy_diverge", "--configs", str(root), "--out", str(out), "--no-report", "--seeds", "1"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "diverged: round 0, client 0" in log
    table = (out / "toy_diverge" / "reproduction.md").read_text()
    assert "| Local | 1 |" in table
    assert "Diverged (left out of the table" in table and "Local lr 1e30 seed 1 (diverged: round 0, client 0" in table
    assert "Not finished" not in table
    assert main(args) == 0
    assert "1 diverged before, 0 to run" in capsys.readouterr().out


def test_jobs_run_side_by_side_with_the_numbers_of_one_at_a_time(tmp_path, capsys):
    """--jobs 2: each run in its own process; every run's table equals the one-at-a-time run's."""
    from raysim.io import results

    root = _write_root(tmp_path)
    tables = {}
    for jobs in (1, 2):
        out = tmp_path / f"out{jobs}"
        assert main(["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report",
                     "--jobs", str(jobs)]) == 0
        tables[jobs] = {p.relative_to(out): results.without_timing(results.load(p.parent))
                        for p in sorted(out.glob("toy_table/*/seed*/results.parquet"))}
    assert "2 at a time" in capsys.readouterr().out
    assert len(tables[1]) == 4 and tables[1].keys() == tables[2].keys()
    for k in tables[1]:
        pd.testing.assert_frame_equal(tables[1][k], tables[2][k], check_exact=True)


def test_a_run_another_process_holds_is_left_to_it(tmp_path, capsys):
    """Two raysim reproduce processes on one --out share the work: a run whose working directory is locked by a
    live run is skipped (named as not finished), not an error; once free, the next reproduction runs it."""
    from raysim.io import rundir

    root = _write_root(tmp_path)
    out = tmp_path / "out"
    args = ["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report", "--seeds", "1"]
    held = rundir.RunDir.claim(out / "toy_table" / "local" / "seed1")  # as another process's run would hold it
    try:
        assert main(args) == 0
        log = capsys.readouterr().out
        assert "Local seed 1: running in another process" in log
        table = (out / "toy_table" / "reproduction.md").read_text()
        assert "Not finished (left out of the table): Local seed 1" in table
    finally:
        held.abandon(keep=False)
    assert main(args) == 0
    assert "1 finished and reused, 1 to run" in capsys.readouterr().out
    assert (out / "toy_table" / "local" / "seed1" / "results.parquet").exists()


def test_a_run_finished_by_another_process_after_planning_is_reused_not_redone(tmp_path, capsys):
    """Each run's state is looked at when it starts: a plan made before another process finished the run reuses it
    (no second copy in seed1-2)."""
    root = _write_root(tmp_path)
    out = tmp_path / "out"
    exp = rp.load_experiments(root)["toy_table"]
    stale = rp.plan(exp, [1], out)  # planned while nothing had run
    assert main(["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report", "--seeds", "1"]) == 0
    capsys.readouterr()
    rp.execute(stale)
    assert "finished meanwhile by another process; reused" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "toy_table" / "local").iterdir()) == ["seed1"]


def test_config_errors_cross_process_boundaries_intact():
    import pickle

    from raysim.io.rundir import RunDirBusy

    for e in (ConfigError("a.b", "bad value"), RunDirBusy("--out", "held")):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and back.field == e.field and str(back) == str(e)


def test_a_crash_in_a_worker_stops_the_reproduction_with_its_message(tmp_path, capsys, monkeypatch):
    """--jobs 2: a run that crashes (a client failure under on_client_failure: stop) in a worker ends the command
    with that error (exit 1); the workers get the registrations made in the parent (a test-only algorithm)."""
    from tests.conftest import register_for_test

    register_for_test(monkeypatch, failing_fedavg="tests.failing_algo:FailingFedAvg")
    root = _write_root(tmp_path)
    folder = root / "seed999_toy"
    cfg = tiny_config(name="toy_failing", rounds=2, on_client_failure="stop",
                      algorithm={"name": "failing_fedavg", "params": {"fail_clients": [0], "fail_round": 0}})
    (folder / "failing.yaml").write_text(yaml.safe_dump(cfg))
    manifest = yaml.safe_load((folder / "experiments.yaml").read_text())
    manifest["toy_crash"] = {"extends": "toy_table", "claims": [], "runs": [
        {"label": "Local", "config": "local.yaml"}, {"label": "Failing", "config": "failing.yaml"}]}
    (folder / "experiments.yaml").write_text(yaml.safe_dump(manifest, allow_unicode=True, sort_keys=False))
    out = tmp_path / "out"
    code = main(["reproduce", "toy_crash", "--configs", str(root), "--out", str(out), "--no-report", "--seeds", "1",
                 "--jobs", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "boom on client 0" in err, err
    assert not (out / "toy_crash" / "failing" / "seed1" / "results.parquet").exists()


def _stamp_code(run_dir, code):
    """Rewrite a finished run's recorded code version (as a run made by other code would have it)."""
    info = json.loads((run_dir / "run.json").read_text())
    if code is None:
        info["versions"].pop("code", None)
    else:
        info["versions"]["code"] = code
    (run_dir / "run.json").write_text(json.dumps(info))


def test_a_run_of_another_code_version_is_reused_only_knowingly(tmp_path, capsys):
    """A finished run whose config hash matches but whose code version differs (or was never recorded) is not
    reused silently: one line names the runs and the versions; reuse_any (--reuse-any) reuses them and the table
    names every code version it holds."""
    from raysim.engine.provenance import code_version, label
    from raysim.app.reproduction_table import write_table

    root = _write_root(tmp_path)
    out = tmp_path / "out"
    assert main(["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report"]) == 0
    capsys.readouterr()
    exp = rp.load_experiments(root)["toy_table"]
    assert {p.status for p in rp.plan(exp, [1, 2], out)} == {"reuse"}  # same code: reused
    other = dict(code_version(), source="0123456789abcdef", commit="f" * 40, dirty=False)
    _stamp_code(out / "toy_table" / "local" / "seed1", other)
    _stamp_code(out / "toy_table" / "local" / "seed2", other)
    _stamp_code(out / "toy_table" / "fedproto-1" / "seed2", None)  # a run from before code versions were recorded
    with pytest.raises(ConfigError) as e:
        rp.plan(exp, [1, 2], out)
    msg = str(e.value)
    assert e.value.field == "--reuse-any" and "\n" not in msg
    assert "3 finished run(s)" in msg and "Local seed 1, Local seed 2: raysim 0.1.0 source 0123456789abcdef" in msg
    assert "commit ffffffffffff" in msg and "FedProto (λ=1) seed 2: not recorded" in msg
    assert label(code_version()) in msg and "--reuse-any" in msg
    # the command stops with that one line before anything runs
    args = ["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another code version" in err[0]
    # knowingly: reused, and the table says which code made which runs
    planned = rp.plan(exp, [1, 2], out, reuse_any=True)
    assert {p.status for p in planned} == {"reuse"}
    table = write_table(exp, planned, out, rp.load_numbers(root), report=False, log=lambda *a: None).read_text()
    assert "source 0123456789abcdef (commit ffffffffffff) (2 runs)" in table
    assert "not recorded (a run made before code versions were recorded) (1 run)" in table
    assert f"{label(code_version())} (1 run)" in table
