"""Verdicts of a seed's claims (raysim/app/verdicts.py): the Student t quantile, the paired 95 % interval and each
verdict, computed by hand; the claims table raysim reproduce writes from them; min_seeds in the manifests."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml

from raysim.app import seed_experiments as rp
from raysim.app import verdicts as vd
from raysim.errors import ConfigError
from raysim.app.reproduction_table import render_records, summarise, table_markdown


# ------------------------------------------------------------------------------------------------ the t quantile

def test_t_quantile_closed_forms():
    # df = 1 (Cauchy): P(|T| < t) = (2/pi) atan(t), so t_0.975 = tan(0.95 pi / 2)
    assert vd.t_quantile(0.975, 1) == pytest.approx(math.tan(0.95 * math.pi / 2), rel=1e-12)
    # df = 2: P(|T| < t) = t / sqrt(t^2 + 2) = 0.95  ->  t^2 = 2 * 0.9025 / 0.0975
    assert vd.t_quantile(0.975, 2) == pytest.approx(math.sqrt(2 * 0.9025 / 0.0975), rel=1e-12)
    assert vd.t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)


@pytest.mark.parametrize("df, t", [(3, 3.182446), (4, 2.776445), (5, 2.570582), (9, 2.262157), (29, 2.045230),
                                   (10000, 1.960201)])
def test_t_quantile_matches_the_printed_table(df, t):
    assert vd.t_quantile(0.975, df) == pytest.approx(t, abs=1e-6)


def test_t_cdf_shape():
    for df in (1, 2, 3, 4, 7):
        assert vd.t_cdf(0.0, df) == 0.5
        assert vd.t_cdf(1.3, df) + vd.t_cdf(-1.3, df) == pytest.approx(1.0)
        assert vd.t_cdf(vd.t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-12)
    assert vd.t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert vd.t_quantile(0.025, 2) == pytest.approx(-vd.t_quantile(0.975, 2))
    with pytest.raises(ValueError):
        vd.t_quantile(1.0, 3)
    with pytest.raises(ValueError):
        vd.t_cdf(1.0, 0)


# ------------------------------------------------------------------------------------------------ the interval

T2 = math.sqrt(2 * 0.9025 / 0.0975)  # t_{0.975, 2}, the multiplier of every 3-seed interval below


def test_paired_interval_by_hand():
    # seeds 1, 2, 3: differences 1, 2, 3 -> mean 2, sd 1, half-width t_{0.975,2} / sqrt(3) = 2.4841
    res = vd.judge({1: 10.0, 2: 12.0, 3: 14.0}, {1: 9.0, 2: 10.0, 3: 11.0})
    assert res["diffs"] == {1: 1.0, 2: 2.0, 3: 3.0} and res["n"] == 3
    assert res["mean"] == pytest.approx(2.0) and res["sd"] == pytest.approx(1.0)
    assert res["half"] == pytest.approx(T2 / math.sqrt(3)) == pytest.approx(2.484138, abs=1e-6)
    assert (res["lo"], res["hi"]) == (pytest.approx(2 - 2.484138, abs=1e-6), pytest.approx(2 + 2.484138, abs=1e-6))
    assert res["verdict"] == "tie"  # the interval [-0.48, 4.48] contains 0
    assert vd.format_interval(res) == "+2.00 ± 2.48 [-0.48, +4.48]"


def test_pairing_is_by_seed_not_by_mean():
    # unpaired the two methods overlap completely (means 2 vs 1.5, spread 1); paired, every seed gains exactly 0.5
    better = {1: 1.0, 2: 2.0, 3: 3.0}
    worse = {1: 0.5, 2: 1.5, 3: 2.5}
    res = vd.judge(better, worse)
    assert res["sd"] == 0.0 and res["lo"] == res["hi"] == pytest.approx(0.5) and res["verdict"] == "held"
    # a seed only one method has (4), or a NaN (seed 5), is not paired: n counts pairs
    res = vd.judge({**better, 4: 9.0, 5: math.nan}, {**worse, 5: 1.0, 6: 2.0})
    assert res["n"] == 3 and sorted(res["diffs"]) == [1, 2, 3]


@pytest.mark.parametrize("better, worse, lower, verdict", [
    ([12.0, 13.0, 14.0], [10.0, 10.0, 10.0], False, "held"),      # d 2, 3, 4: 3 ± 2.48 -> [0.52, 5.48]
    ([10.0, 10.0, 10.0], [12.0, 13.0, 14.0], False, "reversed"),  # d -2, -3, -4 -> [-5.48, -0.52]
    ([11.0, 12.0, 13.0], [10.0, 10.0, 10.0], False, "tie"),       # d 1, 2, 3 -> [-0.48, 4.48]
    ([10.0, 10.0, 10.0], [12.0, 13.0, 14.0], True, "held"),       # lower is better: d = worse - better = 2, 3, 4
    ([5.0, 5.0, 5.0], [5.0, 5.0, 5.0], False, "tie"),             # d 0, 0, 0: [0, 0] contains 0
])
def test_each_verdict_by_hand(better, worse, lower, verdict):
    seeds = [1, 2, 3]
    res = vd.judge(dict(zip(seeds, better)), dict(zip(seeds, worse)), lower_is_better=lower)
    assert res["verdict"] == verdict


def test_the_held_interval_by_hand():
    res = vd.judge({1: 12.0, 2: 13.0, 3: 14.0}, {1: 10.0, 2: 10.0, 3: 10.0})
    assert res["lo"] == pytest.approx(3 - T2 / math.sqrt(3)) and res["lo"] == pytest.approx(0.515862, abs=1e-6)


def test_n_too_small_whatever_the_numbers():
    big = {1: 100.0, 2: 101.0, 3: 102.0}
    small = {1: 0.0, 2: 0.0, 3: 0.0}
    assert vd.judge(big, small, min_n=3)["verdict"] == "held"
    assert vd.judge(big, small, min_n=5)["verdict"] == "n too small"  # the seed ran 5: 3 seeds give no verdict
    assert vd.judge({1: 100.0, 2: 101.0}, {1: 0.0, 2: 0.0})["verdict"] == "n too small"  # 2 < 3
    one = vd.judge({1: 1.0}, {1: 0.0})
    assert one["verdict"] == "n too small" and math.isnan(one["half"]) and vd.format_interval(one) == "+1.00"
    assert vd.format_interval(vd.judge({}, {})) == "–"
    five = {s: 10.0 + s for s in range(1, 6)}
    assert vd.judge(five, {s: 0.0 for s in five}, min_n=5)["verdict"] == "held"
    assert vd.count(["held", "tie", "held", "n too small"]) == {"held": 2, "tie": 1, "underpowered": 0,
                                                                        "reversed": 0, "n too small": 1}


# ------------------------------------------------------------------------------------------------ the claims table

def _experiment(tmp_path, seeds=(1, 2, 3), min_seeds=None, claims=None):
    folder = tmp_path / "configs" / "seed999_toy"
    folder.mkdir(parents=True)
    (folder / "a.yaml").write_text("name: a\n")
    body = {"title": "toy", "source": "seed999.table1", "seeds": list(seeds), "metric": "test_acc",
            "runs": [{"label": "A", "config": "a.yaml", "paper": "a"}, {"label": "B", "config": "a.yaml", "paper": "b"},
                     {"label": "C", "config": "a.yaml"}],
            "claims": claims if claims is not None else [
                {"text": "A beats B", "better": "A", "worse": "B"},
                {"text": "B beats A", "better": "B", "worse": "A"},
                {"text": "A beats C", "better": "A", "worse": "C"},
                {"text": "A sends fewer floats than B", "better": "A", "worse": "B", "metric": "floats",
                 "lower_is_better": True}]}
    if min_seeds is not None:
        body["min_seeds"] = min_seeds
    (folder / "experiments.yaml").write_text(yaml.safe_dump({"toy": body}))
    (tmp_path / "configs" / "seed_numbers.yaml").write_text(yaml.safe_dump(
        {"seed999": {"table1": {"source": "seed 999, Table 1", "values": {"a": {"test_acc": 70.0},
                                                                          "b": {"test_acc": 65.0}}}}}))
    return rp.load_experiments(tmp_path / "configs")["toy"], rp.load_numbers(tmp_path / "configs")


def _per_run(values: dict) -> pd.DataFrame:
    rows = []
    for label, (accs, floats) in values.items():
        for seed, acc in accs.items():
            rows.append({"label": label, "seed": seed, "path": f"/x/{label}/seed{seed}", "test_acc": acc,
                         "floats": floats, "setup_floats": 0.0, "wall_s": 1.0})
    return pd.DataFrame(rows)


PER_RUN = {"A": ({1: 80.0, 2: 81.0, 3: 82.0}, 100.0),   # A - B = 2, 3, 4: held
           "B": ({1: 78.0, 2: 78.0, 3: 78.0}, 400.0),
           "C": ({1: 79.0, 2: 79.0, 3: 79.0}, 0.0)}     # A - C = 1, 2, 3: tie


def test_summarise_gives_each_claim_its_interval_and_verdict(tmp_path):
    exp, numbers = _experiment(tmp_path)
    table, claims = summarise(exp, _per_run(PER_RUN), numbers)
    by = {c["text"]: c for c in claims}
    assert by["A beats B"]["verdict"] == "held" and by["A beats B"]["n"] == 3
    assert by["A beats B"]["ours"] == pytest.approx(3.0) and by["A beats B"]["paper"] == pytest.approx(5.0)
    assert by["A beats B"]["lo"] == pytest.approx(3 - T2 / math.sqrt(3))
    assert by["B beats A"]["verdict"] == "reversed"
    assert by["A beats C"]["verdict"] == "tie" and math.isnan(by["A beats C"]["paper"])
    assert by["A sends fewer floats than B"]["verdict"] == "held"  # 400 - 100 in every seed, sd 0
    md = table_markdown(exp, table, claims, numbers, _per_run(PER_RUN))
    assert "n = 3; a verdict needs 3" in md and "95 % Student-t interval" in md
    assert "| A beats B | test_acc | 3 | +3.00 ± 2.48 [+0.52, +5.48] | 2.48 | +5.00 | held | – |" in md
    assert "| A beats C | test_acc | 3 | +2.00 ± 2.48 [-0.48, +4.48] | 2.48 | – | tie | – |" in md
    assert "| B beats A | test_acc | 3 | -3.00 ± 2.48 [-5.48, -0.52] | 2.48 | -5.00 | reversed | – |" in md
    assert "| A sends fewer floats than B | floats | 3 | +300 ± 0 [+300, +300] | 0.00 | – | held | – |" in md
    assert "code version: not recorded" in md  # these hand-made runs carry no code version


def test_fewer_seeds_than_the_minimum_give_n_too_small(tmp_path):
    exp, numbers = _experiment(tmp_path, seeds=(1, 2, 3, 4, 5), min_seeds=5)
    assert exp.min_seeds == 5
    table, claims = summarise(exp, _per_run(PER_RUN), numbers)  # only seeds 1-3 ran
    assert {c["verdict"] for c in claims} == {"n too small"}
    md = table_markdown(exp, table, claims, numbers)
    assert "| A beats B | test_acc | 3 | +3.00 ± 2.48 [+0.52, +5.48] | 2.48 | +5.00 | n too small (3 of 5) | – |" in md
    assert "fewer than 5 paired seeds" in md


def test_render_records_recomputes_the_verdicts_of_a_stored_table(tmp_path):
    exp, numbers = _experiment(tmp_path)
    record = {"experiment": "toy", "claims": [{"text": "A beats C", "held": True}],
              "runs": _per_run(PER_RUN).to_dict("records") + [{"label": "gone", "seed": 1, "test_acc": 1.0}]}
    md, new = render_records(exp, record, numbers)
    assert new["runs"] == record["runs"] and new["seeds"] == [1, 2, 3] and new["min_seeds"] == 3
    assert [c["verdict"] for c in new["claims"]] == ["held", "reversed", "tie", "held"]
    assert "| A | 3 | 81.00 ± 1.00 | 70.00 | +11.00 |" in md


def test_a_run_metric_makes_one_metric_per_method_in_every_claim(tmp_path):
    """Issue 34: a method whose seed number is another metric (FedTGP's prototype accuracy beside the baselines'
    classifiers) is compared on that metric in every claim without a metric of its own; a claim's metric still wins."""
    folder = tmp_path / "configs" / "seed999_toy"
    folder.mkdir(parents=True)
    (folder / "a.yaml").write_text("name: a\n")
    body = {"title": "toy", "source": "seed999.table1", "metric": "test_acc", "extra_metrics": ["test_acc_proto"],
            "runs": [{"label": "T", "config": "a.yaml", "metric": "test_acc_proto"}, {"label": "B", "config": "a.yaml"}],
            "claims": [{"text": "T beats B", "better": "T", "worse": "B"},
                       {"text": "T beats B (classifiers)", "better": "T", "worse": "B", "metric": "test_acc"}]}
    (folder / "experiments.yaml").write_text(yaml.safe_dump({"toy": body}))
    (tmp_path / "configs" / "seed_numbers.yaml").write_text(yaml.safe_dump({"seed999": {"table1": {"values": {}}}}))
    exp = rp.load_experiments(tmp_path / "configs")["toy"]
    assert exp.run("T").metric == "test_acc_proto" and exp.run("B").metric is None
    rows = [{"label": "T", "seed": s, "test_acc": 50.0, "test_acc_proto": 90.0 + s, "floats": 1.0} for s in (1, 2, 3)]
    rows += [{"label": "B", "seed": s, "test_acc": 80.0, "test_acc_proto": math.nan, "floats": 1.0} for s in (1, 2, 3)]
    _, claims = summarise(exp, pd.DataFrame(rows), {"seed999": {"table1": {"values": {}}}})
    assert claims[0]["metric"] == "test_acc_proto vs test_acc" and claims[0]["ours"] == pytest.approx(12.0)
    assert claims[0]["verdict"] == "held"
    assert claims[1]["metric"] == "test_acc" and claims[1]["verdict"] == "reversed"
    body["runs"][0]["metric"] = "val_acc"  # not shown in the table: refused
    (folder / "experiments.yaml").write_text(yaml.safe_dump({"toy": body}))
    with pytest.raises(ConfigError, match="runs\\[0\\].metric"):
        rp.load_experiments(tmp_path / "configs")


@pytest.mark.parametrize("bad", [2, "five", True, 3.5])
def test_bad_min_seeds_is_one_config_error(tmp_path, bad):
    with pytest.raises(ConfigError, match="min_seeds"):
        _experiment(tmp_path, min_seeds=bad)


def test_shipped_experiments_default_to_enough_seeds_and_seed_001_to_five():
    exps = rp.load_experiments()
    for name, e in exps.items():
        assert len(set(e.seeds)) >= e.min_seeds >= 3, name
        if e.folder.name == "seed001_pnicfl":  # the seed ran 5 seeds
            assert e.min_seeds == 5, name


def test_the_stored_tables_carry_this_code_s_verdicts():
    """benchmarks/results/: every table stored with its per-run records shows the verdicts this code computes, every
    table stored without them says it has none (benchmarks/stored_verdicts.py writes both)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "stored_verdicts.py"
    spec = importlib.util.spec_from_file_location("stored_verdicts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0, "run: python benchmarks/stored_verdicts.py"


# ------------------------------------------------------------------------------------------------ issue 51: window, power, Holm

def _p_df2(t: float) -> float:
    """The two-sided p-value of Student's t with 2 degrees of freedom, by hand: P(|T| < t) = t / sqrt(t^2 + 2)."""
    return 1.0 - t / math.sqrt(t * t + 2.0)


def test_window_mean_by_hand():
    curve = {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0, 5: 50.0, 6: 60.0, 7: 70.0}
    assert vd.window_mean(curve, 5) == (pytest.approx((30 + 40 + 50 + 60 + 70) / 5), 5)  # rounds 3-7: 50
    assert vd.window_mean({3: 1.0, 1: 5.0, 2: 3.0}, 5) == (pytest.approx(3.0), 3)  # fewer rounds: all of them
    assert vd.window_mean({1: 1.0, 2: math.nan, 3: 3.0, 4: 5.0}, 2) == (pytest.approx(4.0), 2)  # NaN left out
    assert vd.window_mean({}, 5)[1] == 0 and math.isnan(vd.window_mean({}, 5)[0])
    with pytest.raises(ValueError):
        vd.window_mean(curve, 0)


def test_p_value_by_hand():
    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 2 sqrt 3; df 2: p = 1 - t / sqrt(t^2 + 2)
    res = vd.interval([1.0, 2.0, 3.0])
    assert vd.p_value(res) == pytest.approx(_p_df2(2 * math.sqrt(3)), rel=1e-9) == pytest.approx(0.074180, abs=1e-6)
    assert vd.p_value(vd.interval([0.5, 0.5, 0.5])) == 0.0 and vd.p_value(vd.interval([0.0, 0.0])) == 1.0
    assert math.isnan(vd.p_value(vd.interval([1.0])))
    # p < 0.05 exactly when the 95 % interval excludes 0 (differences 2, 3, 4: [0.52, 5.48], p 0.035)
    p = vd.p_value(vd.interval([2.0, 3.0, 4.0]))
    assert p == pytest.approx(_p_df2(3 * math.sqrt(3))) and p < 0.05
    assert vd.judge({1: 2.0, 2: 3.0, 3: 4.0}, {1: 0.0, 2: 0.0, 3: 0.0})["p"] == pytest.approx(0.035099, abs=1e-6)


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 (m = 4): x4 = 0.02, x3 = 0.03, x2 = 0.06, x1 = 0.04 -> running max 0.06
    assert vd.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = vd.holm([0.02, math.nan, 0.04])  # NaN: no verdict, not counted (m = 2)
    assert out[0] == pytest.approx(0.04) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)
    assert vd.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert vd.holm([]) == []


def test_power_underpowered_when_the_seed_difference_lies_inside_the_half_width():
    h = T2 / math.sqrt(3)  # 2.484: differences 1, 2, 3 give [-0.48, +4.48]
    assert vd.power("tie", h, 1.0) == "underpowered"  # the seed's +1.00 could not have been excluded
    assert vd.power("tie", h, -2.0) == "underpowered"
    assert vd.power("tie", h, 3.0) == "tie"  # the seed's +3.00 lies outside: the runs could have seen it
    assert vd.power("tie", h, math.nan) == "tie"  # no seed number: a tie with its half-width beside it
    assert vd.power("held", h, 1.0) == "held" and vd.power("reversed", h, 1.0) == "reversed"
    assert vd.judge({1: 11.0, 2: 12.0, 3: 13.0}, {1: 10.0, 2: 10.0, 3: 10.0}, seed_diff=1.5)["verdict"] == "underpowered"
    assert vd.judge({1: 11.0, 2: 12.0, 3: 13.0}, {1: 10.0, 2: 10.0, 3: 10.0}, seed_diff=2.6)["verdict"] == "tie"


def test_holm_column_over_one_seed_s_claims_by_hand():
    """Three claims of one seed, every number by hand (df 2): A differences 2, 3, 4 (t = 3 sqrt 3, p = 0.0351:
    held alone), B 1, 2, 3 (t = 2 sqrt 3, p = 0.0742: tie), C 10, 11, 12 (t = 11 sqrt 3, p = 0.00274: held). Holm over
    m = 3: C 3 x 0.002743 = 0.00823 (held), A max(0.0082, 2 x 0.0351 = 0.0702) (tie after correction), B max(0.0702,
    0.0742) = 0.0742 (tie)."""
    zero = {1: 0.0, 2: 0.0, 3: 0.0}
    a = vd.judge({1: 2.0, 2: 3.0, 3: 4.0}, zero)
    b = vd.judge({1: 1.0, 2: 2.0, 3: 3.0}, zero)
    c = vd.judge({1: 10.0, 2: 11.0, 3: 12.0}, zero)
    pa, pb, pc = _p_df2(3 * math.sqrt(3)), _p_df2(2 * math.sqrt(3)), _p_df2(11 * math.sqrt(3))
    assert (a["p"], b["p"], c["p"]) == (pytest.approx(pa), pytest.approx(pb), pytest.approx(pc))
    assert (a["verdict"], b["verdict"], c["verdict"]) == ("held", "tie", "held")
    adj = vd.holm([a["p"], b["p"], c["p"]])
    assert adj == pytest.approx([2 * pa, pb, 3 * pc])
    assert adj == pytest.approx([0.070197, 0.074180, 0.008230], abs=1e-6)
    assert [vd.holm_verdict(r["mean"], q) for r, q in zip((a, b, c), adj)] == ["tie", "tie", "held"]
    assert vd.holm_verdict(-3.0, 0.01) == "reversed" and vd.holm_verdict(1.0, math.nan) == "n too small"


def test_claims_rest_on_the_window_the_final_round_beside_it(tmp_path):
    """A stored record with each run's per-round values: the claim reads the mean of the last 5 rounds; the final
    round's verdict is shown beside it. Without per-round values the claims say the final round is all they have."""
    exp, numbers = _experiment(tmp_path, claims=[{"text": "A beats B", "better": "A", "worse": "B"}])
    # A: rounds 1-6 flat at 80 + seed, then round 7 drops to 70 + seed; B flat at 75 in every round
    runs = []
    for s in (1, 2, 3):
        runs.append({"label": "A", "seed": s, "test_acc": 70.0 + s, "floats": 1.0,
                     "curve": {str(r): (80.0 + s if r < 7 else 70.0 + s) for r in range(1, 8)}})
        runs.append({"label": "B", "seed": s, "test_acc": 75.0, "floats": 1.0,
                     "curve": {str(r): 75.0 for r in range(1, 8)}})
    md, new = render_records(exp, {"runs": runs}, numbers)
    c = new["claims"][0]
    # window (rounds 3-7) of A: (4 x (80 + s) + 70 + s) / 5 = 78 + s; minus 75: 4, 5, 6 -> mean 5, sd 1: held
    assert c["ours"] == pytest.approx(5.0) and c["verdict"] == "held" and c["rule"].startswith("mean of the last 5")
    # the final round: 70 + s - 75 = -4, -3, -2 -> mean -3: reversed, shown beside it
    assert c["final"]["mean"] == pytest.approx(-3.0) and c["final"]["verdict"] == "reversed"
    assert "+5.00 ± 2.48 [+2.52, +7.48] | 2.48 | +5.00 | held | -3.00 ± 2.48 [-5.48, -0.52]: reversed |" in md
    assert new["runs"] == runs  # the records themselves are untouched
    bare = [{k: v for k, v in r.items() if k != "curve"} for r in runs]
    _, old = render_records(exp, {"runs": bare}, numbers)
    assert old["claims"][0]["rule"].startswith("final round only") and old["claims"][0]["ours"] == pytest.approx(-3.0)


def test_window_below_five_is_refused(tmp_path):
    folder = tmp_path / "configs" / "seed999_toy"
    folder.mkdir(parents=True)
    (folder / "a.yaml").write_text("name: a\n")
    body = {"title": "t", "source": "s.t", "metric": "test_acc", "window": 3,
            "runs": [{"label": "A", "config": "a.yaml"}]}
    (folder / "experiments.yaml").write_text(yaml.safe_dump({"toy": body}))
    with pytest.raises(ConfigError, match="window"):
        rp.load_experiments(tmp_path / "configs")
    body["window"] = 8
    (folder / "experiments.yaml").write_text(yaml.safe_dump({"toy": body}))
    assert rp.load_experiments(tmp_path / "configs")["toy"].window == 8


def test_combine_one_verdict_for_a_claim_over_several_comparisons():
    H = {"verdict": "held", "p": 0.01}
    H2 = {"verdict": "held", "p": 0.03}
    T = {"verdict": "tie", "p": 0.4}
    U = {"verdict": "underpowered", "p": 0.5}
    R = {"verdict": "reversed", "p": 0.002}
    # all: held only when every part is (IUT: the largest p), reversed when any part is (its p)
    assert vd.combine([H, H2], "all") == {"verdict": "held", "p": 0.03, "sign": 1, "counts": vd.count(["held"] * 2)}
    assert vd.combine([H, T], "all")["verdict"] == "tie" and vd.combine([H, T], "all")["p"] == 0.4
    assert vd.combine([H, T, U], "all")["verdict"] == "underpowered"
    got = vd.combine([H, R, T], "all")
    assert (got["verdict"], got["p"], got["sign"]) == ("reversed", 0.002, -1)
    # most: more than half held and none reversed (3 parts: 2 needed; p the 2nd smallest held p)
    assert vd.combine([H, H2, T], "most")["verdict"] == "held" and vd.combine([H, H2, T], "most")["p"] == 0.03
    assert vd.combine([H, T, T], "most")["verdict"] == "tie"
    assert vd.combine([H, H2, R], "most")["verdict"] == "tie"  # a reversed part: not held, not a majority reversed
    assert vd.combine([R, R, H], "most")["verdict"] == "reversed"
    assert vd.combine([H, {"verdict": "n too small", "p": math.nan}], "all")["verdict"] == "n too small"
    with pytest.raises(ValueError):
        vd.combine([H], "any")


def test_the_claim_tally_is_this_code_s():
    """benchmarks/results/CLAIMS.md and REPRODUCTION.md's summary are what benchmarks/claim_tally.py writes from
    configs/seed_claims.yaml and the stored records (every claim reference resolves to exactly one stored claim)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "claim_tally.py"
    spec = importlib.util.spec_from_file_location("claim_tally", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0, "run: python benchmarks/claim_tally.py"


def test_the_claim_tally_counts_no_table_without_provenance():
    """Issue 51 item 6: a record without config hash, code version or commit makes its table uncountable."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "claim_tally.py"
    spec = importlib.util.spec_from_file_location("claim_tally", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tables = object.__new__(mod.Tables)
    good = {"config_hash": "abc", "code": {"source": "s", "commit": "c"}}
    tables.cache = {"ok": {"runs": [good, good]}, "bare": {"runs": [good, {"label": "x"}]},
                    "nocommit": {"records": [{"config_hash": "abc", "code": {"source": "s"}}]}, "gone": None}
    assert [tables.unprovenanced(t) for t in ("ok", "bare", "nocommit", "gone")] == [0, 1, 1, -1]


def test_the_claim_tally_counts_no_table_whose_runs_average_fewer_rounds_than_its_window():
    """Issue 51 item 2: under ``select: last`` a counted run averages its last ``window`` (>= 5) evaluated rounds; a
    table evaluated every 5th round of 20 (4 evaluations: the whole run) or holding the final round only is refused."""
    from pathlib import Path

    mod = _claim_tally_module()

    def exp(name, select="last"):
        return rp.Experiment(name=name, folder=Path("."), title=name, source="seedX.t", seeds=(1, 2, 3),
                             metric="test_acc", runs=(rp.RunSpec("A", Path("c.yaml")),), select=select,
                             scaled="hand-made")

    tables = object.__new__(mod.Tables)
    tables.exps = {"full": exp("full"), "few": exp("few"), "final": exp("final"), "best": exp("best", "val_acc")}
    tables.cache = {}
    tables.raws = {"seedX/full": {"runs": [{"window": 5}, {"window": 5}]},
                   "seedX/few": {"runs": [{"window": 5}, {"window": 4}]},
                   "seedX/final": {"runs": [{"test_acc": 0.5}]},
                   "seedX/best": {"runs": [{"test_acc": 0.5}]}, "seedX/gone": None}
    got = [tables.short_windows(f"seedX/{t}") for t in ("full", "few", "final", "best", "gone")]
    assert got == [0, 1, 1, 0, -1]


def test_a_setting_s_seed_difference_applies_the_power_rule_where_its_table_has_no_seed_number():
    """Issue 51 item 3: ``seed_difference`` (the seed's difference on its own dataset, where the stand-in table's source
    has no number) is shown beside the part and a tie whose half-width covers it becomes underpowered; a part with a
    seed number of its own keeps it."""
    mod = _claim_tally_module()
    tables = object.__new__(mod.Tables)
    tie = {"text": "A beats B", "verdict": "tie", "half": 2.0, "paper": math.nan, "p": 0.5, "ours": 0.3}
    own = {"text": "C beats D", "verdict": "tie", "half": 2.0, "paper": 5.0, "p": 0.4, "ours": 0.1}
    tables.cache = {"seedX/t": {"claims": [tie, own]}}
    claim = {"at": {"table": "seedX/t", "parts": ["A beats B"]}}
    got = mod.judge_setting(tables, claim, {"table": "seedX/t", "parts": ["A beats B"], "seed_difference": 1.5})
    assert got["verdict"] == "underpowered" and got["parts"][0]["paper"] == 1.5
    assert mod.judge_setting(tables, claim, {"table": "seedX/t", "parts": ["A beats B"],
                                             "seed_difference": 3.0})["verdict"] == "tie"
    kept = mod.judge_setting(tables, claim, {"table": "seedX/t", "parts": ["C beats D"], "seed_difference": 1.0})
    assert kept["parts"][0]["paper"] == 5.0 and kept["verdict"] == "tie"
    assert mod.judge_setting(tables, claim, {"table": "seedX/t", "parts": ["A beats B"]})["verdict"] == "tie"


def _claim_tally_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "claim_tally.py"
    spec = importlib.util.spec_from_file_location("claim_tally", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cross_tables(mod, select_b: str = "val_acc"):
    """Two hand-made stored tables: 'seedX/ta' (MAFML on seeds 1-4, AGG) and 'seedX/tb' (FedMD rerun on seeds 1-3)."""
    from pathlib import Path

    def exp(name, labels, select="val_acc"):  # the seed's selection: the records hold the selected values
        return rp.Experiment(name=name, folder=Path("."), title=name, source="seedX.t", seeds=(1, 2, 3),
                             metric="test_acc", runs=tuple(rp.RunSpec(lab, Path("c.yaml")) for lab in labels),
                             select=select, scaled="hand-made")

    def runs(label, vals):
        return [{"label": label, "seed": s, "test_acc": v, "config_hash": "h", "code": {"source": "s", "commit": "c"}}
                for s, v in vals.items()]

    tables = object.__new__(mod.Tables)
    tables.exps = {"ta": exp("ta", ["MAFML", "AGG"]), "tb": exp("tb", ["FedMD paper"], select_b)}
    tables.numbers, tables.cache = {"seedX": {"t": {"values": {}}}}, {}
    tables.raws = {"seedX/ta": {"runs": runs("MAFML", {1: 90.0, 2: 91.0, 3: 92.0, 4: 99.0})
                                + runs("AGG", {1: 80.0, 2: 80.0, 3: 80.0}), "overrides": []},
                   "seedX/tb": {"runs": runs("FedMD paper", {1: 85.0, 2: 87.0, 3: 86.0}), "overrides": []}}
    return tables


def test_the_claim_tally_pairs_runs_across_two_stored_tables():
    """Issue 51: a baseline rerun at equal work in its own table is compared with the other table's runs, paired by
    seed (seed 4, only on one side, left out), and judged by the tables' own code: (90-85, 91-87, 92-86) = (5, 4, 6),
    mean 5, sd 1, half-width t(0.975, 2) / sqrt(3) = 2.484, held."""
    mod = _claim_tally_module()
    tables = _cross_tables(mod)
    spec = {"text": "MAFML beats FedMD (paper)", "better": ["seedX/ta", "MAFML"], "worse": ["seedX/tb", "FedMD paper"]}
    c = tables.cross(spec)
    assert c["n"] == 3 and c["diffs"] == {"1": 5.0, "2": 4.0, "3": 6.0}
    assert c["ours"] == pytest.approx(5.0) and c["half"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert c["verdict"] == vd.HELD and "paired across seedX/ta and seedX/tb" in c["rule"]
    assert c["final"]["verdict"] == ""  # no final-round values on either side
    # final-round values on one side only (newer records): no final-round verdict rather than "n too small"
    for r in tables.raws["seedX/tb"]["runs"]:
        r["test_acc@final"] = r["test_acc"]
    assert tables.cross(spec)["final"]["verdict"] == ""
    for r in tables.raws["seedX/ta"]["runs"]:
        r["test_acc@final"] = r["test_acc"] - 1.0
    fin = tables.cross(spec)["final"]
    assert fin["verdict"] == vd.HELD and fin["mean"] == pytest.approx(4.0)
    # reversed order: the same differences negated
    back = tables.cross({"text": "FedMD beats MAFML", "better": spec["worse"], "worse": spec["better"]})
    assert back["verdict"] == vd.REVERSED and back["ours"] == pytest.approx(-5.0)
    # a setting mixing a table's own parts with cross parts: one verdict by the claim's rule
    tables.cache["seedX/ta"] = {"claims": [{"text": "MAFML beats AGG", "verdict": vd.HELD, "p": 0.001,
                                            "final": {"verdict": vd.HELD}}]}
    claim = {"rule": "all", "at": {"table": "seedX/ta", "parts": ["MAFML beats AGG"], "cross": [spec]}}
    out = mod.judge_setting(tables, claim, claim["at"])
    assert [p["text"] for p in out["parts"]] == ["MAFML beats AGG", "MAFML beats FedMD (paper)"]
    assert out["verdict"] == vd.HELD
    # a missing table: no verdict, said so
    tables.raws["seedX/none"] = None
    gone = tables.cross({"text": "x", "better": ["seedX/ta", "MAFML"], "worse": ["seedX/none", "FedMD paper"]})
    assert gone["verdict"] == mod.NO_VERDICT and "not stored" in gone["missing"]


def test_the_claim_tally_refuses_to_pair_tables_with_different_value_rules():
    mod = _claim_tally_module()
    tables = _cross_tables(mod, select_b="last")
    spec = {"text": "MAFML beats FedMD (paper)", "better": ["seedX/ta", "MAFML"], "worse": ["seedX/tb", "FedMD paper"]}
    with pytest.raises(SystemExit, match="differ in select"):
        tables.cross(spec)
    tables = _cross_tables(mod)
    with pytest.raises(SystemExit, match="both sides are labelled"):
        tables.cross({"text": "t", "better": ["seedX/ta", "MAFML"], "worse": ["seedX/tb", "MAFML"]})
    tables.raws["seedX/tb"]["overrides"] = ["rounds=4"]
    with pytest.raises(SystemExit, match="different overrides"):
        tables.cross(spec)


def test_a_cross_claim_within_one_stored_table_is_that_table_s_own_claim():
    """The cross pairing on two labels of ONE stored table gives that table's own claim, number for number (the
    seed's difference, the interval, the verdict): the pairing adds nothing of its own."""
    mod = _claim_tally_module()
    tables = mod.Tables()
    t = "seed003/table1_rotated_mnist"
    own = tables.part(t, "MAFML beats FedMD (a=10%)")
    got = tables.cross({"text": own["text"], "better": [t, "MAFML a=10%"], "worse": [t, "FedMD a=10%"]})
    for k in ("n", "ours", "half", "lo", "hi", "p", "paper", "verdict", "diffs"):
        assert got[k] == (pytest.approx(own[k]) if isinstance(own[k], float) else own[k]), k
