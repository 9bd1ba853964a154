"""Every registered method reproduces its golden table (tests/golden/*.parquet) exactly: the same value and weight
for every (round, client, scope, metric) the golden run recorded. New metrics are allowed; a changed or missing
value is not. A commit that moves numbers on purpose regenerates the affected files (tests/golden/make_golden.py)."""
import pandas as pd
import pytest

from raysim.config import make_config
from raysim.driver import run_experiment
from tests.golden.make_golden import HERE, golden_config, names

KEY = ["round", "client_id", "scope", "metric"]


def compare_to_golden(name: str, table: pd.DataFrame) -> None:
    gold = pd.read_parquet(HERE / f"{name}.parquet")
    assert not gold.duplicated(KEY).any()
    got = table.drop(columns=["run_id"]).merge(gold, on=KEY, how="right", suffixes=("", "_gold"), indicator=True)
    missing = got[got["_merge"] != "both"]
    assert missing.empty, f"{name}: rows missing from the new table:\n{missing[KEY].head(20)}"
    bad = got[(got["value"] != got["value_gold"]) & ~(got["value"].isna() & got["value_gold"].isna())]
    assert bad.empty, f"{name}: values differ from the golden table:\n{bad[KEY + ['value', 'value_gold']].head(20)}"
    badw = got[got["weight"] != got["weight_gold"]]
    assert badw.empty, f"{name}: weights differ:\n{badw[KEY + ['weight', 'weight_gold']].head(20)}"


@pytest.mark.parametrize("name", names())
def test_golden_table(name):
    res = run_experiment(make_config(golden_config(name)), write=False)
    compare_to_golden(name, res.table)
