"""The table of a seed experiment (``raysim reproduce``'s last step): each run's value (the last evaluation, or the
checkpoint a validation metric selects, per run or per client), mean +- sample std over seeds beside the seed's
number and the difference, traffic and wall time from each run's own records, the claims held in direction, written
as ``reproduction.md`` / ``.json`` with raysim report's summary and plots under it."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from raysim.config import ConfigError

from raysim.reproduce import Experiment, Planned, diverged_reason, paper_value, source_entry


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


def _wall_s(path: Path) -> float:
    try:
        t = json.loads((path / "run.json").read_text()).get("timing") or {}
        return float(t.get("setup_s", 0) + t.get("setup_phase_s", 0) + t.get("total_round_s", 0))
    except (OSError, ValueError, TypeError):
        return math.nan


def collect(exp: Experiment, planned: list[Planned]) -> pd.DataFrame:
    """One row per finished run: label, seed, each metric's reported value, total floats (up + down) and wall time."""
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
                v = run_value(df, m, exp.select, exp.select_per)
            except ConfigError:
                if m == exp.metric:
                    raise ConfigError(f"{exp.name}.metric", f"run {p.target} has no {m!r}") from None
                v = math.nan  # an extra metric a method does not report (e.g. test_acc_proto for FedAvg): '–'

            row[m] = v * 100 if exp.percent and not m.startswith("server:") and _is_rate(m) else v
        com = results.communication(df)
        tot = com.set_index("metric")["total"]
        row["floats"] = float(tot.get("up_floats", 0.0) + tot.get("down_floats", 0.0))
        row["setup_floats"] = float(com.set_index("metric")["setup"].get("up_floats", 0.0)
                                    + com.set_index("metric")["setup"].get("down_floats", 0.0))
        row["wall_s"] = _wall_s(p.target)
        rows.append(row)
    return pd.DataFrame(rows)


def _is_rate(metric: str) -> bool:
    """Accuracies (and BWT/FWT) are shown in percent; losses, ARI and counts are not."""
    return "acc" in metric or metric.endswith(("_bwt", "_fwt"))


def _fmt(mean: float, std: float, digits: int = 2) -> str:
    if not np.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if np.isfinite(std) else "")


def summarise(exp: Experiment, per_run: pd.DataFrame, numbers: dict) -> tuple[pd.DataFrame, list[dict]]:
    """Per run label: mean and sample std over seeds of each metric, the seed's number and the difference; and the
    claims, each held in direction or not (ours, and the seed's own numbers where it has both)."""
    metrics = [exp.metric, *exp.extra_metrics]
    out = []
    for r in exp.runs:
        g = per_run[per_run["label"] == r.label] if len(per_run) else per_run
        row = {"label": r.label, "seeds": int(len(g))}
        for m in metrics:
            vals = g[m].astype(float) if len(g) else pd.Series(dtype=float)
            row[f"{m}_mean"] = float(vals.mean()) if len(vals) else math.nan
            row[f"{m}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
            row[f"{m}_paper"] = paper_value(exp, numbers, r, m.split(":", 1)[-1]) if r.paper else math.nan
        row["floats"] = float(g["floats"].mean()) if len(g) else math.nan
        row["setup_floats"] = float(g["setup_floats"].mean()) if len(g) else math.nan
        row["wall_s"] = float(g["wall_s"].mean()) if len(g) else math.nan
        out.append(row)
    table = pd.DataFrame(out)
    claims = []
    for c in exp.claims:
        m = c.metric or exp.metric
        col = "floats" if m == "floats" else f"{m}_mean"
        b, w = table.set_index("label").loc[c.better], table.set_index("label").loc[c.worse]
        sign = -1.0 if c.lower_is_better else 1.0
        ours = sign * (b[col] - w[col]) if np.isfinite(b[col]) and np.isfinite(w[col]) else math.nan
        paper = math.nan
        if m != "floats":
            pb, pw = b.get(f"{m}_paper", math.nan), w.get(f"{m}_paper", math.nan)
            if np.isfinite(pb) and np.isfinite(pw):
                paper = sign * (pb - pw)
        noise = math.nan
        if m != "floats":
            stds = [s for s in (b[f"{m}_std"], w[f"{m}_std"]) if np.isfinite(s)]
            noise = max(stds) if stds else math.nan
        claims.append({"text": c.text, "metric": m, "better": c.better, "worse": c.worse, "ours": ours,
                       "paper": paper, "held": (bool(ours > 0) if np.isfinite(ours) else None),
                       "within_noise": bool(np.isfinite(ours) and np.isfinite(noise) and abs(ours) <= noise)})
    return table, claims


def table_markdown(exp: Experiment, table: pd.DataFrame, claims: list[dict], numbers: dict) -> str:
    metrics = [exp.metric, *exp.extra_metrics]
    entry = source_entry(exp, numbers)
    unit = " (%)" if exp.percent else ""
    sel = ("last evaluated round" if exp.select == "last" else
           f"the round with the best {exp.select} ({'per client' if exp.select_per == 'client' else 'mean over clients'})")
    lines = [f"## {exp.name}: {exp.title}\n",
             f"Seed: {entry.get('source', exp.source)}. Values{unit}: mean ± sample std over seeds "
             f"{', '.join(str(s) for s in sorted(set(int(x) for x in exp.seeds)))} of the mean over clients, at {sel}. "
             f"Scale: {exp.scaled or 'the seed’s full size'}.\n"]
    if exp.description:
        lines.append(exp.description.strip() + "\n")
    head = ["method", "seeds"]
    for m in metrics:
        head += [m, "seed's", "diff"]
    head += ["floats (up+down)", "of which setup", "wall s/run"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for _, r in table.iterrows():
        cells = [str(r["label"]), str(int(r["seeds"]))]
        for m in metrics:
            mean, std, paper = r[f"{m}_mean"], r[f"{m}_std"], r[f"{m}_paper"]
            cells += [_fmt(mean, std), _fmt(paper, math.nan),
                      (f"{mean - paper:+.2f}" if np.isfinite(mean) and np.isfinite(paper) else "–")]
        cells += [f"{r['floats']:,.0f}" if np.isfinite(r["floats"]) else "–",
                  f"{r['setup_floats']:,.0f}" if np.isfinite(r["setup_floats"]) else "–",
                  f"{r['wall_s']:.1f}" if np.isfinite(r["wall_s"]) else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    if claims:
        lines.append("\n| claim | metric | ours (better − worse) | seed's | held in direction |")
        lines.append("|---|---|---|---|---|")
        for c in claims:
            held = "–" if c["held"] is None else ("yes" if c["held"] else "no")
            if c["held"] is not None and c["within_noise"]:
                held += " (within 1 std)"
            ours = f"{c['ours']:+,.2f}" if np.isfinite(c["ours"]) else "–"
            paper = f"{c['paper']:+.2f}" if np.isfinite(c["paper"]) else "–"
            lines.append(f"| {c['text']} | {c['metric']} | {ours} | {paper} | {held} |")
    return "\n".join(lines) + "\n"


def write_table(exp: Experiment, planned: list[Planned], out: str | Path, numbers: dict, report: bool = True,
                log: Callable = print) -> Path:
    """``<out>/<experiment>/reproduction.md`` (+ ``.json``) and, with ``report``, raysim report's summary and plots
    under ``<out>/<experiment>/report/``."""
    exp = replace(exp, seeds=tuple(sorted({p.seed for p in planned})) or exp.seeds)  # the seeds this table ran
    per_run = collect(exp, planned)
    table, claims = summarise(exp, per_run, numbers)
    d = Path(out) / exp.name
    d.mkdir(parents=True, exist_ok=True)
    md = table_markdown(exp, table, claims, numbers)
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
                                                     "scaled": exp.scaled, "table": table.to_dict("records"),
                                                     "claims": claims, "runs": per_run.to_dict("records")},
                                                    indent=1, default=float))
    if report and len(per_run):
        from raysim.io.report import build_report

        client_metrics = [m for m in (exp.metric, *exp.extra_metrics) if not m.startswith("server:")]
        try:
            build_report(list(per_run["path"]), d / "report", metrics=client_metrics or None, log=log)
        except (ConfigError, KeyError) as e:  # a metric only some runs have: the table above still stands
            log(f"note: raysim report skipped ({e})")
    return d / "reproduction.md"
