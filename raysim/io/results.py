"""Tidy, long-format result tables (one Parquet file per run) and helpers to analyse them with pandas.

Columns: run_id, round, client_id (-1 for server/summary rows), scope (client | server | mean | std | total),
metric, value, weight. ``round`` is the 0-based round index (round 0 is the first round, its rows measured after it);
every count of rounds the helpers return (``rounds``, ``rounds_run``, ``rounds_to_best``, ``rounds_to_target``) is
rounds completed, ``round + 1``, as in ``raysim report``, its plots and the progress lines. Config, seed, versions and data-scaling notes live in the Parquet file metadata under the key
``raysim``.

Timing rows (scope ``total``, client -1): ``round_s``, the driver's wall time of each round (its steps and its
evaluation; round -1: the setup phase), and ``step_s@<step>``, the wall time of each step of the round's schedule
and of its evaluation (summed over a ``Repeat``'s iterations). They differ from run to run; every other row is
deterministic. :func:`without_timing` drops them (for comparing tables), :func:`timing` pivots them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from raysim.errors import MetricError
from raysim.io.tables import (COLUMNS, DIGEST_KEY, META_KEY, RESULTS_FILE, ROUND_TIME, RUN_INFO, STEP_TIME, ResultTable,
                              result_files, check_table, file_sha256, is_timing, load, load_metadata, read_run_info,
                              read_table, read_table_metadata, timing, without_timing, write_parquet)


# ----------------------------------------------------------------------------------------------------------------
# analysis helpers: every one takes (df, metric, ...); std is always the sample std (ddof = 1)


def client_metrics(df: pd.DataFrame) -> list[str]:
    """The client-scope metrics a table holds."""
    return sorted(df.loc[df["scope"] == "client", "metric"].unique())


def _need_metric(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    if not isinstance(metric, str):
        raise TypeError(f"metric must be a metric name (str), got {metric!r}")
    d = df[(df["scope"] == "client") & (df["metric"] == metric)]
    if d.empty:
        raise MetricError(f"no client metric {metric!r} in this table; client metrics here: "
                          f"{', '.join(client_metrics(df)) or 'none'}")
    return d


def client_metric(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """The per-client rows of ``metric``."""
    return _need_metric(df, metric)


def per_round(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """Per run and evaluated round: mean, sample std (ddof = 1) and count over clients of ``metric`` (columns run_id,
    round, rounds, mean, std, count: ``round`` the table's 0-based index, ``rounds`` the rounds completed, round + 1).
    Raises :class:`MetricError` when the table has no client-scope ``metric``."""
    d = _need_metric(df, metric)
    out = d.groupby(["run_id", "round"])["value"].agg(["mean", "std", "count"]).reset_index()
    out.insert(2, "rounds", out["round"] + 1)
    return out


def _one_run(pr: pd.DataFrame, run_id, what: str) -> pd.DataFrame:
    runs = list(pr["run_id"].unique())
    if run_id is not None:
        if run_id not in runs:
            raise KeyError(f"{what}: no run {run_id!r} in this table; its runs: {', '.join(map(str, runs))}")
        return pr[pr["run_id"] == run_id]
    if len(runs) != 1:
        raise ValueError(f"{what}(..., scalar=True) needs one run; this table holds {len(runs)} "
                         f"({', '.join(map(str, runs[:5]))}{' ...' if len(runs) > 5 else ''}): pass run_id=")
    return pr


def final(df: pd.DataFrame, metric: str = "test_acc", *, scalar: bool = False, run_id=None):
    """Per run: mean and sample std over clients of ``metric`` at the last evaluated round (columns run_id, round,
    rounds, mean, std, count; ``round`` is the table's 0-based round index, ``rounds`` the rounds completed).
    ``scalar=True``: that mean as a float, for a table of one run (or the run ``run_id``)."""
    pr = per_round(df, metric)
    if run_id is not None or scalar:
        pr = _one_run(pr, run_id, "final")
    out = pr.loc[pr.groupby("run_id")["round"].idxmax()].reset_index(drop=True)
    return float(out["mean"].iloc[0]) if scalar else out


def best(df: pd.DataFrame, metric: str = "test_acc", *, scalar: bool = False, run_id=None):
    """Per run: the evaluated round with the highest mean over clients of ``metric`` (columns as :func:`final`;
    ``scalar=True``: that mean as a float, for one run)."""
    pr = per_round(df, metric)
    if run_id is not None or scalar:
        pr = _one_run(pr, run_id, "best")
    out = pr.loc[pr.groupby("run_id")["mean"].idxmax()].reset_index(drop=True)
    return float(out["mean"].iloc[0]) if scalar else out


def communication(df: pd.DataFrame) -> pd.DataFrame:
    """Per run: mean per round and total over the run of floats and bytes sent up and down (all clients). A setup
    phase (rows at round -1) counts in ``total`` and ``setup``, not in the per-round mean."""
    d = df[(df["scope"] == "total") & df["metric"].isin(["up_floats", "up_bytes", "down_floats", "down_bytes"])]
    g = d.groupby(["run_id", "metric"])["value"]
    rounds = d[d["round"] >= 0].groupby(["run_id", "metric"])["value"]
    setup = d[d["round"] < 0].groupby(["run_id", "metric"])["value"].sum()
    out = pd.DataFrame({"per_round": rounds.mean(), "total": g.sum()})
    out["setup"] = setup.reindex(out.index).fillna(0.0)
    return out.reset_index()


def rounds_to_target(df: pd.DataFrame, metric: str = "test_acc", target: float | None = None) -> pd.DataFrame:
    """Per run: ``round``, the 0-based index of the first evaluated round whose mean ``metric`` reaches ``target``,
    and ``rounds``, the rounds completed by then (round + 1); NaN where it is never reached."""
    if target is None:
        raise TypeError("rounds_to_target needs a target, e.g. rounds_to_target(df, 'test_acc', 0.9)")
    pr = per_round(df, metric)
    out = []
    for run_id, g in pr.groupby("run_id"):
        hit = g[g["mean"] >= target]
        r = int(hit["round"].min()) if len(hit) else np.nan
        out.append({"run_id": run_id, "round": r, "rounds": r + 1 if len(hit) else np.nan})
    return pd.DataFrame(out, columns=["run_id", "round", "rounds"])


def env_time(df: pd.DataFrame, metric: str = "sim_time") -> pd.DataFrame:
    """Per run and round, an environment quantity (``sim_time``: cumulative simulated seconds at the round's end;
    ``sim_round_s``, ``kept``, ``dropped`` ...) from the rows the environment layer writes (scope ``env``)."""
    d = df[(df["scope"] == "env") & (df["metric"] == metric)]
    return d[["run_id", "round", "value"]].rename(columns={"value": metric}).reset_index(drop=True)


def accuracy_vs_sim_time(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """Mean/std over clients of ``metric`` per evaluated round, with the simulated time at that round's end."""
    pr = per_round(df, metric)
    t = env_time(df)
    if t.empty:
        raise ValueError("no simulated time in this table: the run had no env section")
    return pr.merge(t, on=["run_id", "round"], how="left")


def sim_time_to_target(df: pd.DataFrame, metric: str = "test_acc", target: float | None = None) -> pd.DataFrame:
    """Per run: the first evaluated round whose mean ``metric`` reaches ``target``, and the simulated time (seconds)
    and bytes (up + down, all clients) spent until the end of that round; NaN where the target is never reached."""
    avt = accuracy_vs_sim_time(df, metric)
    tot = df[(df["scope"] == "total") & df["metric"].isin(["up_bytes", "down_bytes"])]
    out = []
    for run_id, g in avt.groupby("run_id"):
        hit = g[g["mean"] >= target].sort_values("round")
        row = {"run_id": run_id, "target": target, "round": np.nan, "sim_time": np.nan, "bytes": np.nan}
        if len(hit):
            r = int(hit["round"].iloc[0])
            spent = tot[(tot["run_id"] == run_id) & (tot["round"] <= r)]["value"].sum()
            row.update(round=r, sim_time=float(hit["sim_time"].iloc[0]), bytes=float(spent))
        out.append(row)
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------------------------------------------
# time axes, time-to-target and summaries over seeds (used by ``raysim report`` and ``tuning``)

COMM_BYTES = ("up_bytes", "down_bytes")


def cumulative(df: pd.DataFrame, time: str = "round") -> pd.DataFrame:
    """Per run and round, the time axis at the end of that round: ``round`` -> rounds completed (round + 1);
    ``bytes`` -> bytes communicated so far, up + down, all clients; any other name -> running sum of that
    total/server/env-scope metric (e.g. ``sim_round_s``, the environment's simulated round duration). Columns
    run_id, round, x."""
    rounds = df[["run_id", "round"]].drop_duplicates().sort_values(["run_id", "round"])
    if time == "round":
        return rounds.assign(x=rounds["round"].astype(float) + 1.0).reset_index(drop=True)
    names = list(COMM_BYTES) if time == "bytes" else [time]
    d = df[df["scope"].isin(["total", "server", "env"]) & df["metric"].isin(names)]
    if d.empty:
        raise KeyError(f"no '{time}' rows (scope total, server or env) in the result table")
    per = d.groupby(["run_id", "round"])["value"].sum().rename("step").reset_index()
    out = rounds.merge(per, on=["run_id", "round"], how="left").fillna({"step": 0.0})
    out["x"] = out.groupby("run_id")["step"].cumsum()
    return out.drop(columns="step").reset_index(drop=True)


def time_to_target(df: pd.DataFrame, metric: str = "test_acc", target: float | None = None,
                   time: str = "round") -> pd.DataFrame:
    """Per run: the first evaluated round whose mean ``metric`` reaches ``target`` and the time axis there
    (rounds completed, bytes, or simulated time; see :func:`cumulative`). NaN where the target is never reached.
    With a simulated environment also ``sim_time``: the simulated clock (seconds) at that round's end, for
    synchronous rounds and for the server versions of ``server.mode: async`` alike."""
    pr = per_round(df, metric).merge(cumulative(df, time), on=["run_id", "round"], how="left")
    clock = env_time(df)
    if not clock.empty:
        pr = pr.merge(clock, on=["run_id", "round"], how="left")
    out = []
    for run_id, g in pr.groupby("run_id"):
        hit = g[g["mean"] >= target].sort_values("round")
        row = {"run_id": run_id, "round": int(hit["round"].iloc[0]) if len(hit) else np.nan,
               "time": float(hit["x"].iloc[0]) if len(hit) else np.nan}
        if not clock.empty:
            row["sim_time"] = float(hit["sim_time"].iloc[0]) if len(hit) else np.nan
        out.append(row)
    return pd.DataFrame(out, columns=["run_id", "round", "time"] + ([] if clock.empty else ["sim_time"]))


def run_index(paths, on_damaged=None) -> pd.DataFrame:
    """One row per finished run: run_id, name, seed, group, path, algorithm. Runs whose configs differ only in the seed share a group
    (``<name>-<hash of the config without the seed>``), so seeds of one setting are aggregated together.
    ``on_damaged(error)``: damaged runs found by searching a directory are skipped and passed to it (runs named
    directly, and every damaged run when it is None, raise DamagedFileError)."""
    import hashlib

    from raysim.errors import DamagedFileError

    rows = []
    named = {Path(p) / RESULTS_FILE if Path(p).is_dir() else Path(p)
             for p in ([paths] if isinstance(paths, (str, Path)) else paths)}
    for f in result_files(paths):
        try:
            meta = read_table_metadata(f)
            check_table(f)
        except DamagedFileError as e:
            if on_damaged is None or f in named:
                raise
            on_damaged(e)
            continue
        cfg = dict(meta.get("config") or {})
        science = {k: v for k, v in cfg.items() if k not in ("seed", "name", "backend", "output")}
        h = hashlib.sha256(json.dumps(science, sort_keys=True, default=str).encode()).hexdigest()[:8]
        run_id = meta.get("run_id") or str(read_table(f, columns=["run_id"])["run_id"].iloc[0])
        rows.append({"run_id": run_id, "name": cfg.get("name", run_id), "seed": meta.get("seed", cfg.get("seed")),
                     "group": f"{cfg.get('name', 'run')}-{h}", "path": str(f.parent),
                     "algorithm": (cfg.get("algorithm") or {}).get("name", "?")})
    return pd.DataFrame(rows, columns=["run_id", "name", "seed", "group", "path", "algorithm"])


def _groups_frame(df: pd.DataFrame, groups) -> pd.DataFrame:
    if groups is None:
        return pd.DataFrame({"run_id": df["run_id"].unique(), "group": df["run_id"].unique()})
    if isinstance(groups, pd.DataFrame):
        return groups[["run_id", "group"]]
    return pd.DataFrame({"run_id": list(groups), "group": [groups[k] for k in groups]})


def seed_summary(df: pd.DataFrame, metric: str = "test_acc", groups=None, target: float | None = None,
                 time: str | None = None) -> pd.DataFrame:
    """Mean ± std over the runs (seeds) of each group. Per run: final = mean over clients of ``metric`` at the last
    evaluated round, best = the highest such mean, rounds_run / rounds_to_best / rounds_to_target = rounds
    completed at the last evaluated round, at the best, and when the mean first reaches ``target`` (the table's
    round index + 1, as the x axis of :func:`seed_curves`), the ``time`` axis there, communication totals over the
    whole run.
    The std is the sample std over runs (ddof = 1; NaN for a single run). ``groups``: run_id -> group (a mapping or
    the frame of :func:`run_index`); default one group per run."""
    g = _groups_frame(df, groups)
    fin = final(df, metric)[["run_id", "rounds", "mean"]].rename(columns={"rounds": "rounds_run", "mean": "final"})
    bst = best(df, metric)[["run_id", "rounds", "mean"]].rename(columns={"rounds": "rounds_to_best", "mean": "best"})
    runs = g.merge(fin, on="run_id").merge(bst, on="run_id")
    com = communication(df)
    for m in COMM_BYTES:
        tot = com[com["metric"] == m][["run_id", "total"]].rename(columns={"total": f"{m}_total"})
        runs = runs.merge(tot, on="run_id", how="left")
    if target is not None:
        tt = time_to_target(df, metric, target, "round").rename(columns={"time": "rounds_to_target"})
        runs = runs.merge(tt[["run_id", "rounds_to_target"]], on="run_id", how="left")
        if time not in (None, "round"):
            tt = time_to_target(df, metric, target, time).rename(columns={"time": f"{time}_to_target"})
            runs = runs.merge(tt[["run_id", f"{time}_to_target"]], on="run_id", how="left")
    value_cols = [c for c in runs.columns if c not in ("run_id", "group")]
    agg = runs.groupby("group", sort=True)
    out = pd.DataFrame({"runs": agg.size()})
    for c in value_cols:
        out[f"{c}_mean"] = agg[c].mean()
        out[f"{c}_std"] = agg[c].std(ddof=1)
    if target is not None:
        out["reached"] = agg["rounds_to_target"].apply(lambda s: int(s.notna().sum()))
    return out.reset_index()


def seed_curves(df: pd.DataFrame, metric: str = "test_acc", groups=None, time: str = "round") -> pd.DataFrame:
    """Per group and evaluated round: the time axis (mean over runs; for ``round`` the rounds completed) and the mean
    over clients of ``metric``, averaged over runs with its sample std (columns group, round, x, mean, std, runs)."""
    g = _groups_frame(df, groups)
    pr = per_round(df, metric)[["run_id", "round", "mean"]].merge(cumulative(df, time), on=["run_id", "round"])
    pr = pr.merge(g, on="run_id")
    agg = pr.groupby(["group", "round"])
    out = pd.DataFrame({"x": agg["x"].mean(), "mean": agg["mean"].mean(), "std": agg["mean"].std(ddof=1),
                        "runs": agg.size()})
    return out.reset_index()


def markdown_table(frame: pd.DataFrame, digits: int = 4) -> str:
    """A GitHub-flavoured Markdown table (no tabulate dependency); NaN prints as an en dash."""
    def cell(v):
        if isinstance(v, (float, np.floating)):
            if not np.isfinite(v):
                return "–"
            return f"{v:,.0f}" if abs(v) >= 1e5 else f"{v:.{digits}g}" if abs(v) >= 1 else f"{v:.{digits}f}"
        return str(v)

    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(cell(row[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def select_by_validation(df: pd.DataFrame, val: str = "val_acc_all",
                         metrics=("test_acc_all", "test_bwt", "test_fwt")) -> pd.DataFrame:
    """Model selection as MAFML's seed does it (§4.1.2): per client, the evaluated round with the highest ``val``
    (the first such round on ties) and the test ``metrics`` of that round (``sel_<metric>``), next to the last
    evaluated round's (``last_<metric>``). One row per client: client_id, sel_round, last_round, the values."""
    c = df[df["scope"] == "client"]
    wide = c[c["metric"].isin([val, *metrics])].pivot_table(index=["client_id", "round"], columns="metric",
                                                             values="value", aggfunc="first")
    out = []
    for cid, g in wide.groupby(level=0):
        g = g.droplevel(0).sort_index()
        g = g[g[val].notna()]
        if g.empty:
            continue
        sel = g[val].idxmax()
        last = g.index.max()
        row = {"client_id": int(cid), "sel_round": int(sel), "last_round": int(last)}
        for m in metrics:
            row[f"sel_{m}"] = float(g.loc[sel, m])
            row[f"last_{m}"] = float(g.loc[last, m])
        out.append(row)
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------------------------------------------
# paired comparison of settings run over the same seeds (``raysim compare``; the verdicts of raysim.verdicts, the
# code of ``raysim reproduce``'s claims)


def run_curves(df: pd.DataFrame, metric: str = "test_acc") -> dict:
    """run_id -> {round: value}: the mean over clients of a client metric at each evaluated round, or a server-scope
    metric (``global_test_acc``) where no client rows carry it."""
    d = df[(df["scope"] == "client") & (df["metric"] == metric)]
    if d.empty:
        d = df[(df["scope"] == "server") & (df["metric"] == metric)]
    if d.empty:
        raise MetricError(f"no client or server metric {metric!r} in this table; client metrics here: "
                          f"{', '.join(client_metrics(df)) or 'none'}")
    per = d.groupby(["run_id", "round"])["value"].mean()
    return {rid: {int(r): float(v) for r, v in g.droplevel(0).items()} for rid, g in per.groupby(level=0)}


def _settings(groups: pd.DataFrame) -> tuple[list, dict]:
    """(the settings in order of first appearance, setting -> {seed: run_id}); a setting with two runs of one seed
    is refused (its pairing would be ambiguous)."""
    from raysim.errors import ConfigError

    col = "setting" if "setting" in groups.columns else "group"
    order, runs = [], {}
    for _, row in groups.iterrows():
        name, seed = row[col], int(row["seed"])
        if name not in runs:
            order.append(name)
            runs[name] = {}
        if seed in runs[name]:
            raise ConfigError("runs", f"setting {name!r} has two runs of seed {seed} ({runs[name][seed]}, "
                                      f"{row['run_id']}); give one run per seed and setting")
        runs[name][seed] = row["run_id"]
    return order, runs


def unpaired_seeds(groups: pd.DataFrame, baseline=None) -> list[str]:
    """One phrase per setting whose seeds differ from the baseline's: which seeds either side lacks."""
    order, runs = _settings(groups)
    base = order[0] if baseline is None else baseline
    out = []
    for name in order:
        if name == base:
            continue
        only, missing = sorted(set(runs[name]) - set(runs[base])), sorted(set(runs[base]) - set(runs[name]))
        if only or missing:
            out.append(f"{name}: " + "; ".join(
                x for x in (f"seed(s) {', '.join(map(str, only))} without a {base} run" if only else "",
                            f"no run of seed(s) {', '.join(map(str, missing))}" if missing else "") if x))
    return out


def paired(df: pd.DataFrame, metric: str = "test_acc", groups=None, *, baseline=None, last: int = 1,
           lower_is_better: bool = False) -> pd.DataFrame:
    """Each setting against a baseline over the seeds both ran: per seed, the difference of the runs' values
    (setting - baseline; baseline - setting where lower is better), and over the seeds the mean, its 95 % Student-t
    interval, the paired t-test's p and the verdict of ``raysim reproduce`` (:func:`raysim.verdicts.judge`): ``held``
    (the setting is better: the interval lies above 0), ``tie`` (it contains 0), ``reversed`` (below 0), ``n too
    small`` (fewer than 3 pairs). A run's value is its final evaluated round (``last=1``) or the mean of its last
    ``last`` evaluated rounds (:func:`raysim.verdicts.window_mean`).

    ``groups``: the run index (:func:`run_index`: run_id, seed, group, and optionally ``setting``, a label; default
    one setting per run name); ``baseline``: a setting (default the first). One row per other setting: setting,
    baseline, metric, rounds, n, mean, sd, half, lo, hi, p, verdict, setting_mean, baseline_mean, seeds (the paired
    ones), unpaired (seeds either side lacks), diffs (JSON: seed -> difference)."""
    from raysim import verdicts

    if groups is None:
        raise TypeError("paired needs the run index (raysim.results.run_index(paths)): it says each run's seed")
    if int(last) < 1:
        raise ValueError(f"last must be >= 1 (the final round), got {last}")
    order, runs = _settings(groups)
    base = order[0] if baseline is None else baseline
    if base not in runs:
        raise KeyError(f"baseline {base!r} is not a setting here; settings: {', '.join(map(str, order))}")
    curves = run_curves(df, metric)
    value = {rid: verdicts.window_mean(c, int(last))[0] for rid, c in curves.items()}
    by_seed = {name: {s: value.get(rid, np.nan) for s, rid in seeds.items()} for name, seeds in runs.items()}
    rows = []
    for name in order:
        if name == base:
            continue
        res = verdicts.judge(by_seed[name], by_seed[base], lower_is_better)
        pairs = sorted(res["diffs"])
        rows.append({"setting": name, "baseline": base, "metric": metric,
                     "rounds": "final" if int(last) == 1 else f"last {int(last)}",
                     **{k: res[k] for k in ("n", "mean", "sd", "half", "lo", "hi", "p", "verdict")},
                     "setting_mean": float(np.mean([by_seed[name][s] for s in pairs])) if pairs else np.nan,
                     "baseline_mean": float(np.mean([by_seed[base][s] for s in pairs])) if pairs else np.nan,
                     "seeds": ",".join(map(str, pairs)),
                     "unpaired": "; ".join(unpaired_seeds(groups[groups[_col(groups)].isin([name, base])], base)),
                     "diffs": json.dumps({str(k): v for k, v in res["diffs"].items()})})
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS)


PAIRED_COLUMNS = ["setting", "baseline", "metric", "rounds", "n", "mean", "sd", "half", "lo", "hi", "p", "verdict",
                  "setting_mean", "baseline_mean", "seeds", "unpaired", "diffs"]


def _col(groups: pd.DataFrame) -> str:
    return "setting" if "setting" in groups.columns else "group"


# the table format and its verified reads live in raysim.io.tables; importable from here (raysim.results) as before
__all__ = ["COLUMNS", "DIGEST_KEY", "META_KEY", "RESULTS_FILE", "ROUND_TIME", "RUN_INFO", "STEP_TIME", "MetricError",
           "ResultTable", "accuracy_vs_sim_time", "best", "check_table", "client_metric", "client_metrics",
           "communication", "cumulative", "env_time", "file_sha256", "final", "is_timing", "load", "load_metadata",
           "markdown_table", "paired", "per_round", "run_curves", "unpaired_seeds", "read_run_info", "read_table", "read_table_metadata", "rounds_to_target",
           "run_index", "seed_curves", "seed_summary", "select_by_validation", "sim_time_to_target", "time_to_target",
           "timing", "without_timing", "write_parquet"]
