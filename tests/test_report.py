"""``raysim report`` and the seed-summary helpers against a hand-computed fixture; ``raysim run --seeds``."""
from __future__ import annotations

import math

import numpy as np

import pandas as pd
import pytest
import yaml

from tests.conftest import tiny_config
from raysim.io import results
from raysim.app.cli import main
from raysim.errors import ConfigError
from raysim.app.summary import ReportOptions, build_report
from raysim.io.results import ResultTable, write_parquet
from raysim.app.sweep import parse_seeds

# Fixture: setting "a" with seeds 1 and 2, setting "b" with seed 1; 2 clients, rounds 0..2, evaluated at 0 and 2.
#   a/s1: test_acc r0 (0.5, 0.7) -> 0.6, r2 (0.8, 0.9) -> 0.85; up_bytes 100 per round; sim_time 1, 2, 3
#   a/s2: test_acc r0 (0.4, 0.6) -> 0.5, r2 (0.9, 1.0) -> 0.95; up_bytes 100, 200, 300; sim_time 1, 1, 1
#   b/s1: test_acc r0 (0.2, 0.2) -> 0.2, r2 (0.4, 0.2) -> 0.3 (best at r2); up_bytes 10 per round; sim_time 5 each
RUNS = {
    ("a", 1): {"acc": {0: (0.5, 0.7), 2: (0.8, 0.9)}, "up": (100, 100, 100), "sim": (1, 2, 3)},
    ("a", 2): {"acc": {0: (0.4, 0.6), 2: (0.9, 1.0)}, "up": (100, 200, 300), "sim": (1, 1, 1)},
    ("b", 1): {"acc": {0: (0.2, 0.2), 2: (0.4, 0.2)}, "up": (10, 10, 10), "sim": (5, 5, 5)},
}


def write_fixture(root):
    dirs = []
    for (name, seed), spec in RUNS.items():
        cfg = tiny_config(name=name, seed=seed)
        if name == "b":
            cfg["algorithm"]["params"]["lam"] = 0.5
        run_id = f"{name}-s{seed}"
        t = ResultTable(run_id)
        for rnd in range(3):
            t.add(rnd, -1, "total", "up_bytes", spec["up"][rnd])
            t.add(rnd, -1, "total", "down_bytes", 2 * spec["up"][rnd])
            t.add(rnd, -1, "total", "sim_time", spec["sim"][rnd])
            if rnd in spec["acc"]:
                for cid, a in enumerate(spec["acc"][rnd]):
                    t.add(rnd, cid, "client", "test_acc", a)
        d = root / run_id
        d.mkdir()
        write_parquet(t.frame(), d / results.RESULTS_FILE, {"run_id": run_id, "config": cfg, "seed": seed})
        dirs.append(d)
    return dirs


def test_seed_summary_matches_hand_computation(tmp_path):
    dirs = write_fixture(tmp_path)
    index = results.run_index(dirs)
    assert index.groupby("group")["seed"].apply(sorted).tolist() == [[1, 2], [1]]  # a's seeds form one setting
    df = results.load(dirs)
    s = results.seed_summary(df, "test_acc", index, target=0.55, time="sim_time").set_index("group")
    a, b = s.loc[index.loc[0, "group"]], s.loc[index.loc[2, "group"]]
    sd = math.sqrt(((0.85 - 0.9) ** 2 + (0.95 - 0.9) ** 2) / 1)  # sample std of 0.85, 0.95
    assert a["runs"] == 2 and a["final_mean"] == pytest.approx(0.9) and a["final_std"] == pytest.approx(sd)
    # round columns count rounds completed (index + 1), as rounds_to_target and the plots' x
    assert a["best_mean"] == pytest.approx(0.9) and a["rounds_to_best_mean"] == 3 and a["rounds_run_mean"] == 3
    # target 0.55: a/s1 reaches it at round 0 (1 round, 1 time unit), a/s2 at round 2 (3 rounds, 3 time units)
    assert a["rounds_to_target_mean"] == pytest.approx(2.0) and a["rounds_to_target_std"] == pytest.approx(math.sqrt(2))
    assert a["sim_time_to_target_mean"] == pytest.approx(2.0) and a["reached"] == 2
    assert a["up_bytes_total_mean"] == pytest.approx(450) and a["up_bytes_total_std"] == pytest.approx(math.sqrt(45000))
    assert a["down_bytes_total_mean"] == pytest.approx(900)
    assert b["runs"] == 1 and b["final_mean"] == pytest.approx(0.3) and math.isnan(b["final_std"])
    assert b["reached"] == 0 and math.isnan(b["rounds_to_target_mean"])
    # the curves: per round mean over seeds, x = running bytes (up + down) averaged over seeds
    c = results.seed_curves(df, "test_acc", index, "bytes").set_index(["group", "round"])
    g = index.loc[0, "group"]
    assert c.loc[(g, 0), "mean"] == pytest.approx(0.55) and c.loc[(g, 0), "x"] == pytest.approx(300)
    assert c.loc[(g, 2), "mean"] == pytest.approx(0.9) and c.loc[(g, 2), "x"] == pytest.approx((900 + 1800) / 2)
    assert c.loc[(g, 2), "std"] == pytest.approx(sd)


def test_best_is_not_last_when_accuracy_drops():
    t = ResultTable("r")
    for rnd, accs in ((0, (0.6, 0.8)), (1, (0.5, 0.5))):
        for cid, a in enumerate(accs):
            t.add(rnd, cid, "client", "test_acc", a)
    df = t.frame()
    assert results.best(df)["round"].iloc[0] == 0 and results.best(df)["mean"].iloc[0] == pytest.approx(0.7)
    assert results.final(df)["mean"].iloc[0] == pytest.approx(0.5)


def test_report_writes_markdown_parquet_and_plots(tmp_path):
    dirs = write_fixture(tmp_path)
    files = build_report([tmp_path], tmp_path / "rep", ReportOptions(target=0.55, per_client=True),
                         log=lambda *a: None)
    md = files["summary.md"].read_text()
    assert "| fedproto (lam=1.0) | 2 | 1,2 | 0.9000 ± 0.0707 | 0.9000 ± 0.0707 | 3.0 ± 0.0 | 3 | 2.0 ± 1.4 (2/2 reached) |" in md
    assert "| fedproto (lam=0.5) | 1 | 1 |" in md and "± std over seeds" in md
    assert "0.3000 | 0.3000 |" in md and "(0/1 reached)" in md
    pngs = sorted(n for n in files if n.endswith(".png"))  # one pattern: <metric>_<what>.png (issue 52)
    assert pngs == ["test_acc_per_client.png", "test_acc_vs_bytes.png", "test_acc_vs_round.png",
                    "test_acc_vs_time.png"]  # sim_time is found automatically
    for name in pngs:
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = pd.read_parquet(files["summary.parquet"])
    assert sorted(summary["final_mean"].round(6)) == [0.3, 0.9]
    runs = pd.read_parquet(files["runs.parquet"])
    assert sorted(runs["run_id"]) == ["a-s1", "a-s2", "b-s1"]  # every run written is listed, once
    assert len(dirs) == len(runs)


def test_report_keeps_runs_with_the_same_id_apart(tmp_path):
    for sub in ("x", "y"):  # the same three runs written twice
        (tmp_path / sub).mkdir()
        write_fixture(tmp_path / sub)
    from raysim.app.summary import load_runs

    df, index = load_runs([tmp_path / "x", tmp_path / "y"])
    assert index["run_id"].is_unique and len(index) == 6 and df["run_id"].nunique() == 6


def test_cli_report_unknown_metric_exit_2(tmp_path, capsys):
    write_fixture(tmp_path)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep"), "--metric", "test_acc_proto"]) == 2
    assert "test_acc_proto" in capsys.readouterr().err


def test_parse_seeds():
    assert parse_seeds("1,2,3") == [1, 2, 3] and parse_seeds("1-3,10") == [1, 2, 3, 10] and parse_seeds("7") == [7]
    for bad in ("1,x", "3-1", "1,1", ""):
        with pytest.raises(ConfigError) as e:
            parse_seeds(bad)
        assert e.value.field == "--seeds"


def test_run_seeds_one_table_per_run(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(rounds=2)))
    assert main(["run", str(cfg), "--seeds", "3,4", "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    assert "2 seeds: final mean local test accuracy" in capsys.readouterr().out
    index = results.run_index(tmp_path / "runs")
    assert sorted(index["seed"]) == [3, 4] and index["group"].nunique() == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["seed3", "seed4"]
    for d in index["path"]:
        assert results.load_metadata(d)["config"]["seed"] == int(d[-1])
    # each seed's table equals a single run with that seed
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    ref = run_experiment(make_config(tiny_config(rounds=2, seed=4)), write=False, progress=False)
    got = results.load(tmp_path / "runs" / "seed4")
    pd.testing.assert_frame_equal(results.without_timing(got), results.without_timing(ref.table), check_dtype=False, check_exact=True)


def test_simulated_time_axis_comes_from_the_environment_rows(tmp_path):
    from raysim.io import results
    from raysim.config import make_config
    from raysim.app.summary import find_time_metric
    from raysim.engine.loop import run_experiment

    r = run_experiment(make_config(tiny_config(rounds=3, env={"preset": "mobile-heterogeneous"})), write=False)
    df = r.table
    assert find_time_metric(df) == "sim_round_s"
    axis = results.cumulative(df, "sim_round_s").set_index("round")["x"]
    sim = df[(df["scope"] == "env") & (df["metric"] == "sim_time")].set_index("round")["value"]
    assert np.allclose(axis.loc[sim.index].to_numpy(), sim.to_numpy())
