"""Every registered method reproduces its golden table (tests/golden/*.parquet) exactly: the same value and weight
for every (round, client, scope, metric) the golden run recorded. New metrics are allowed; a changed or missing
value is not. Wall-time rows (round_s, step_s@*) are never in a golden table. A commit that moves numbers on purpose
regenerates the affected files (tests/golden/make_golden.py, which prints each table's difference first).

Exactly means on every CPU: the golden runs use portable numerics (raysim/numerics.py: one kernel choice on every
CPU with AVX2), and there is one table per method, no per-CPU variant and no tolerance. A comparison that cannot be
exact — the table was made with another torch or numpy version (tests/golden/<name>.json) — fails and says so."""

from pathlib import Path

import pandas as pd
import pytest

from raysim.config import make_config
from raysim.engine.loop import run_experiment
from raysim.io.results import ROUND_TIME, is_timing
from tests.golden.make_golden import EXACT_KEYS, KEY, difference, golden_config, made_with, names, recorded

HERE = Path(__file__).parent / "golden"
REGEN = ("regenerate with `python tests/golden/make_golden.py` (it prints each table's difference from the committed "
         "one and refuses changed counts or bytes), review that only float values moved, and commit with the reason")


def exactness_problem(name: str, rec, here: dict):
    """Why ``name``'s table cannot be compared exactly here (None when it can)."""
    if rec is None:
        return f"{name}: tests/golden/{name}.json is missing (what the table was made with); {REGEN}"
    off = [f"{k} {rec.get(k)} there, {here[k]} here" for k in EXACT_KEYS if rec.get(k) != here[k]]
    if off:
        return (f"{name}: the golden table was made with other versions ({'; '.join(off)}), so an exact comparison "
                f"is impossible; {REGEN}")
    return None


def compare_to_golden(name: str, table: pd.DataFrame, counts=(), gold=None) -> None:
    if gold is None:
        gold = pd.read_parquet(HERE / f"{name}.parquet")
    assert not gold.duplicated(KEY).any()
    assert not gold["metric"].map(is_timing).any(), f"{name}: the golden table holds wall-time rows"
    assert table["metric"].eq(ROUND_TIME).any(), f"{name}: the run recorded no round_s rows"
    new = table.drop(columns=["run_id"], errors="ignore")
    new = new[~new["metric"].map(is_timing)]
    got = new.merge(gold, on=KEY, how="right", suffixes=("", "_gold"), indicator=True)
    missing = got[got["_merge"] != "both"]
    assert missing.empty, f"{name}: rows missing from the new table:\n{missing[KEY].head(20)}"
    lines, counts_moved = difference(new.merge(gold[KEY], on=KEY), gold, set(counts))
    assert not lines, (f"{name}: differs from the golden table" + (" (counts or bytes changed!)" if counts_moved else "")
                       + ":\n" + "\n".join(lines))


@pytest.mark.parametrize("name", names())
def test_golden_table(name):
    problem = exactness_problem(name, recorded(name), made_with())
    if problem:
        pytest.fail(problem)
    res = run_experiment(make_config(golden_config(name)), write=False)
    assert res.metadata["numerics"]["mode"] == "portable"
    compare_to_golden(name, res.table, res.metadata["count_metrics"])


def test_golden_files_are_one_per_method():
    """No per-CPU variants, no platform files: one table and one record per method."""
    assert sorted(p.stem for p in HERE.glob("*.parquet")) == names()
    assert sorted(p.stem for p in HERE.glob("*.json")) == names()


def test_exactness_problem_names_the_versions():
    here = {"numerics": "portable", "torch": "2.14.1", "numpy": "2.4.6", "made_on": "X"}
    assert exactness_problem("m", dict(here, made_on="Y"), here) is None  # another CPU is not a reason
    msg = exactness_problem("m", dict(here, torch="2.11.0"), here)
    assert "torch 2.11.0 there, 2.14.1 here" in msg and "make_golden.py" in msg
    assert "missing" in exactness_problem("m", None, here)


def test_compare_reports_a_moved_value_and_a_moved_count():
    gold = pd.DataFrame({"round": [0, 0], "client_id": [0, 0], "scope": ["client", "client"],
                         "metric": ["test_acc", "up_bytes"], "value": [0.5, 100.0], "weight": [1.0, 1.0]})
    run = gold.assign(run_id="r")
    run = pd.concat([run, pd.DataFrame({"run_id": ["r"], "round": [0], "client_id": [-1], "scope": ["round"],
                                        "metric": [ROUND_TIME], "value": [0.1], "weight": [1.0]})])
    compare_to_golden("m", run, ["up_bytes"], gold)  # identical: passes
    moved = run.assign(value=run["value"].where(run["metric"] != "test_acc", 0.5 + 1e-12))
    with pytest.raises(AssertionError, match=r"test_acc \(float\): 1 of 1 values changed"):
        compare_to_golden("m", moved, ["up_bytes"], gold)
    grown = run.assign(value=run["value"].where(run["metric"] != "up_bytes", 104.0))
    with pytest.raises(AssertionError, match=r"(?s)counts or bytes changed.*up_bytes \(count\)"):
        compare_to_golden("m", grown, ["up_bytes"], gold)
