"""``raysim report RUN_DIR...``: a Markdown summary over seeds and PNG plots of accuracy vs round, vs bytes
communicated and vs simulated time, from the runs' Parquet tables (numbers via :mod:`raysim.results`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from raysim import results

# a round's simulated duration (summed into the time axis): the environment layer writes ``sim_round_s`` (scope env);
# the other names are accepted for tables from elsewhere; --time-metric overrides
SIM_TIME_CANDIDATES = ("sim_round_s", "sim_round_time", "round_sim_time", "simulated_time", "sim_time")


def load_runs(paths) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(long table of all runs, run index). A run id seen twice (the same config run into two directories) gets a
    ``#k`` suffix, so runs are never silently merged."""
    index = results.run_index(paths)
    frames, seen = [], {}
    for i, row in index.iterrows():
        df = pd.read_parquet(Path(row["path"]) / results.RESULTS_FILE)
        rid = row["run_id"]
        seen[rid] = seen.get(rid, 0) + 1
        if seen[rid] > 1:
            rid = f"{rid}#{seen[rid]}"
            index.loc[i, "run_id"] = rid
            df["run_id"] = rid
        frames.append(df)
    return pd.concat(frames, ignore_index=True), index


def find_time_metric(df: pd.DataFrame, wanted: Optional[str] = None) -> Optional[str]:
    names = set(df.loc[df["scope"].isin(["total", "server", "env"]), "metric"].unique())
    if wanted:
        if wanted not in names:
            raise KeyError(f"no total/server/env-scope metric {wanted!r} in these runs")
        return wanted
    return next((n for n in SIM_TIME_CANDIDATES if n in names), None)


def _pm(mean, std, digits=4) -> str:
    if mean is None or not np.isfinite(mean):
        return "–"
    if std is None or not np.isfinite(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def summary_markdown(summary: pd.DataFrame, index: pd.DataFrame, metric: str, target: Optional[float],
                     time_metric: Optional[str]) -> str:
    rows = []
    for _, s in summary.iterrows():
        seeds = index[index["group"] == s["group"]]["seed"].tolist()
        row = {"setting": s["group"], "runs": int(s["runs"]), "seeds": ",".join(str(x) for x in seeds),
               f"final {metric}": _pm(s["final_mean"], s["final_std"]),
               f"best {metric}": _pm(s["best_mean"], s["best_std"]),
               "best round idx": _pm(s["best_round_mean"], s["best_round_std"], 1),
               "last round idx": f"{s['last_round_mean']:g}"}
        if target is not None:
            row[f"rounds to {target:g}"] = f"{_pm(s['rounds_to_target_mean'], s['rounds_to_target_std'], 1)} " \
                                           f"({int(s['reached'])}/{int(s['runs'])} reached)"
            if time_metric and f"{time_metric}_to_target_mean" in s:
                row[f"{time_metric} to {target:g}"] = _pm(s[f"{time_metric}_to_target_mean"],
                                                          s[f"{time_metric}_to_target_std"], 1)
        row["up MB"] = _pm(s["up_bytes_total_mean"] / 1e6, s["up_bytes_total_std"] / 1e6, 3)
        row["down MB"] = _pm(s["down_bytes_total_mean"] / 1e6, s["down_bytes_total_std"] / 1e6, 3)
        rows.append(row)
    return results.markdown_table(pd.DataFrame(rows))


def plot_curves(curves: pd.DataFrame, path: Path, xlabel: str, ylabel: str, title: str, xscale: str = "linear") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for group, g in curves.groupby("group", sort=True):
        g = g.sort_values("round")
        n = int(g["runs"].max())
        line, = ax.plot(g["x"], g["mean"], marker="o", ms=3, label=f"{group} (n={n})")
        if n > 1:
            std = g["std"].fillna(0.0)
            ax.fill_between(g["x"], g["mean"] - std, g["mean"] + std, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale(xscale)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_report(paths, out_dir: str | Path, metrics: Optional[list[str]] = None, target: Optional[float] = None,
                 time_metric: Optional[str] = None, plots: bool = True, log: Callable = print) -> dict:
    """Write summary.md, summary.parquet (one row per setting and metric), runs.parquet and the PNG plots into
    ``out_dir``; returns {name: path}."""
    df, index = load_runs(paths)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    present = set(df.loc[df["scope"] == "client", "metric"].unique())
    if metrics:
        missing = [m for m in metrics if m not in present]
        if missing:
            raise KeyError(f"metric(s) {', '.join(missing)} not recorded; client metrics here: {', '.join(sorted(present))}")
    else:
        metrics = [m for m in ("test_acc", "test_acc_proto") if m in present]
    tm = find_time_metric(df, time_metric)
    files: dict = {}
    md = [f"# raysim report\n\n{len(index)} run(s) in {index['group'].nunique()} setting(s) (runs whose configs "
          f"differ only in the seed form one setting). Mean ± sample std over runs of the mean over clients.\n"]
    sums = []
    for metric in metrics:
        s = results.seed_summary(df, index, metric, target, tm)
        sums.append(s.assign(metric=metric))
        md.append(f"\n## {metric}\n\n" + summary_markdown(s, index, metric, target, tm))
    md.append("\n## runs\n\n" + results.markdown_table(index[["run_id", "group", "seed", "path"]]))
    if tm is None:
        md.append("\nNo simulated time in these runs (no total/server metric named "
                  f"{' / '.join(SIM_TIME_CANDIDATES)}): accuracy vs simulated time is not plotted.\n")
    if plots and metrics:
        metric = metrics[0]
        axes = [("round", "rounds", "acc_vs_round.png", "linear"),
                ("bytes", "bytes communicated (up + down, all clients)", "acc_vs_bytes.png", "linear")]
        if tm is not None:
            axes.append((tm, f"simulated time ({tm}, cumulative)", "acc_vs_time.png", "linear"))
        for axis, xlabel, name, scale in axes:
            curves = results.seed_curves(df, index, metric, axis)
            plot_curves(curves, out_dir / name, xlabel, f"mean client {metric}", f"{metric} vs {axis}", scale)
            files[name] = out_dir / name
            md.append(f"\n![{metric} vs {axis}]({name})\n")
    summary = pd.concat(sums, ignore_index=True) if sums else pd.DataFrame()
    files["summary.md"] = out_dir / "summary.md"
    files["summary.md"].write_text("".join(md))
    files["summary.parquet"] = out_dir / "summary.parquet"
    summary.to_parquet(files["summary.parquet"], index=False)
    files["runs.parquet"] = out_dir / "runs.parquet"
    index.to_parquet(files["runs.parquet"], index=False)
    return files
