"""raysim reproduce for long work: an estimated time per experiment in --list (from stored wall times), sorted by
cost; per-run progress with the time left; --smoke (one seed, 2 rounds, its own directory, "not a verdict")."""
from __future__ import annotations

import json

from raysim.app.cli import main
from raysim.app.reproduction_cost import SMOKE_ROUNDS
from tests.test_reproduce import _write_root


def _store(out, name, walls):
    d = out / name
    d.mkdir(parents=True)
    runs = [{"label": label, "seed": s, "wall_s": w, "cpu": "Test CPU"} for label, s, w in walls]
    (d / "reproduction.json").write_text(json.dumps({"experiment": name, "runs": runs}))


def test_list_estimates_time_from_stored_wall_times_and_sorts_by_cost(tmp_path, capsys):
    root = _write_root(tmp_path)
    out = tmp_path / "out"
    # toy_table: Local 10 s and FedProto 30 s per run at 2 seeds -> 80 s; toy_table_short: 1000 s per run -> 4000 s
    _store(out, "toy_table", [("Local", 1, 10.0), ("FedProto (λ=1)", 1, 20.0), ("FedProto (λ=1)", 2, 40.0)])
    _store(out, "toy_table_short", [("Local", 1, 1000.0)])
    assert main(["reproduce", "--list", "--configs", str(root), "--out", str(out), "--sort", "cost"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("toy")]
    assert lines[0].split()[:2] == ["toy_table", "~80"] and "2 runs x 2 seeds" in lines[0]
    assert lines[1].split()[:2] == ["toy_table_short", "~67"]  # 4000 s: 67 min (the missing label takes the mean)
    (out / "toy_table_short" / "reproduction.json").unlink()
    assert main(["reproduce", "--list", "--configs", str(root), "--out", str(out), "--sort", "cost"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("toy")]
    assert "no stored time" in lines[-1] and lines[-1].startswith("toy_table_short")  # unknown cost: last


def test_smoke_is_one_seed_two_rounds_in_its_own_directory_and_not_a_verdict(tmp_path, capsys):
    root = _write_root(tmp_path, rounds=4)
    out = tmp_path / "out"
    assert main(["reproduce", "toy_table", "--smoke", "--configs", str(root), "--out", str(out), "--no-report"]) == 0
    text = capsys.readouterr()
    smoke = tmp_path / "out-smoke" / "toy_table"
    assert not out.exists() and sorted(p.name for p in (smoke / "local").iterdir()) == ["seed1"]
    md = (smoke / "reproduction.md").read_text()
    assert md.startswith("**Smoke test: not a verdict.**")
    data = json.loads((smoke / "reproduction.json").read_text())
    assert "not a verdict" in data["smoke"] and all("smoke" in c["verdict"] for c in data["claims"])
    cfg = (smoke / "local" / "seed1" / "config.yaml").read_text()
    assert f"rounds: {SMOKE_ROUNDS}" in cfg
    # per-run progress, whatever the configs' output.progress (false in the toy configs): each run's rounds (lines:
    # the test's stderr is no terminal) and the time left
    assert "toy_local s1 round 2/2: " in text.err and "toy_fedproto s1 round 2/2: " in text.err
    assert "Local seed 1: done in " in text.out and "left (1 run(s))" in text.out
