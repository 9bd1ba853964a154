"""Every registered method reproduces its golden table (tests/golden/*.parquet) exactly: the same value and weight
for every (round, client, scope, metric) the golden run recorded. New metrics are allowed; a changed or missing
value is not. A commit that moves numbers on purpose regenerates the affected files (tests/golden/make_golden.py).

Exactly means on the CPU the table was made on (tests/golden/<name>.platform.json, else platform.json for older
tables: model, vector ISA, torch version). On
another CPU, float reductions run in another order and the last bits of losses (and, through them, of some later
values) differ: there every value must agree within rtol 1e-3 / atol 1e-5 instead, and counts, bytes and weights
exactly."""

import numpy as np
import pandas as pd
import pytest

from raysim.config import make_config
from raysim.driver import run_experiment
from tests.golden.make_golden import HERE, golden_config, names, platform, recorded_platform

KEY = ["round", "client_id", "scope", "metric"]


def compare_to_golden(name: str, table: pd.DataFrame) -> None:
    gold = pd.read_parquet(HERE / f"{name}.parquet")
    assert not gold.duplicated(KEY).any()
    got = table.drop(columns=["run_id"]).merge(gold, on=KEY, how="right", suffixes=("", "_gold"), indicator=True)
    missing = got[got["_merge"] != "both"]
    assert missing.empty, f"{name}: rows missing from the new table:\n{missing[KEY].head(20)}"
    same_cpu = recorded_platform(name) == platform()
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
