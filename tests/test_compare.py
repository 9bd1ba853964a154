"""``raysim compare`` and ``raysim.results.paired`` (issue 52, item 4) on hand-made result tables with known paired
differences; the refusals of compare and report (issue 52, item 3). The verdicts are raysim.verdicts' (the code of
``raysim reproduce``'s claims): t_{0.975, 2} = 4.302653 for three seeds."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from raysim import verdicts
from raysim.app.cli import main
from raysim.app.compare import CompareOptions, compare
from raysim.errors import ConfigError
from raysim.io import results
from raysim.io.results import ResultTable, write_parquet
from tests.conftest import tiny_config

T2 = 4.302652729749464
# setting -> (algorithm params or method, {seed: final client mean}); round 0 is 0.5 for every run
FINAL = {
    "base": ({"lam": 1.0}, {1: 0.60, 2: 0.62, 3: 0.61}),
    "better": ({"lam": 0.5}, {1: 0.70, 2: 0.73, 3: 0.75, 4: 0.80}),  # d = .10, .11, .14 (seed 4 unpaired): held
    "worse": ({"lam": 2.0}, {1: 0.55, 2: 0.59, 3: 0.57}),  # d = -.05, -.03, -.04: reversed
    "same": ({"lam": 3.0}, {1: 0.62, 2: 0.60, 3: 0.62}),  # d = +.02, -.02, +.01: tie
}


def write_run(root, setting, seed, final, algorithm=None, dataset="synthetic"):
    cfg = tiny_config(name=setting, seed=seed)
    cfg["algorithm"] = algorithm or {"name": "fedproto", "params": FINAL[setting][0]}
    cfg["data"]["dataset"] = dataset
    run_id = f"{setting}-s{seed}"
    t = ResultTable(run_id)
    for rnd, v in ((0, 0.5), (2, final)):
        for cid, dv in enumerate((-0.01, 0.01)):  # two clients whose mean is v
            t.add(rnd, cid, "client", "test_acc", v + dv)
        t.add(rnd, -1, "server", "global_test_acc", v)
    d = root / setting / f"seed{seed}"
    d.mkdir(parents=True)
    write_parquet(t.frame(), d / results.RESULTS_FILE, {"run_id": run_id, "config": cfg, "seed": seed})
    return d


@pytest.fixture
def runs(tmp_path):
    for setting, (_, values) in FINAL.items():
        for seed, v in values.items():
            write_run(tmp_path / "runs", setting, seed, v)
    return tmp_path / "runs"


def _paired(root, settings, **kw):
    df = results.load([root / s for s in settings])
    index = results.run_index([root / s for s in settings]).assign(setting=lambda x: x["name"])
    return results.paired(df, "test_acc", index, **kw).set_index("setting")


def test_paired_differences_by_hand(runs):
    t = _paired(runs, ["base", "better", "worse", "same"])
    b = t.loc["better"]
    sd = math.sqrt(((0.10 - 0.35 / 3) ** 2 + (0.11 - 0.35 / 3) ** 2 + (0.14 - 0.35 / 3) ** 2) / 2)
    assert b["n"] == 3 and b["mean"] == pytest.approx(0.35 / 3) and b["sd"] == pytest.approx(sd)
    assert b["half"] == pytest.approx(T2 * sd / math.sqrt(3)) and b["verdict"] == "held"
    assert b["seeds"] == "1,2,3" and b["unpaired"] == "better: seed(s) 4 without a base run"
    assert json.loads(b["diffs"]) == pytest.approx({"1": 0.10, "2": 0.11, "3": 0.14})
    assert b["setting_mean"] == pytest.approx((0.70 + 0.73 + 0.75) / 3) and b["baseline"] == "base"
    w = t.loc["worse"]
    assert w["mean"] == pytest.approx(-0.04) and w["half"] == pytest.approx(T2 * 0.01 / math.sqrt(3))
    assert w["verdict"] == "reversed"
    assert t.loc["same"]["verdict"] == "tie"
    # the same numbers as reproduce's verdict code, called directly
    same = verdicts.judge({1: 0.62, 2: 0.60, 3: 0.62}, {1: 0.60, 2: 0.62, 3: 0.61})
    assert t.loc["same"]["lo"] == pytest.approx(same["lo"]) and t.loc["same"]["p"] == pytest.approx(same["p"])


def test_lower_is_better_flips_and_a_window_averages_the_last_rounds(runs):
    t = _paired(runs, ["base", "better"], lower_is_better=True)
    assert t.loc["better"]["verdict"] == "reversed" and t.loc["better"]["mean"] == pytest.approx(-0.35 / 3)
    w = _paired(runs, ["base", "better"], last=2)  # rounds 0 (0.5 everywhere) and 2: half the difference
    assert w.loc["better"]["mean"] == pytest.approx(0.35 / 6) and w.loc["better"]["rounds"] == "last 2"
    assert w.loc["better"]["verdict"] == "held"
    other = _paired(runs, ["base", "better"], baseline="better")
    assert list(other.index) == ["base"] and other.loc["base"]["mean"] == pytest.approx(-0.35 / 3)


def test_two_runs_of_one_seed_in_a_setting_are_refused(runs, tmp_path):
    write_run(tmp_path / "again", "base", 1, 0.9)
    df = results.load([runs / "base", tmp_path / "again", runs / "better"])
    index = results.run_index([runs / "base", tmp_path / "again", runs / "better"]).assign(setting=lambda x: x["name"])
    with pytest.raises(ConfigError, match="two runs of seed 1"):
        results.paired(df, "test_acc", index)


def test_raysim_compare_writes_the_table_the_parquet_and_the_plot(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", str(runs / "base"), str(runs / "better"), str(runs / "worse"), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "compare.parquet", "compare_test_acc.png"]
    md = (out / "compare.md").read_text()
    assert "| fedproto (lam=0.5) | fedproto (lam=1.0) | 3 | 1,2,3 | 0.7267 | 0.6100 | +0.1167 ± 0.0517 " \
           "[+0.0650, +0.1684] | 0.0104 | held |" in md
    assert "| fedproto (lam=2.0) | fedproto (lam=1.0) | 3 | 1,2,3 |" in md and "| reversed |" in md
    # seeds that do not pair up: one line on stderr naming them, and in the table's notes
    err = [ln for ln in captured.err.splitlines() if "do not pair up" in ln]
    assert err == ["raysim compare: seeds that do not pair up (left out): fedproto (lam=0.5): seed(s) 4 without a "
                   "fedproto (lam=1.0) run"]
    table = pd.read_parquet(out / "compare.parquet")
    assert list(table.columns) == results.PAIRED_COLUMNS and len(table) == 2


def test_labels_name_the_settings(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--label", f"FedProto λ=1={runs / 'base'}", "--label", f"small λ={runs / 'same'}",
                 "--out", str(out), "--no-plot"]) == 0
    md = (out / "compare.md").read_text()
    assert "| small λ | FedProto λ=1 | 3 | 1,2,3 |" in md and "| tie |" in md


@pytest.mark.parametrize("case, field, text", [
    ("mixed", "--metric", "test_acc evaluates different models across these settings (the client's own model: "
                          "fedproto; the global model: fedavg)"),
    ("dataset", "RUNS", "runs of different datasets"),
    ("label", "--label", "no finished run under"),
    ("metric", "--metric", "has no client or server metric 'test_acc_proto'"),
    ("one", "RUNS", "one setting only"),
    ("baseline", "--baseline", "'nope' is not a setting here"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(runs, tmp_path, capsys, case, field, text):
    extra = tmp_path / "extra"
    argv = ["compare", str(runs / "base")]
    if case == "mixed":
        for s in (1, 2, 3):
            write_run(extra, "fedavg", s, 0.6, {"name": "fedavg", "params": {}})
        argv.append(str(extra / "fedavg"))
    elif case == "dataset":
        for s in (1, 2, 3):
            write_run(extra, "better", s, 0.6, dataset="digits")
        argv.append(str(extra / "better"))
    elif case == "label":
        (tmp_path / "empty").mkdir()
        argv += [str(runs / "better"), "--label", f"x={tmp_path / 'empty'}"]
    elif case == "metric":
        argv += [str(runs / "better"), "--metric", "test_acc_proto"]
    elif case == "baseline":
        argv += [str(runs / "better"), "--baseline", "nope"]
    out = tmp_path / "cmp"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config error at '{field}'" in err and text in err, err
    assert not out.exists()


def test_mixed_kinds_compared_knowingly_say_so(runs, tmp_path):
    for s in (1, 2, 3):
        write_run(tmp_path / "extra", "fedavg", s, 0.6, {"name": "fedavg", "params": {}})
    files = compare([runs / "base", tmp_path / "extra" / "fedavg"], tmp_path / "cmp",
                    CompareOptions(mixed_metrics=True, plot=False), log=lambda m: None)
    assert "compared as asked (--mixed-metrics)" in files["compare.md"].read_text()
    # a metric of one kind across them needs no flag: the server's global_test_acc ... is FedAvg's only
    assert compare([runs / "base", runs / "better"], tmp_path / "cmp2", CompareOptions(metric="global_test_acc",
                                                                                    plot=False), log=lambda m: None)


def test_report_refuses_mixed_kinds_too(runs, tmp_path, capsys):
    for s in (1, 2, 3):
        write_run(tmp_path / "extra", "fedavg", s, 0.6, {"name": "fedavg", "params": {}})
    out = tmp_path / "rep"
    assert main(["report", str(runs / "base"), str(tmp_path / "extra" / "fedavg"), "--out", str(out),
                 "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mixed-metrics" in err and not (out / "summary.md").exists()
    assert main(["report", str(runs / "base"), str(tmp_path / "extra" / "fedavg"), "--out", str(out), "--no-plots",
                 "--mixed-metrics"]) == 0
    assert "evaluates different models across these settings" in (out / "summary.md").read_text()


def test_fedproto_and_fedtgp_prototype_accuracy_are_different_kinds():
    """The issue's case: FedProto's test_acc_proto picks among the client's own classes, FedTGP's among all."""
    from raysim.app.measures import kind_of, mixed

    assert kind_of("fedproto", {}, "test_acc_proto") == "prototype_own"
    assert kind_of("fedtgp", {}, "test_acc_proto") == "prototype_all"
    assert kind_of("fedtgp", {"restrict_local_classes": True}, "val_acc_proto") == "prototype_own"
    assert kind_of("fedavg", {}, "test_acc") == "global" and kind_of("fedproto", {}, "test_acc") == "personalised"
    cfgs = {"FedProto": {"algorithm": {"name": "fedproto"}}, "FedTGP": {"algorithm": {"name": "fedtgp"}}}
    assert mixed(cfgs, "test_acc_proto") is not None and mixed(cfgs, "test_acc") is None


def test_raysim_list_says_what_each_metric_measures(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    import re

    blocks, name = {}, None
    for line in out.splitlines():
        m = re.match(r"^  (\w+)", line)
        name = m.group(1) if m else name
        blocks[name] = blocks.get(name, "") + line + "\n"
    assert "measures: test_acc, test_bwt, test_fwt, test_acc_all, global_test_acc = the global model" in \
        blocks["fedavg"]
    assert "measures: test_acc = the client's own model; test_acc_proto = nearest global prototype, among the " \
           "client's own classes" in blocks["fedproto"]
    assert "test_acc_proto = nearest global prototype, among all classes" in blocks["fedtgp"]
    assert "val_* is test_*'s model on the validation split" in out


README_NAMES = {"FedAvg": ["fedavg"], "FedProx": ["fedprox"], "SCAFFOLD": ["scaffold"], "MOON": ["moon"],
                "FedGen": ["fedgen"], "FedAvg-UH (FedAvg's iteration mode with `eval_model: local`: the node's own)":
                ["fedavg_uh"], "SlaugFL": ["slaugfl"], "VHL": ["vhl"], "Local": ["local"], "FedPer": ["fedper"],
                "LG-FedAvg": ["lgfedavg"], "FedGen-Ht": ["fedgen_ht"], "FedProto(-UH)": ["fedproto", "fedproto_uh"],
                "FedTGP": ["fedtgp"], "FedDistill": ["feddistill"], "FedFomo": ["fedfomo"], "FML": ["fml"],
                "FedKD": ["fedkd"], "FedMD": ["fedmd"], "MAFML": ["mafml"], "IND": ["ind"], "AGG": ["agg"],
                "FeSEM": ["fesem"], "IFCA": ["ifca"], "PN-ICFL(+)": ["pnicfl", "pnicfl_plus"]}


def test_the_readme_s_metric_table_is_what_the_methods_declare():
    """README, result table: the test_acc row names every shipped method under the model its measures() declares."""
    import re
    from pathlib import Path

    from raysim.algorithm import MEASURES
    from raysim.config.registry import ALGORITHMS, algorithm_class

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `test_acc` |"))
    listed = {}
    for kind_text, names in re.findall(r"\*\*([^*]+)\*\*: ([^;|]+)", row):
        kind = next(k for k, v in MEASURES.items() if v == kind_text)
        for display in [n.strip() for n in re.split(r", (?![^(]*\))", names.strip())]:
            for name in README_NAMES[display]:
                listed[name] = kind
    shipped = sorted(n for n, t in ALGORITHMS.items() if t.startswith("algorithms."))
    assert sorted(listed) == shipped
    assert {n: algorithm_class(n).measures()["test_acc"] for n in shipped} == listed
