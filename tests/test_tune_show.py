"""Tuning hygiene (issue 52): a warning when the validation split is too small to rank trials, and
``raysim tune --show DIR|STORAGE`` (best trial, trials sorted by value, parameter importances)."""
from __future__ import annotations

import pandas as pd
import pytest
import yaml

from raysim.app.cli import main
from raysim.io.results import ResultTable, RESULTS_FILE, write_parquet
from tests.conftest import tiny_config
from tuning.show import MIN_VAL_PER_CLIENT, validation_warnings


def _run_with_val(path, sizes):
    path.mkdir(parents=True)
    t = ResultTable("r")
    t.add(0, 0, "client", "val_acc", 0.5)
    write_parquet(t.frame(), path / RESULTS_FILE, {"run_id": "r", "data": {"val_sizes": sizes}})
    return str(path)


def test_validation_warnings_small_split_and_ties(tmp_path):
    small = _run_with_val(tmp_path / "small", [16, 13, 20])
    big = _run_with_val(tmp_path / "big", [60, 80, 70])
    frame = lambda run, values: pd.DataFrame({"state": ["COMPLETE"] * len(values), "value": values,  # noqa: E731
                                              "run_dir": [run] * len(values)})
    (w,) = validation_warnings(frame(small, [0.5, 0.6]), "val_acc", 0.2)
    assert "median of 16 samples per client (min 13" in w and f"fewer than {MIN_VAL_PER_CLIENT}" in w
    assert "data.val_fraction" in w and "e.g. --set data.val_fraction=0.4" in w
    assert validation_warnings(frame(big, [0.5, 0.6]), "val_acc", 0.2) == []
    (w,) = validation_warnings(frame(big, [0.75, 0.5, 0.75]), "val_acc", 0.2)
    assert w.startswith("2 of 3 finished trials tie at the best value 0.75")
    worse_ties = frame(big, [0.9, 0.5, 0.5])  # ties below the best do not stop a ranking's winner
    assert validation_warnings(worse_ties, "val_acc", 0.2) == []


def test_tune_warns_and_show_prints_best_sorted_trials_and_importances(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(rounds=1, data__val_fraction=0.2)))
    space = tmp_path / "s.yaml"
    space.write_text(yaml.safe_dump({"params": {"train.lr": {"type": "categorical", "choices": [0.05, 0.0005]}},
                                     "objective": {"metric": "val_acc"}, "pruner": {"name": "none"},
                                     "sampler": {"name": "grid", "seed": 0}}))
    out = tmp_path / "t"
    assert main(["tune", str(cfg), "--space", str(space), "--trials", "2", "--out", str(out)]) == 0
    got = capsys.readouterr()
    # the tiny config: 30 training samples per client, 20 % validation -> 6 per client
    assert "WARNING: the validation split holds a median of 6 samples per client" in got.err
    assert f"raysim tune --show {out}" in got.out
    trials = pd.read_parquet(out / "trials.parquet").sort_values("value", ascending=False)
    for target in (str(out), f"journal:{out / 'study.journal'}"):
        assert main(["tune", "--show", target]) == 0
        text = capsys.readouterr().out
        best = trials.iloc[0]
        assert f"best: trial {int(best['number'])}, value {best['value']:.6g}, train.lr=" in text
        rows = [line for line in text.splitlines() if line.startswith("| ") and "number" not in line]
        assert [int(r.split("|")[1]) for r in rows] == trials["number"].astype(int).tolist()  # best first
        assert "parameter importances" in text and "train.lr" in text.split("parameter importances")[1]


@pytest.mark.parametrize("argv, field", [
    (["tune", "--show", "/nonexistent/dir"], "--show"),
    (["tune", "configs/fedproto_mnist5k.yaml", "--trials", "2"], "--space"),
])
def test_tune_show_and_missing_arguments_are_one_line(tmp_path, capsys, argv, field):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_tune_hint_names_the_storage_when_one_was_given(tmp_path):
    """The closing hint must find the study again: a --storage study is not in the output directory."""
    from types import SimpleNamespace

    from raysim.app.cli import show_args
    res = SimpleNamespace(out_dir=tmp_path / "t", study_name="s1")
    assert show_args(None, res) == f"--show {tmp_path / 't'}"
    assert show_args("sqlite:///runs/lam.db", res) == "--show sqlite:///runs/lam.db --study-name s1"
