"""Every registered method reproduces its golden table (tests/golden/*.parquet) exactly: the same value and weight
for every (round, client, scope, metric) the golden run recorded. New metrics are allowed; a changed or missing
value is not. Wall-time rows (round_s, step_s@*) are never in a golden table. A commit that moves numbers on purpose regenerates the affected files (tests/golden/make_golden.py).

Exactly means on the CPU the table was made on (tests/golden/<name>.platform.json, else platform.json for older
tables: model, vector ISA, torch version; a variant <name>@<cpu>.parquet holds another CPU's exact table). On
another CPU, float reductions run in another order and the last bits of losses (and, through them, of some later
values) differ: there every value must agree within rtol 1e-3 / atol 1e-5 instead, and counts, bytes and weights
exactly."""

import numpy as np
import pandas as pd
import pytest

from raysim.config import make_config
from raysim.engine.loop import run_experiment
from raysim.io.results import ROUND_TIME, is_timing
from tests.golden.make_golden import golden_config, golden_tables, names, platform

KEY = ["round", "client_id", "scope", "metric"]


def pick_golden(name: str):
    """(table path, exact): the table made on this CPU when there is one (main or variant), else the main table,
    compared within the cross-CPU tolerance."""
    tables = golden_tables(name)
    here = platform()
    for path, made_on in tables:
        if made_on == here:
            return path, True
    return tables[0][0], False


def compare_to_golden(name: str, table: pd.DataFrame) -> None:
    path, same_cpu = pick_golden(name)
    gold = pd.read_parquet(path)
    assert not gold.duplicated(KEY).any()
    assert not gold["metric"].map(is_timing).any(), f"{name}: the golden table holds wall-time rows"
    assert table["metric"].eq(ROUND_TIME).any(), f"{name}: the run recorded no round_s rows"
    got = table.drop(columns=["run_id"]).merge(gold, on=KEY, how="right", suffixes=("", "_gold"), indicator=True)
    missing = got[got["_merge"] != "both"]
    assert missing.empty, f"{name}: rows missing from the new table:\n{missing[KEY].head(20)}"
    if same_cpu:
        bad = got[(got["value"] != got["value_gold"]) & ~(got["value"].isna() & got["value_gold"].isna())]
    else:
        v, g = got["value"].to_numpy(float), got["value_gold"].to_numpy(float)
        floaty = ~got["metric"].str.contains("bytes|floats|participants|failures|count|num_", regex=True).to_numpy()
        ok = np.where(floaty, np.isclose(v, g, rtol=1e-3, atol=1e-5, equal_nan=True), (v == g) | (np.isnan(v) & np.isnan(g)))
        bad = got[~ok]
    assert bad.empty, f"{name}: values differ from the golden table:\n{bad[KEY + ['value', 'value_gold']].head(20)}"
    badw = got[got["weight"] != got["weight_gold"]]
    assert badw.empty, f"{name}: weights differ:\n{badw[KEY + ['weight', 'weight_gold']].head(20)}"


@pytest.mark.parametrize("name", names())
def test_golden_table(name):
    res = run_experiment(make_config(golden_config(name)), write=False)
    compare_to_golden(name, res.table)


def test_pick_golden_prefers_this_cpus_table(monkeypatch, tmp_path):
    """The table made on this CPU is compared exactly (main or variant); with none, the main table within tolerance."""
    import tests.test_golden as tg

    here, other = {"cpu": "A", "isa": [], "torch": "1"}, {"cpu": "B", "isa": [], "torch": "1"}
    main, var = tmp_path / "m.parquet", tmp_path / "m@a.parquet"
    monkeypatch.setattr(tg, "platform", lambda: here)
    monkeypatch.setattr(tg, "golden_tables", lambda name: [(main, other), (var, here)])
    assert tg.pick_golden("m") == (var, True)
    monkeypatch.setattr(tg, "golden_tables", lambda name: [(main, here), (var, other)])
    assert tg.pick_golden("m") == (main, True)
    monkeypatch.setattr(tg, "golden_tables", lambda name: [(main, other)])
    assert tg.pick_golden("m") == (main, False)
