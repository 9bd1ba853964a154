"""``raysim compare RUN...``: one's own runs of two or more settings over the same seeds, compared the way a paper
needs it -- per seed the paired difference of each setting from a baseline, and over the seeds its mean, 95 %
Student-t interval, the paired t-test's p and a verdict, held / tie / reversed (n too small below 3 pairs), on the
final round or the mean of the last k evaluated rounds. The numbers come from :func:`raysim.results.paired`, whose
verdicts are :mod:`raysim.verdicts`' -- the code of ``raysim reproduce``'s claims. Writes ``compare.md``,
``compare.parquet`` (one row per setting against the baseline) and ``compare_<metric>.png``.

Bad input (one line naming the argument, exit 2, nothing written): runs of different datasets, a metric a run lacks,
a metric whose model differs across the methods compared (unless ``--mixed-metrics``), a ``--label`` naming a
directory without runs, fewer than two settings, a ``--baseline`` that is not one of them."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from raysim.errors import ConfigError, printable


@dataclass(frozen=True)
class CompareOptions:
    """What ``raysim compare`` compares: the metric, the baseline setting (default the first), the rounds a run's
    value averages (``last``: 1 = the final evaluated round), whether lower is better, ``--label NAME=DIR`` texts,
    whether metrics of different kinds across methods are compared knowingly, and whether to plot."""
    metric: str = "test_acc"
    baseline: Optional[str] = None
    last: int = 1
    lower_is_better: bool = False
    labels: tuple = ()
    mixed_metrics: bool = False
    plot: bool = True


def add_parser(sub) -> None:
    cmp = sub.add_parser("compare", help="paired differences between settings run over the same seeds: 95 %% "
                                         "intervals and held / tie / reversed verdicts (table, Parquet, plot)")
    cmp.add_argument("runs", nargs="*", help="run directories, result files, or parent directories of runs")
    cmp.add_argument("--label", action="append", default=[], metavar="NAME=DIR",
                     help="the runs under DIR form the setting NAME (repeatable; DIR is also read)")
    cmp.add_argument("--metric", default="test_acc", help="client metric (mean over clients) or server metric "
                                                          "(e.g. global_test_acc); default test_acc")
    cmp.add_argument("--baseline", default=None, metavar="SETTING", help="the setting the others are compared with "
                                                                         "(default: the first)")
    cmp.add_argument("--last", type=int, default=1, metavar="K",
                     help="a run's value: the mean of its last K evaluated rounds (default 1: the final round)")
    cmp.add_argument("--lower-is-better", action="store_true", help="the metric is a loss: lower is better")
    cmp.add_argument("--mixed-metrics", action="store_true",
                     help="compare a metric that evaluates different models across the methods (e.g. FedAvg's "
                          "global test_acc beside FedProto's personalised one) knowingly")
    cmp.add_argument("--out", default="compare", help="output directory (default: ./compare)")
    cmp.add_argument("--no-plot", action="store_true")


def command(args) -> int:
    """``raysim compare``: the table printed, the files written; bad input raises ConfigError (exit 2)."""
    options = CompareOptions(args.metric, args.baseline, args.last, args.lower_is_better, tuple(args.label),
                             args.mixed_metrics, not args.no_plot)
    files = compare(args.runs, args.out, options, log=lambda m: print(f"raysim compare: {printable(m)}",
                                                                     file=sys.stderr))
    print(printable(files["compare.md"].read_text(), keep_newlines=True))
    print("wrote " + ", ".join(printable(p) for p in files.values()))
    return 0


def parse_labels(texts) -> list[tuple[str, Path]]:
    """``NAME=DIR`` -> (NAME, DIR); NAME may hold '=' (``lam=1=runs/a``: the first split whose DIR exists). A
    malformed text or a DIR that does not exist is one ConfigError (``--label``)."""
    out = []
    for text in texts:
        text = str(text)
        cuts = [i for i, ch in enumerate(text) if ch == "="]
        if not cuts or not text[:cuts[0]].strip() or not text[cuts[-1] + 1:].strip():
            raise ConfigError("--label", f"{text!r} is not NAME=DIR")
        found = next((i for i in cuts if text[:i].strip() and Path(text[i + 1:]).exists()), None)
        if found is None:
            raise ConfigError("--label", f"{text}: {text[cuts[-1] + 1:]} does not exist")
        out.append((text[:found].strip(), Path(text[found + 1:])))
    return out


def _under(path: str, root: Path) -> bool:
    p, r = Path(path).resolve(), root.resolve()
    return p == r or r in p.parents or (r.is_file() and p == r.parent)


def load(paths, options: CompareOptions):
    """(rows of every run, the run index with a ``setting`` per run, setting -> one of its run configs)."""
    from raysim.app.measures import run_configs
    from raysim.app.summary import load_runs, setting_labels

    labels = parse_labels(options.labels)
    every = list(paths) + [str(d) for _, d in labels]
    if not every:
        raise ConfigError("RUNS", "name the runs to compare (run directories or their parents), or --label NAME=DIR")
    try:
        from raysim.io.tables import result_files

        files = list(dict.fromkeys(f.resolve() for f in result_files(every)))  # a run named twice is read once
        df, index = load_runs(files)
    except FileNotFoundError as e:
        raise ConfigError("RUNS", str(e.args[0] if e.args else e)) from None
    setting = index["group"].map(setting_labels(index))
    for name, where in labels:
        hit = index["path"].map(lambda p: _under(p, where))
        if not hit.any():
            raise ConfigError("--label", f"{name}={where}: no finished run under {where}")
        setting[hit] = name
        index.loc[hit, "group"] = name
    index = index.assign(setting=setting)
    names = {g: s for g, s in zip(index["group"], index["setting"])}
    return df, index, run_configs(index, names)


def check(df, index, configs: dict, options: CompareOptions) -> list[str]:
    """Refuse what cannot be compared (one ConfigError naming the argument); the notes of what is compared
    knowingly."""
    from raysim.app.measures import check as check_kinds

    data = {s: str(((c or {}).get("data") or {}).get("dataset", "?")) for s, c in configs.items()}
    if len(set(data.values())) > 1:
        raise ConfigError("RUNS", "runs of different datasets (" + "; ".join(f"{s}: {d}" for s, d in data.items())
                          + "): a paired comparison needs one dataset")
    for rid, g in df.groupby("run_id"):
        if not (g["scope"].isin(["client", "server"]) & (g["metric"] == options.metric)).any():
            path = index.loc[index["run_id"] == rid, "path"].iloc[0]
            raise ConfigError("--metric", f"run {rid} ({path}) has no client or server metric {options.metric!r}; "
                                          f"its client metrics: "
                                          f"{', '.join(sorted(set(g.loc[g['scope'] == 'client', 'metric'])))}")
    order = list(dict.fromkeys(index["setting"]))
    if len(order) < 2:
        raise ConfigError("RUNS", f"one setting only ({order[0]}): compare needs runs of two or more settings over "
                                  f"the same seeds (runs whose configs differ only in the seed form one setting; "
                                  f"--label NAME=DIR names one)")
    if options.baseline is not None and options.baseline not in order:
        raise ConfigError("--baseline", f"{options.baseline!r} is not a setting here; settings: {', '.join(order)}")
    if options.last < 1:
        raise ConfigError("--last", f"must be >= 1 (1: the final round), got {options.last}")
    return check_kinds(configs, [options.metric], options.mixed_metrics)


def compare(paths, out: str | Path, options: CompareOptions = CompareOptions(), log: Callable = print) -> dict:
    """Compare the runs under ``paths`` (and ``options.labels``) and write compare.md, compare.parquet and the plot
    into ``out``; returns {name: path}. Everything is read and checked before anything is written."""
    from raysim.io import results
    from raysim.io.rundir import check_writable

    check_writable(out, "--out")
    df, index, configs = load(paths, options)
    notes = check(df, index, configs, options)
    table = results.paired(df, options.metric, index, baseline=options.baseline, last=options.last,
                           lower_is_better=options.lower_is_better)
    unpaired = results.unpaired_seeds(index, options.baseline)
    if unpaired:
        log("seeds that do not pair up (left out): " + " | ".join(unpaired))
    md = markdown(table, index, options, notes + (["seeds that do not pair up (left out): " + " | ".join(unpaired)]
                                                  if unpaired else []))
    fig = plot(table, options) if options.plot and len(table) else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"compare.md": out / "compare.md", "compare.parquet": out / "compare.parquet"}
    files["compare.md"].write_text(md)
    table.to_parquet(files["compare.parquet"], index=False)
    if fig is not None:
        name = f"compare_{options.metric}.png"
        files[name] = out / name
        fig.savefig(files[name], bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
    return files


def _rule(options: CompareOptions) -> str:
    value = "its final evaluated round" if options.last == 1 else f"the mean of its last {options.last} evaluated rounds"
    sign = "baseline − setting (lower is better)" if options.lower_is_better else "setting − baseline"
    return (f"Paired by seed: per seed d = {sign} of {options.metric} (a run's value: {value}; a client metric is the "
            f"mean over clients); over the seeds both ran, the mean ± half-width of its 95 % Student-t interval "
            f"(n − 1 degrees of freedom) [interval] and the paired t-test's two-sided p. Verdict: held — the setting "
            f"is better than the baseline (the interval lies above 0); tie — the interval contains 0; reversed — the "
            f"setting is worse (below 0); n too small — fewer than 3 paired seeds. The same code as raysim "
            f"reproduce's claims (raysim/verdicts.py).")


def markdown(table, index, options: CompareOptions, notes: list) -> str:
    """compare.md: the rule, the notes, one row per setting against the baseline, and the runs."""
    import pandas as pd

    from raysim import verdicts
    from raysim.io import results

    lines = [f"# raysim compare: {options.metric}\n", _rule(options) + "\n"]
    lines += [f"Note: {n}.\n" for n in notes]
    rows = [{"setting": r["setting"], "baseline": r["baseline"], "n": int(r["n"]), "seeds": r["seeds"],
             "setting mean": r["setting_mean"], "baseline mean": r["baseline_mean"],
             "paired difference, mean ± 95 % [interval]": verdicts.format_interval(r.to_dict(), digits=4),
             "p": r["p"], "verdict": r["verdict"]} for _, r in table.iterrows()]
    lines.append(results.markdown_table(pd.DataFrame(rows)))
    lines.append("\n## runs\n\n" + results.markdown_table(index[["setting", "seed", "run_id", "path"]]
                                                           .sort_values(["setting", "seed"])))
    return "\n".join(lines)


def plot(table, options: CompareOptions):
    """Each setting's paired differences from the baseline: the seeds' differences as points, the mean with its 95 %
    interval as a bar, 0 marked; the verdict in the setting's tick label (no legend over the data)."""
    import json

    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.6 * len(table)), dpi=120)
    for y, (_, r) in enumerate(table.iloc[::-1].iterrows()):
        diffs = list(json.loads(r["diffs"]).values())
        ax.plot(diffs, [y] * len(diffs), "o", color="0.55", ms=4, zorder=2)
        if pd.notna(r["half"]):
            ax.errorbar([r["mean"]], [y], xerr=[[r["half"]], [r["half"]]], fmt="s", color="C0", capsize=5, zorder=3)
        elif pd.notna(r["mean"]):
            ax.plot([r["mean"]], [y], "s", color="C0", zorder=3)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels([f"{r['setting']}\n({r['verdict']}, n={int(r['n'])})" for _, r in table.iloc[::-1].iterrows()],
                       fontsize=8)
    ax.set_ylim(-0.6, len(table) - 0.4)
    rounds = "final round" if options.last == 1 else f"mean of the last {options.last} rounds"
    sign = "baseline − setting" if options.lower_is_better else "setting − baseline"
    ax.set_xlabel(f"{options.metric}: {sign} ({rounds}); points: seeds, bar: 95 % interval", fontsize=8)
    ax.set_title(f"paired by seed against {table['baseline'].iloc[0]}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
