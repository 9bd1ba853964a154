"""``raysim report RUN_DIR...``: a Markdown summary over seeds and PNG plots of accuracy vs round, vs bytes
communicated and vs simulated time, from the runs' Parquet tables (numbers via :mod:`raysim.io.results`).

Settings are labelled by algorithm and the config keys that differ between the settings compared; rounds are counted
as rounds completed everywhere (table and plots); bands are ± the sample std over seeds."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from raysim.io import results

# a round's simulated duration (summed into the time axis): the environment layer writes ``sim_round_s`` (scope env);
# the other names are accepted for tables from elsewhere; --time-metric overrides
SIM_TIME_CANDIDATES = ("sim_round_s", "sim_round_time", "round_sim_time", "simulated_time", "sim_time")


def load_runs(paths, on_damaged=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(long table of all runs, run index). A run id seen twice (the same config run into two directories) gets a
    ``#k`` suffix, so runs are never silently merged. ``on_damaged(error)``: damaged runs found in a directory are
    skipped and passed to it (see :func:`results.run_index`)."""
    index = results.run_index(paths, on_damaged)
    # a run named twice (a parent and its run, or a --label DIR among the runs) is read once
    if not index.empty:
        index = index[~index["path"].map(lambda p: Path(p).resolve()).duplicated()].reset_index(drop=True)
    if index.empty:
        raise FileNotFoundError(f"no readable result table under {', '.join(map(str, paths))} (every run found is "
                                f"damaged)")
    from raysim.errors import DamagedFileError

    frames, seen, dropped = [], {}, []
    named = {Path(p).absolute() for p in ([paths] if isinstance(paths, (str, Path)) else paths)}
    for i, row in index.iterrows():
        f = Path(row["path"]) / results.RESULTS_FILE
        try:
            df = results.read_table(f)
        except DamagedFileError as e:  # damaged past its footer (page checksums): skipped like the others
            if on_damaged is None or f.absolute() in named or f.parent.absolute() in named:
                raise
            on_damaged(e)
            dropped.append(i)
            continue
        rid = row["run_id"]
        seen[rid] = seen.get(rid, 0) + 1
        if seen[rid] > 1:
            rid = f"{rid}#{seen[rid]}"
            index.loc[i, "run_id"] = rid
            df["run_id"] = rid
        frames.append(df)
    index = index.drop(index=dropped).reset_index(drop=True)
    if index.empty:
        raise FileNotFoundError(f"no readable result table under {', '.join(map(str, paths))} (every run found is "
                                f"damaged)")
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


def setting_labels(index: pd.DataFrame) -> dict:
    """group -> label: the run's own name (``--label`` / the config's ``label:``, in the index's ``label`` column)
    where it has one, else the algorithm and the config keys whose meaning differs between the groups compared
    (:mod:`raysim.app.labels`), e.g. ``fedproto (lam=0.5)``."""
    from raysim.app.labels import auto_labels

    cfgs, named = {}, {}
    for _, row in index.drop_duplicates("group").iterrows():
        cfgs[row["group"]] = dict(results.load_metadata(row["path"]).get("config") or {})
        given = row["label"] if "label" in index.columns else None
        if isinstance(given, str) and given:
            named[row["group"]] = given
    labels = {**auto_labels(cfgs), **named}
    counts = pd.Series(list(labels.values())).value_counts()
    for g in labels:  # settings that differ in nothing but the name keep the name apart
        if counts[labels[g]] > 1:
            labels[g] = f"{labels[g]} [{g}]"
    return labels


def apply_labels(index: pd.DataFrame, given: Optional[dict]) -> pd.DataFrame:
    """The index with a ``label`` column: ``given`` ({name: directory}, ``--label NAME=DIR``) names every run under
    the directory, else a run's config ``label:``. A labelled directory holding no run of this report, or runs of
    several settings, is a ConfigError naming ``--label``; runs of one setting under two names become two
    settings."""
    from raysim.errors import ConfigError

    index = index.copy()
    labels = []
    for _, row in index.iterrows():
        cfg_label = (results.load_metadata(row["path"]).get("config") or {}).get("label")
        labels.append(cfg_label if isinstance(cfg_label, str) and cfg_label else None)
    index["label"] = labels
    for name, directory in (given or {}).items():
        root = Path(directory).absolute()
        if not root.exists():
            raise ConfigError("--label", f"{name}={directory}: no such directory")
        hit = index["path"].map(lambda p: Path(p).absolute() == root or root in Path(p).absolute().parents)
        if not hit.any():
            raise ConfigError("--label", f"{name}={directory}: no run of this report is there (give it among the "
                                         f"report's runs too)")
        groups = sorted(index.loc[hit, "group"].unique())
        if len(groups) > 1:
            raise ConfigError("--label", f"{name}={directory}: it holds runs of {len(groups)} settings (configs that "
                                         f"differ in more than the seed); label each setting's directory")
        index.loc[hit, "label"] = name
    relabelled = index["label"].notna()
    index.loc[relabelled, "group"] = index.loc[relabelled, "group"] + "|" + index.loc[relabelled, "label"]
    return index


def check_metrics(df: pd.DataFrame, index: pd.DataFrame, metrics: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """The metrics to summarise and notes. Asked-for metrics must be in every run (else a MetricError naming the
    run); by default test_acc, and test_acc_proto where every run has it."""
    have = {rid: set(g.loc[g["scope"] == "client", "metric"]) for rid, g in df.groupby("run_id")}
    notes = []
    if not metrics:
        metrics = ["test_acc"]
        lacking = [r for r, m in have.items() if "test_acc_proto" not in m]
        if any("test_acc_proto" in m for m in have.values()):
            if lacking:
                notes.append(f"test_acc_proto is not summarised: {len(lacking)} run(s) lack it ({', '.join(lacking)})")
            else:
                metrics.append("test_acc_proto")
    for m in metrics:
        for rid, got in have.items():
            if m not in got:
                path = index.loc[index["run_id"] == rid, "path"]
                where = f" ({path.iloc[0]})" if len(path) else ""
                raise results.MetricError(f"run {rid}{where} has no client metric {m!r}; its client metrics: "
                                          f"{', '.join(sorted(got)) or 'none'}")
    return metrics, notes


def summary_markdown(summary: pd.DataFrame, index: pd.DataFrame, metric: str, target: Optional[float],
                     time_metric: Optional[str], labels: Optional[dict] = None) -> str:
    labels = labels or {}
    rows = []
    for _, s in summary.iterrows():
        seeds = index[index["group"] == s["group"]]["seed"].tolist()
        row = {"setting": labels.get(s["group"], s["group"]), "runs": int(s["runs"]),
               "seeds": ",".join(str(x) for x in seeds),
               f"final {metric}": _pm(s["final_mean"], s["final_std"]),
               f"best {metric}": _pm(s["best_mean"], s["best_std"]),
               "rounds to best": _pm(s["rounds_to_best_mean"], s["rounds_to_best_std"], 1),
               "rounds run": f"{s['rounds_run_mean']:g}"}
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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class PlotAxes:
    """A plot's axis labels, title, x scale (``linear``, ``log``, ``symlog``) and whether x ticks are integers."""
    xlabel: str
    ylabel: str
    title: str
    xscale: str = "linear"
    integer_x: bool = False


def plot_curves(curves: pd.DataFrame, path: Path, axes: PlotAxes, labels: Optional[dict] = None) -> None:
    """One line per setting (mean over seeds of the mean over clients) with a ± std-over-seeds band."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    labels = labels or {}
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for group, g in curves.groupby("group", sort=True):
        g = g.sort_values("round")
        n = int(g["runs"].max())
        single = len(g) == 1  # one evaluated point: a visible marker, not an invisible line
        line, = ax.plot(g["x"], g["mean"], marker="o", ms=7 if single else 3, ls="none" if single else "-",
                        label=f"{labels.get(group, group)} (n={n})")
        if n > 1:
            std = g["std"].fillna(0.0)
            if single:
                ax.errorbar(g["x"], g["mean"], yerr=std, color=line.get_color(), capsize=4, ls="none")
            else:
                ax.fill_between(g["x"], g["mean"] - std, g["mean"] + std, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel(axes.xlabel)
    ax.set_ylabel(axes.ylabel)
    ax.set_xscale(axes.xscale)
    if axes.xscale == "log":
        log_ticks(ax.xaxis)
    if axes.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(axes.title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _legend(fig, ax, "mean over seeds;\nband: ± std over seeds")
    fig.savefig(path, bbox_inches="tight")  # the whole legend, also when it sits below the axes
    plt.close(fig)


def log_ticks(axis) -> None:
    """A log axis labelled at 1, 2 and 5 of each decade in short engineering form (200k, 1M): matplotlib's own
    labels of a 1-2 decade range include minor ticks in scientific notation that run into each other."""
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(EngFormatter(sep=""))
    axis.set_minor_formatter(NullFormatter())


def _legend(fig, ax, title: str) -> None:
    """Always outside the axes, never over them or their labels: to the right of the axes' whole box (tick labels
    and axis label included) when the labels are short, below it, each label wrapped, when they are long (settings
    that differ in several keys). ``savefig(bbox_inches="tight")`` keeps it in the image."""
    import textwrap

    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    fig.canvas.draw()  # the axes' full extent (tick labels, axis labels) in axes coordinates
    box = ax.get_tightbbox(fig.canvas.get_renderer()).transformed(ax.transAxes.inverted())
    if max(len(t) for t in labels) <= 45:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(box.x1 + 0.02, 1.0), title=title,
                  title_fontsize=7, frameon=False, borderaxespad=0.0)
        return
    wrapped = ["\n".join(textwrap.wrap(t, 90, subsequent_indent="  ")) for t in labels]
    ax.legend(handles, wrapped, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, box.y0 - 0.03), title=title,
              title_fontsize=7, frameon=False, borderaxespad=0.0)


def plot_client_curves(df: pd.DataFrame, index: pd.DataFrame, metric: str, path: Path, labels: dict) -> None:
    """One panel per setting: every client's ``metric`` (mean over seeds) against rounds completed."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    d = results.client_metric(df, metric).merge(index[["run_id", "group"]], on="run_id")
    groups = sorted(d["group"].unique())
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), dpi=110, squeeze=False, sharey=True)
    for ax, group in zip(axes[0], groups):
        g = d[d["group"] == group].groupby(["client_id", "round"])["value"].mean().reset_index()
        for cid, c in g.groupby("client_id"):
            ax.plot(c["round"] + 1, c["value"], lw=0.8, alpha=0.6, marker="." if len(c) == 1 else None)
        m = g.groupby("round")["value"].mean()
        ax.plot(m.index + 1, m.values, color="black", lw=2, marker="o" if len(m) == 1 else None, label="mean")
        ax.set_title(labels.get(group, group), fontsize=9)
        ax.set_xlabel("rounds completed")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"client {metric} (mean over seeds)")
    fig.suptitle("thin lines: one client each; black: the mean over clients", fontsize=8)  # no legend over the data
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def tuning_seeds(directory) -> set[int]:
    """The seeds a ``raysim tune`` study ran its trials on (its output directory's ``trials.parquet``)."""
    path = Path(directory) / "trials.parquet"
    if not path.exists():
        raise FileNotFoundError(f"--tuned-on {directory}: no trials.parquet (give a raysim tune output directory)")
    try:
        t = pd.read_parquet(path)
    except Exception as e:
        from raysim.errors import DamagedFileError, read_problem

        raise DamagedFileError(path, read_problem(e), "run the study again (raysim tune exports it) or leave out "
                                                      "--tuned-on", "--tuned-on") from None
    return {int(x) for x in t["seed"].dropna()} if "seed" in t else set()


@dataclass(frozen=True)
class ReportOptions:
    """What ``raysim report`` shows: the metrics (default: the runs' accuracy), the target for rounds-to-target,
    the simulated-time metric (default: found in the runs), whether to draw plots and per-client plots, the
    tuning studies whose seeds the report warns about (``--tuned-on``), and whether a metric that evaluates different
    models across the methods is compared knowingly (``--mixed-metrics``; else refused, one line)."""
    metrics: Optional[list] = None
    target: Optional[float] = None
    time_metric: Optional[str] = None
    plots: bool = True
    per_client: bool = False
    tuned_on: Optional[list] = None
    mixed_metrics: bool = False  # compare a metric that evaluates different models across methods (issue 52)
    labels: Optional[dict] = None  # {name: directory}: the setting of the runs under each directory (--label)


@dataclass(frozen=True)
class _Runs:
    """The runs a report reads: their tables, index (one row per run, its setting), setting labels, time metric."""
    df: pd.DataFrame
    index: pd.DataFrame
    labels: dict
    time_metric: Optional[str]


def build_report(paths, out_dir: str | Path, options: ReportOptions = ReportOptions(),
                 log: Callable = print) -> dict:
    """Write summary.md, summary.parquet (one row per setting and metric), runs.parquet and the PNG plots into
    ``out_dir``; returns {name: path}. A metric that a run lacks is an error naming the run."""
    df, index, metrics, notes = _read_runs(paths, options.metrics)
    index = apply_labels(index, options.labels)
    labels = setting_labels(index)
    from raysim.app.measures import check, run_configs

    # one metric name, one kind of model across the methods (FedAvg's test_acc is global, FedProto's personal)
    notes = notes + check(run_configs(index, labels), metrics, options.mixed_metrics)
    index = index.assign(setting=index["group"].map(labels))
    runs = _Runs(df, index, labels, find_time_metric(df, options.time_metric))
    tm, target = runs.time_metric, options.target
    tuned_seeds = set()
    for d in options.tuned_on or []:  # read before anything is written: a bad --tuned-on leaves no report directory
        tuned_seeds |= tuning_seeds(d)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict = {}
    md = [f"# raysim report\n\n{len(index)} run(s) in {index['group'].nunique()} setting(s) (runs whose configs "
          f"differ only in the seed form one setting; a setting is named by its label (--label, the config's "
          f"label:) or by its algorithm and the config keys whose meaning differs between the settings). Values: "
          f"mean ± sample std over seeds of the mean over clients. Rounds are counted as rounds completed (the "
          f"result table's 0-based round index + 1) in this summary, its columns and the plots' x axis. Plot bands: "
          f"± std over seeds.\n"]
    md += [f"\nNote: {n}.\n" for n in notes]
    if options.tuned_on:
        md += _tuned_on_warning(index, tuned_seeds, options.tuned_on, log)
    sums = []
    for metric in metrics:
        s = results.seed_summary(df, metric, index, target, tm)
        sums.append(s.assign(metric=metric, setting=s["group"].map(labels)))
        md.append(f"\n## {metric}\n\n" + summary_markdown(s, index, metric, target, tm, labels))
    md.append("\n## runs\n\n" + results.markdown_table(index[["run_id", "setting", "seed", "path"]]))
    if tm is None:
        md.append("\nNo simulated time in these runs (no total/server metric named "
                  f"{' / '.join(SIM_TIME_CANDIDATES)}): accuracy vs simulated time is not plotted.\n")
    if options.plots:
        for metric in metrics:
            md += _metric_plots(runs, metric, metric, out_dir, files)
            if options.per_client:
                name = f"{metric}_per_client.png"
                plot_client_curves(df, index, metric, out_dir / name, labels)
                files[name] = out_dir / name
                md.append(f"\n![{metric} per client]({name})\n")
    summary = pd.concat(sums, ignore_index=True) if sums else pd.DataFrame()
    files["summary.md"] = out_dir / "summary.md"
    files["summary.md"].write_text("".join(md))
    files["summary.parquet"] = out_dir / "summary.parquet"
    summary.to_parquet(files["summary.parquet"], index=False)
    files["runs.parquet"] = out_dir / "runs.parquet"
    index.to_parquet(files["runs.parquet"], index=False)
    return files


def _read_runs(paths, metrics: Optional[list]):
    """(result rows, run index, the metrics to report, notes): damaged runs are skipped (said on stderr and in the
    notes), the metrics checked against every run."""
    damaged = []

    def skip(e) -> None:
        damaged.append(e)
        import sys

        from raysim.errors import printable

        print(f"raysim report: skipped a damaged run: {printable(e)}", file=sys.stderr)

    df, index = load_runs(paths, skip)
    metrics, notes = check_metrics(df, index, metrics)
    return df, index, metrics, list(notes) + [f"skipped a damaged run: {e}" for e in damaged]


def _tuned_on_warning(index: pd.DataFrame, tuned_seeds: set, tuned_on: list, log: Callable) -> list[str]:
    """The warning (logged, and for summary.md) about runs on seeds the hyperparameters were tuned on."""
    hit = index[index["seed"].isin(sorted(tuned_seeds))]
    if not len(hit):
        return []
    msg = (f"run(s) {', '.join(hit['run_id'].astype(str))} use seed(s) "
           f"{', '.join(str(int(x)) for x in sorted(set(hit['seed'])))} that the hyperparameters were tuned "
           f"on ({', '.join(str(d) for d in tuned_on)}): their results are biased; compare on other seeds")
    log(f"WARNING: {msg}")
    return [f"\n**Warning**: {msg}.\n"]


def _metric_plots(runs: _Runs, metric: str, stem: str, out_dir: Path, files: dict) -> list[str]:
    """``metric`` against rounds, bytes and (when the runs have it) simulated time, as ``{metric}_vs_round.png``,
    ``{metric}_vs_bytes.png``, ``{metric}_vs_time.png`` in ``out_dir`` (recorded in ``files``; every plot of a
    report is named ``<metric>_<what>.png``, per-client panels ``<metric>_per_client.png``); returns summary.md's
    image lines."""
    axes = [("round", "rounds completed", f"{stem}_vs_round.png", "linear"),
            ("bytes", "bytes communicated (up + down, all clients; log scale)", f"{stem}_vs_bytes.png", "log")]
    if runs.time_metric is not None:
        tm = runs.time_metric
        axes.append((tm, f"simulated time ({tm}, cumulative)", f"{stem}_vs_time.png", "linear"))
    md = []
    for axis, xlabel, name, scale in axes:
        curves = results.seed_curves(runs.df, metric, runs.index, axis)
        if scale == "log" and not (curves["x"] > 0).all():
            scale = "symlog"
        plot_curves(curves, out_dir / name, PlotAxes(xlabel, f"mean client {metric}", f"{metric} vs {axis} (band: ± "
                                                     f"std over seeds)", scale, integer_x=axis == "round"),
                    runs.labels)
        files[name] = out_dir / name
        md.append(f"\n![{metric} vs {axis}]({name})\n")
    return md
