"""The table of a seed experiment (``raysim reproduce``'s last step): each run's value (the last evaluation, or the
checkpoint a validation metric selects, per run or per client), mean +- sample std over seeds beside the seed's
number and the difference, traffic and wall time from each run's own records, each claim's verdict from the paired
per-seed differences (mean +- 95 % Student-t interval: held / tie / reversed, or n too small; :mod:`raysim.verdicts`),
and each run's provenance (seed, config hash, code version, numerics mode, CPU), written as ``reproduction.md`` /
``.json`` with raysim report's summary and plots under it. :func:`render_records` writes the same table again from a
stored ``reproduction.json`` (its per-run records), without the run directories."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from raysim import verdicts
from raysim.errors import ConfigError

from raysim.app.seed_experiments import (Experiment, Planned, diverged_reason, paper_value,
                                         protocol_overrides, source_entry)


FINAL = "@final"  # a per-run record's column: the metric at the last evaluated round, shown beside the verdict's value


def _client_or_server(df: pd.DataFrame, metric: str) -> tuple[str, str]:
    name = metric.split(":", 1)[1] if metric.startswith("server:") else metric
    scopes = set(df.loc[df["metric"] == name, "scope"].unique())
    if not metric.startswith("server:") and "client" in scopes:
        return "client", name
    if "server" in scopes:
        return "server", name
    raise ConfigError("metric", f"{metric!r} is not in the result table (client or server scope)")


def run_value(df: pd.DataFrame, metric: str, select: str = "last", select_per: str = "run") -> float:
    """One run's reported value of ``metric``: the mean over clients (or the server value) at the last evaluated
    round, or at the round a validation metric selects (per run: the round with the best client mean of ``select``;
    per client: each client's own best round, as MAFML's seed selects checkpoints per node)."""
    scope, name = _client_or_server(df, metric)
    rows = df[(df["scope"] == scope) & (df["metric"] == name)]
    if select == "last":
        if scope == "server":
            return float(rows.loc[rows["round"].idxmax(), "value"])
        last = rows["round"].max()
        return float(rows[rows["round"] == last]["value"].mean())
    val = df[(df["scope"] == "client") & (df["metric"] == select)]
    if val.empty:
        raise ConfigError("select", f"{select!r} is not in the result table (set data.val_fraction or "
                                    f"data.local_split.val so the runs have validation metrics)")
    if select_per == "client" and scope == "client":
        vals = []
        for cid, g in val.groupby("client_id"):
            best_round = int(g.sort_values("round").loc[g.sort_values("round")["value"].idxmax(), "round"])
            hit = rows[(rows["client_id"] == cid) & (rows["round"] == best_round)]["value"]
            if len(hit):
                vals.append(float(hit.iloc[0]))
        return float(np.mean(vals)) if vals else math.nan
    means = val.groupby("round")["value"].mean().sort_index()
    best_round = int(means.idxmax())
    at = rows[rows["round"] == best_round]["value"]
    return float(at.mean()) if len(at) else math.nan


def run_curve(df: pd.DataFrame, metric: str) -> dict[int, float]:
    """One run's ``metric`` at every evaluated round (round -> the mean over clients, or the server value): what the
    window of the last evaluated rounds averages (:func:`raysim.verdicts.window_mean`)."""
    scope, name = _client_or_server(df, metric)
    rows = df[(df["scope"] == scope) & (df["metric"] == name)]
    return {int(r): float(v) for r, v in rows.groupby("round")["value"].mean().sort_index().items()}


def run_values(df: pd.DataFrame, metric: str, exp: Experiment) -> dict:
    """What a run contributes to a claim (issue 51): under ``select: last`` the mean of its last ``exp.window``
    evaluated rounds (``value``), the final round beside it (``final``), the rounds averaged (``window``) and the
    curve; under a validation selection (the seed's own rule) the selected value, the final round beside it."""
    final = run_value(df, metric, "last")
    if exp.select != "last":
        return {"value": run_value(df, metric, exp.select, exp.select_per), "final": final, "window": 0, "curve": None}
    curve = run_curve(df, metric)
    value, used = verdicts.window_mean(curve, exp.window)
    return {"value": value, "final": final, "window": used, "curve": curve}


def _run_info(path: Path) -> dict:
    try:
        info = json.loads((path / "run.json").read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _wall_s(info: dict) -> float:
    try:
        t = info.get("timing") or {}
        return float(t.get("setup_s", 0) + t.get("setup_phase_s", 0) + t.get("total_round_s", 0))
    except (TypeError, ValueError, AttributeError):
        return math.nan


def _provenance(info: dict) -> dict:
    """A run's record of where it came from: config hash, code version (raysim.engine.provenance), numerics mode, CPU."""
    v = info.get("versions") or {}
    code = v.get("code") if isinstance(v.get("code"), dict) else None
    num = info.get("numerics")
    return {"config_hash": info.get("config_hash"), "code": code,
            "commit": (code or {}).get("commit"),
            "numerics": (num.get("mode") if isinstance(num, dict) else num), "cpu": v.get("cpu")}


def collect(exp: Experiment, planned: list[Planned]) -> pd.DataFrame:
    """One row per finished run: label, seed, each metric's reported value, total floats (up + down), wall time and
    the run's provenance (config hash, code version, commit, numerics mode, CPU, from its run.json)."""
    from raysim.io import results

    rows = []
    metrics = [exp.metric, *exp.extra_metrics]
    for p in planned:
        f = p.target / "results.parquet"
        if not f.exists():
            continue
        df = results.load(f)
        row = {"label": p.run.label, "seed": p.seed, "path": str(p.target)}
        for m in metrics:
            try:
                got = run_values(df, m, exp)
            except ConfigError:
                if m == exp.metric:
                    raise ConfigError(f"{exp.name}.metric", f"run {p.target} has no {m!r}") from None
                got = {"value": math.nan, "final": math.nan, "window": 0, "curve": None}  # a metric a method lacks
            scale = 100.0 if exp.percent and not m.startswith("server:") and _is_rate(m) else 1.0
            row[m], row[f"{m}{FINAL}"] = got["value"] * scale, got["final"] * scale
            if m == exp.metric:
                row["window"] = got["window"]
                if got["curve"] is not None:
                    row["curve"] = {str(r): v * scale for r, v in got["curve"].items()}
        com = results.communication(df)
        tot = com.set_index("metric")["total"]
        row["floats"] = float(tot.get("up_floats", 0.0) + tot.get("down_floats", 0.0))
        row["setup_floats"] = float(com.set_index("metric")["setup"].get("up_floats", 0.0)
                                    + com.set_index("metric")["setup"].get("down_floats", 0.0))
        info = _run_info(p.target)
        row["wall_s"] = _wall_s(info)
        row.update(_provenance(info))
        rows.append(row)
    return pd.DataFrame(rows)


def _is_rate(metric: str) -> bool:
    """Accuracies (and BWT/FWT) are shown in percent; losses, ARI and counts are not."""
    return "acc" in metric or metric.endswith(("_bwt", "_fwt"))


def _fmt(mean: float, std: float, digits: int = 2) -> str:
    if not np.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if np.isfinite(std) else "")


def _per_seed(per_run: pd.DataFrame, label: str, col: str) -> dict[int, float]:
    if not len(per_run) or col not in per_run.columns:
        return {}
    g = per_run[per_run["label"] == label]
    return {int(s): float(v) for s, v in zip(g["seed"], g[col]) if v is not None and np.isfinite(float(v))}


def _judge_claim(c, exp: Experiment, table: pd.DataFrame, per_run: pd.DataFrame, own: dict) -> dict:
    """One claim's record: its verdict on the runs' values (the window's mean, or the seed's selection), the seed's
    own difference (a tie inside the half-width is underpowered), the two-sided p-value, and the same verdict on the
    final round beside it (where the records hold it)."""
    # a claim's own metric for both sides; else each side's run metric (the one the seed reports for it)
    mb, mw = (c.metric, c.metric) if c.metric else (own[c.better], own[c.worse])
    m = mb if mb == mw else f"{mb} vs {mw}"
    cb, cw = ("floats" if mb == "floats" else mb), ("floats" if mw == "floats" else mw)
    paper = math.nan
    if m != "floats":
        b, w = table.set_index("label").loc[c.better], table.set_index("label").loc[c.worse]
        pb, pw = b.get(f"{mb}_paper", math.nan), w.get(f"{mw}_paper", math.nan)
        if np.isfinite(pb) and np.isfinite(pw):
            paper = (-1.0 if c.lower_is_better else 1.0) * (pb - pw)
    res = verdicts.judge(_per_seed(per_run, c.better, cb), _per_seed(per_run, c.worse, cw),
                         c.lower_is_better, exp.min_seeds, seed_diff=paper)
    fin = {"mean": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan, "verdict": ""}
    if (m != "floats" and len(per_run) and f"{cb}{FINAL}" in per_run.columns and f"{cw}{FINAL}" in per_run.columns
            and per_run[[f"{cb}{FINAL}", f"{cw}{FINAL}"]].astype(float).notna().any().all()):
        fin = verdicts.judge(_per_seed(per_run, c.better, cb + FINAL), _per_seed(per_run, c.worse, cw + FINAL),
                             c.lower_is_better, exp.min_seeds, seed_diff=paper)
    return {"text": c.text, "metric": m, "better": c.better, "worse": c.worse,
            "lower_is_better": c.lower_is_better, "n": res["n"], "min_n": res["min_n"],
            "ours": res["mean"], "sd": res["sd"], "half": res["half"], "lo": res["lo"], "hi": res["hi"],
            "p": res["p"], "diffs": {str(k): v for k, v in res["diffs"].items()}, "paper": paper,
            "verdict": res["verdict"], "rule": value_rule(exp, per_run),
            "final": {k: fin[k] for k in ("mean", "half", "lo", "hi", "verdict")}}


def value_rule(exp: Experiment, per_run: pd.DataFrame) -> str:
    """What a run's value in the claims is: the window's mean, the seed's validation selection, or (stored records
    without per-round values) the final round."""
    if exp.select != "last":
        return f"the checkpoint the best {exp.select} selects ({'per client' if exp.select_per == 'client' else 'per run'}; the seed's rule)"
    if len(per_run) and "window" in per_run.columns and per_run["window"].notna().all():
        used = sorted({int(w) for w in per_run["window"]})
        return f"mean of the last {exp.window} evaluated rounds" + (
            f" (runs with fewer evaluations: all {', '.join(str(u) for u in used if u < exp.window)})"
            if any(u < exp.window for u in used) else "")
    return "final round only (the stored records hold no per-round values)"


def summarise(exp: Experiment, per_run: pd.DataFrame, numbers: dict) -> tuple[pd.DataFrame, list[dict]]:
    """Per run label: mean and sample std over seeds of each metric, the seed's number and the difference; and per
    claim its verdict from the paired per-seed differences (:func:`raysim.verdicts.judge`: n, mean, the 95 % interval,
    held / tie / reversed, or n too small below ``exp.min_seeds``) beside the seed's own difference."""
    metrics = [exp.metric, *exp.extra_metrics]
    out = []
    for r in exp.runs:
        g = per_run[per_run["label"] == r.label] if len(per_run) else per_run
        row = {"label": r.label, "seeds": int(len(g))}
        for m in metrics:
            vals = g[m].astype(float) if len(g) and m in g.columns else pd.Series(dtype=float)
            row[f"{m}_mean"] = float(vals.mean()) if len(vals) else math.nan
            row[f"{m}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
            row[f"{m}_paper"] = paper_value(exp, numbers, r, m.split(":", 1)[-1]) if r.paper else math.nan
        fin = f"{exp.metric}{FINAL}"
        row[f"{exp.metric}_final_mean"] = (float(g[fin].astype(float).mean()) if len(g) and fin in g.columns
                                           else math.nan)
        for k in ("floats", "setup_floats", "wall_s"):
            row[k] = float(g[k].astype(float).mean()) if len(g) and k in g.columns else math.nan
        out.append(row)
    table = pd.DataFrame(out)
    own = {r.label: (r.metric or exp.metric) for r in exp.runs}
    claims = [_judge_claim(c, exp, table, per_run, own) for c in exp.claims]
    return table, claims


VERDICT_RULE = ("paired per-seed differences (better − worse, the same seed; lower − higher where lower is better), "
                "mean ± half-width of the 95 % Student-t interval (n − 1 degrees of freedom) [interval]; held: the "
                "interval lies above 0; tie: it contains 0 and the seed's own difference lies outside the half-width "
                "(or the seed gives none); underpowered: it contains 0 and the seed's difference lies inside the "
                "half-width (the runs could not have told the seed's effect from none); reversed: it lies below 0")


def _claim_cells(c: dict) -> list[str]:
    floats = c["metric"] == "floats"
    ours = verdicts.format_interval({"mean": c["ours"], "half": c["half"], "lo": c["lo"], "hi": c["hi"]},
                                    digits=0 if floats else 2, thousands=floats)
    half = f"{c['half']:.2f}" if isinstance(c.get("half"), float) and np.isfinite(c["half"]) else "–"
    paper = f"{c['paper']:+.2f}" if np.isfinite(c["paper"]) else "–"
    verdict = c["verdict"] + (f" ({c['n']} of {c['min_n']})" if c["verdict"] == verdicts.TOO_FEW else "")
    fin = c.get("final") or {}
    final = "–"
    if fin.get("verdict"):
        final = f"{verdicts.format_interval(fin)}: {fin['verdict']}"
    return [c["text"], c["metric"], str(c["n"]), ours, half, paper, verdict, final]


def claims_markdown(claims: list[dict], min_n: int) -> str:
    """The claims table: n, the paired mean ± 95 % interval, its half-width (the smallest difference it could have
    excluded), the seed's difference, the verdict, and the same on the final round beside it."""
    rule = claims[0].get("rule", "") if claims else ""
    lines = [f"Claims: {VERDICT_RULE}; n too small: fewer than {min_n} paired seeds (this experiment's minimum), no "
             f"verdict. A run's value: {rule or 'the final round'}; the final round's verdict beside it.\n",
             "| claim | metric | n | ours: paired difference, mean ± 95 % [interval] | half-width | seed's | verdict "
             "| final round: paired difference, verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in claims:
        lines.append("| " + " | ".join(_claim_cells(c)) + " |")
    return "\n".join(lines) + "\n"


def provenance_markdown(per_run: pd.DataFrame) -> str:
    """Which code versions, numerics modes and CPUs the table's runs were made with (one line)."""
    from raysim.engine import provenance

    if not len(per_run):
        return ""
    parts = []
    for key, what in (("code", "code version"), ("numerics", "numerics"), ("cpu", "CPU")):
        if key not in per_run.columns:
            vals = ["not recorded"] * len(per_run)
        elif key == "code":
            vals = [provenance.label(v if isinstance(v, dict) else None) for v in per_run[key]]
        else:
            vals = [str(v) if isinstance(v, str) and v else "not recorded" for v in per_run[key]]
        counts: dict[str, int] = {}
        for v in vals:
            counts[v] = counts.get(v, 0) + 1
        parts.append(f"{what}: " + "; ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in counts.items()))
    return f"Provenance of the {len(per_run)} run(s) (each run's record: the table's JSON, `runs`): " + "; ".join(parts) + ".\n"


DIRECTION_ONLY = "direction only"


def scale_text(exp: Experiment, overrides=()) -> str:
    """The table's scale line: what differs from the seed's size, and every override the runs were made with."""
    text = exp.scaled or "the seed’s full size"
    if overrides:
        text += "; with overrides in every run: " + ", ".join(f"--set {o}" for o in overrides)
    return text


def seed_compared(exp: Experiment, overrides=()) -> bool:
    """Whether the seed's numbers are compared value for value (the diff column): only where dataset, model and
    protocol are the seed's (:attr:`Experiment.matches_seed`) and no override changes what the runs compute."""
    return exp.matches_seed and not protocol_overrides(overrides)


def _direction_note(exp: Experiment, overrides) -> str:
    why = []
    if not exp.matches_seed:
        why.append("this experiment's dataset, model or protocol is not the seed's (the scale line)")
    changed = protocol_overrides(overrides)
    if changed:
        why.append(f"the overrides change the protocol ({', '.join(changed)})")
    return (f"The seed's numbers are shown for the direction only: {' and '.join(why)}, so a difference from them "
            f"measures the setting, not the method; compare the ordering of the methods (the claims), not the "
            f"values (diff: '{DIRECTION_ONLY}').\n")


def table_markdown(exp: Experiment, table: pd.DataFrame, claims: list[dict], numbers: dict,
                   per_run: pd.DataFrame | None = None) -> str:
    metrics = [exp.metric, *exp.extra_metrics]
    entry = source_entry(exp, numbers)
    unit = " (%)" if exp.percent else ""
    sel = (value_rule(exp, per_run if per_run is not None else pd.DataFrame()) + " (the final round: column 'final')"
           if exp.select == "last" else
           f"the round with the best {exp.select} ({'per client' if exp.select_per == 'client' else 'mean over clients'})")
    seeds = sorted(set(int(x) for x in exp.seeds))
    overrides = list(exp.cli_overrides)
    compared = seed_compared(exp, overrides)
    head_note = f" — with overrides: {', '.join(overrides)} (not the manifest's setting)" if overrides else ""
    lines = [f"## {exp.name}: {exp.title}{head_note}\n",
             f"Seed: {entry.get('source', exp.source)}. Values{unit}: mean ± sample std over seeds "
             f"{', '.join(str(s) for s in seeds)} (n = {len(seeds)}; a verdict needs {exp.min_seeds}) of the mean over "
             f"clients, at {sel}. Scale: {scale_text(exp, overrides)}.\n"]
    if not compared:
        lines.append(_direction_note(exp, overrides))
    if exp.description:
        lines.append(exp.description.strip() + "\n")
    head = ["method", "seeds"]
    for m in metrics:
        head += [m, "seed's", "diff"]
    head += ["final", "floats (up+down)", "of which setup", "wall s/run"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for _, r in table.iterrows():
        cells = [str(r["label"]), str(int(r["seeds"]))]
        for m in metrics:
            mean, std, paper = r[f"{m}_mean"], r[f"{m}_std"], r[f"{m}_paper"]
            diff = (f"{mean - paper:+.2f}" if compared else DIRECTION_ONLY) if np.isfinite(paper) and np.isfinite(mean) \
                else "–"
            cells += [_fmt(mean, std), _fmt(paper, math.nan), diff]
        fin = r.get(f"{exp.metric}_final_mean", math.nan)
        cells += [_fmt(fin, math.nan) if exp.select == "last" else "–",
                  f"{r['floats']:,.0f}" if np.isfinite(r["floats"]) else "–",
                  f"{r['setup_floats']:,.0f}" if np.isfinite(r["setup_floats"]) else "–",
                  f"{r['wall_s']:.1f}" if np.isfinite(r["wall_s"]) else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    if claims:
        md += "\n" + claims_markdown(claims, exp.min_seeds)
    if per_run is not None and len(per_run):
        md += "\n" + provenance_markdown(per_run)
    return md


def _records(per_run: pd.DataFrame) -> list[dict]:
    return per_run.to_dict("records") if len(per_run) else []


def write_table(exp: Experiment, planned: list[Planned], out: str | Path, numbers: dict, report: bool = True,
                log: Callable = print) -> Path:
    """``<out>/<experiment>/reproduction.md`` (+ ``.json``: the table, the claims with their paired differences and
    verdicts, and one record per run with its provenance) and, with ``report``, raysim report's summary and plots
    under ``<out>/<experiment>/report/``."""
    exp = replace(exp, seeds=tuple(sorted({p.seed for p in planned})) or exp.seeds)  # the seeds this table ran
    per_run = collect(exp, planned)
    table, claims = summarise(exp, per_run, numbers)
    d = Path(out) / exp.name
    d.mkdir(parents=True, exist_ok=True)
    overrides = list(exp.cli_overrides)  # raysim reproduce --set / --backend: in the header, scale line and JSON
    md = table_markdown(exp, table, claims, numbers, per_run)
    diverged = [(p, diverged_reason(p.target, p.cfg)) for p in planned if not (p.target / "results.parquet").exists()]
    diverged = [(p, m) for p, m in diverged if m is not None]
    gone = {id(p) for p, _ in diverged}
    missing = [f"{p.run.label} seed {p.seed}" for p in planned
               if not (p.target / "results.parquet").exists() and id(p) not in gone]
    if diverged:
        md += "\nDiverged (left out of the table; the run stopped on a NaN/inf, `on_nonfinite: stop`): " + "; ".join(
            f"{p.run.label} seed {p.seed} ({m.split(' (on_nonfinite')[0]})" for p, m in diverged) + ".\n"
    if missing:
        md += f"\nNot finished (left out of the table): {', '.join(missing)}.\n"
    (d / "reproduction.md").write_text(md)
    (d / "reproduction.json").write_text(json.dumps({"experiment": exp.name, "source": exp.source,
                                                     "scaled": scale_text(exp, overrides),
                                                     "overrides": overrides, "with_overrides": bool(overrides),
                                                     "seed_compared": seed_compared(exp, overrides),
                                                     "seeds": list(exp.seeds),
                                                     "min_seeds": exp.min_seeds, "table": table.to_dict("records"),
                                                     "claims": claims, "runs": _records(per_run)},
                                                    indent=1, default=_json_default))
    if report and len(per_run):
        from raysim.app.summary import ReportOptions, build_report

        client_metrics = [m for m in (exp.metric, *exp.extra_metrics) if not m.startswith("server:")]
        try:
            # the seed's own protocol puts each method's metric side by side: said in the summary, not refused
            build_report(list(per_run["path"]), d / "report",
                         ReportOptions(metrics=client_metrics or None, mixed_metrics=True,
                                       labels=method_labels(per_run)), log=log)
        except (ConfigError, KeyError) as e:  # a metric only some runs have: the table above still stands
            log(f"note: raysim report skipped ({e})")
    return d / "reproduction.md"


def method_labels(per_run: pd.DataFrame) -> dict:
    """The report's settings named as the table's methods ({label: the method's directory}): two methods of one
    config (a variant that became the default) stay two settings, never one of doubled seeds."""
    return {str(lab): str(Path(p).parent) for lab, p in zip(per_run["label"], per_run["path"])}


def _json_default(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return str(v)


def with_window(per_run: pd.DataFrame, exp: Experiment) -> pd.DataFrame:
    """Stored per-run records as the claims read them (issue 51): records written before the window hold one value
    per metric, the final round (or the seed's selection); where they carry each run's per-round values (``curve``:
    round -> value of the experiment's metric) the metric becomes the mean of the last ``exp.window`` evaluated
    rounds and the final round moves to ``<metric>@final``; without a curve the value stays the final round (the
    claims then say so)."""
    m = exp.metric
    if not len(per_run) or f"{m}{FINAL}" in per_run.columns:
        return per_run
    if exp.select != "last":
        return per_run  # the seed's selection: the records hold no final round to show beside it
    for k in (m, *exp.extra_metrics):
        if k in per_run.columns:
            per_run[f"{k}{FINAL}"] = per_run[k]
    if "curve" not in per_run.columns:
        return per_run
    has = per_run["curve"].apply(lambda c: isinstance(c, dict) and len(c) > 0)
    if not has.all():
        return per_run
    got = per_run["curve"].apply(lambda c: verdicts.window_mean({int(r): v for r, v in c.items()}, exp.window))
    per_run[m] = [v for v, _ in got]
    per_run["window"] = [k for _, k in got]
    return per_run


def render_records(exp: Experiment, record: dict, numbers: dict) -> tuple[str, dict]:
    """The table and claims again from a stored ``reproduction.json`` (``record``: its per-run records under
    ``runs``), with this code's verdicts: (markdown, the record with ``table``, ``claims``, ``seeds`` and
    ``min_seeds`` recomputed; ``runs`` untouched). Runs whose label is no longer in the experiment are left out."""
    per_run = pd.DataFrame(record.get("runs") or [])
    if len(per_run):
        per_run = with_window(per_run[per_run["label"].isin([r.label for r in exp.runs])].copy(), exp)
    seeds = tuple(sorted({int(s) for s in per_run["seed"]})) if len(per_run) else exp.seeds
    exp = replace(exp, seeds=seeds)
    overrides = [str(o) for o in record.get("overrides") or []]
    exp = replace(exp, cli_overrides=tuple(overrides))
    table, claims = summarise(exp, per_run, numbers)
    md = table_markdown(exp, table, claims, numbers, per_run)
    new = dict(record, seeds=list(seeds), min_seeds=exp.min_seeds, scaled=scale_text(exp, overrides),
               overrides=overrides, with_overrides=bool(overrides), seed_compared=seed_compared(exp, overrides),
               table=json.loads(json.dumps(table.to_dict("records"), default=_json_default)),
               claims=json.loads(json.dumps(claims, default=_json_default)))
    return md, new
