"""The ``raysim`` command: ``run`` (``--seeds`` for several, ``--dry-run``), ``runs``, ``list``, ``tune`` (Optuna),
``report`` and ``reproduce`` (a seed paper's experiment beside the seed's numbers).

Exit codes: 0 ok, 1 the simulation failed (or a finished run could not be moved into place: it is kept, and the
line says where), 2 a bad config or bad data (one message naming the field), 130 Ctrl-C, 143 SIGTERM (handled as
Ctrl-C: checkpoints kept, resumable, one line). Everything printed that comes from a name, a path or a file escapes
control characters (:func:`raysim.errors.printable`)."""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from raysim.errors import ConfigError, DataError, printable


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysim", description="Simulation engine for heterogeneous federated learning")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="YAML config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value by dotted key, e.g. --set algorithm.params.lam=0.5 (repeatable)")
    run.add_argument("--out", default=None, help="run directory (default: output.dir/<run id>)")
    run.add_argument("--backend", choices=["sequential", "ray"], default=None, help="shortcut for --set backend.name=...")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue a run that stopped (crash, kill, Ctrl-C) from the checkpoints kept in RUN_DIR "
                          "(<run dir>.incomplete); it finishes into <run dir> (or --out)")
    run.add_argument("--dry-run", action="store_true",
                     help="validate the config and data, print the resolved config and the data split; train nothing")
    run.add_argument("--seeds", default=None, metavar="S1,S2,...",
                     help="run once per seed (e.g. 1,2,3 or 1-5); --out is then a parent directory of seed<N>/ runs")
    _add_tune_report(sub)
    _add_reproduce(sub)
    from raysim.app import compare  # issue 52: paired differences of one's own runs

    compare.add_parser(sub)
    sub.add_parser("list", help="list algorithms (hyperparameters: default, meaning), datasets, partitioners, models")
    runs = sub.add_parser("runs", help="list past runs under a directory (finished, unfinished, running)")
    runs.add_argument("dir", nargs="?", default="runs", help="directory holding run directories (default: ./runs)")
    return p


def _add_tune_report(sub) -> None:
    tune = sub.add_parser("tune", help="an Optuna study over config keys (persistent, resumable, prunable)")
    tune.add_argument("config", nargs="?", help="YAML config file (the base of every trial)")
    tune.add_argument("--space", help="search-space YAML (params, objective, pruner, sampler)")
    tune.add_argument("--trials", type=int, help="finished trials the study should hold")
    tune.add_argument("--show", default=None, metavar="DIR|STORAGE",
                      help="look at a study instead of running one: best trial, trials sorted by value, parameter "
                           "importances (a tune output directory or a --storage URL; --study-name when it holds "
                           "several)")
    tune.add_argument("--storage", default=None,
                      help="sqlite:///study.db or journal:study.log (default: journal file in the output directory)")
    tune.add_argument("--study-name", default=None, help="default: <config name>-tune")
    tune.add_argument("--parallel", type=int, default=1, help="trials at a time, as Ray tasks (default 1, in-process)")
    tune.add_argument("--out", default=None, help="output directory (default: output.dir/tune-<study name>)")
    tune.add_argument("--first", action="append", default=[], metavar="KEY=VALUE",
                      help="a value the first trial of a new study runs (e.g. the default, as a baseline; repeatable)")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a base config value (repeatable)")
    rep = sub.add_parser("report", help="mean ± std over seeds, rounds-to-target, communication, plots")
    rep.add_argument("runs", nargs="*", help="run directories, result files, or parent directories of runs (or "
                                             "--label NAME=DIR alone)")
    rep.add_argument("--out", default="report", help="output directory (default: ./report)")
    rep.add_argument("--metric", action="append", default=None,
                     help="client metric(s) to summarise: repeat it or separate by commas (default: test_acc and "
                          "test_acc_proto where every run has them)")
    rep.add_argument("--per-client", action="store_true", help="also plot every client's curve (one panel per setting)")
    rep.add_argument("--target", type=float, default=None, help="target accuracy for rounds-to-target")
    rep.add_argument("--time-metric", default=None, help="total/server metric holding a round's simulated time")
    rep.add_argument("--no-plots", action="store_true")
    rep.add_argument("--mixed-metrics", action="store_true", help="compare a metric that evaluates different models "
                                                                 "across the methods (raysim list: 'measures') knowingly")
    rep.add_argument("--label", action="append", default=[], metavar="NAME=DIR",
                     help="name the setting of the runs under DIR (repeatable; DIR is also read; default: the "
                          "config's label:, else the algorithm and the keys that differ)")
    rep.add_argument("--tuned-on", action="append", default=None, metavar="DIR",
                     help="a raysim tune output directory (repeatable): warn when a compared run uses a seed its "
                          "trials ran on")


def _add_reproduce(sub) -> None:
    rp = sub.add_parser("reproduce", help="a seed paper's experiment: every method over several seeds, and a table "
                                          "of our numbers beside the seed's (configs/<seed>/experiments.yaml)")
    rp.add_argument("experiments", nargs="*", metavar="EXPERIMENT", help="experiment name(s); see --list")
    rp.add_argument("--list", action="store_true", help="list the experiments (source, runs x seeds, scale) with "
                                                        "an estimated time from stored wall times (--sort cost)")
    rp.add_argument("--seeds", default=None, metavar="S1,S2,...", help="seeds (default: the experiment's, >= 3)")
    rp.add_argument("--out", default="runs/reproduce", help="parent of <experiment>/<run>/seed<N>/ (default: "
                                                            "runs/reproduce); finished runs there are reused")
    rp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value in every run (repeatable; changes the runs' identity)")
    rp.add_argument("--backend", choices=["sequential", "ray"], default=None, help="shortcut for --set backend.name=...")
    rp.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="runs side by side, each in its own process (sequential backend; same numbers); default 1. "
                         "Several raysim reproduce processes on one --out share the work: a run one of them is "
                         "running is left to it")
    rp.add_argument("--report-only", action="store_true", help="write the table from the finished runs; run nothing")
    rp.add_argument("--reuse-any", action="store_true", help="also reuse finished runs made by another code version "
                                                             "(the table names every code version)")
    rp.add_argument("--no-report", action="store_true", help="no raysim report summary/plots beside the table")
    rp.add_argument("--configs", default=None, metavar="DIR", help="configs root (default: the checkout's configs/)")
    rp.add_argument("--sort", choices=["name", "cost"], default="name",
                    help="--list order: by name, or by estimated time (cheapest first)")
    rp.add_argument("--smoke", action="store_true",
                    help="a smoke test: one seed, 2 rounds, into <--out>-smoke; the table says 'not a verdict'")


def _cmd_reproduce(args) -> int:
    from raysim.app import seed_experiments as rp
    from raysim.app.reproduction_table import write_table
    from raysim.app.sweep import parse_seeds

    root = args.configs or rp.CONFIGS_ROOT
    exps = rp.load_experiments(root)
    numbers = rp.load_numbers(root)
    if args.list or not args.experiments:
        if not args.list:
            raise ConfigError("experiment", "name one or more experiments (raysim reproduce --list shows them)")
        from raysim.app.reproduction_cost import list_lines

        results_root = Path(root).resolve().parent / "benchmarks" / "results"
        print("\n".join(list_lines(exps, args.out, results_root, args.sort)))
        return 0
    for name in args.experiments:
        if name not in exps:
            raise ConfigError("experiment", f"{name!r} is not allowed; choose one of: {', '.join(sorted(exps))}")
    overrides = list(args.overrides) + ([f"backend.name={args.backend}"] if args.backend else [])
    seeds = parse_seeds(args.seeds) if args.seeds else None
    if args.smoke:  # its own directory: a smoke run never stands in for (or clashes with) a real one
        from raysim.app.reproduction_cost import SMOKE_ROUNDS

        overrides.append(f"rounds={SMOKE_ROUNDS}")
        seeds = (seeds or [exps[args.experiments[0]].seeds[0]])[:1]
        args.out = args.out.rstrip("/") + "-smoke"
    plans = {}
    for name in args.experiments:  # everything is checked before the first run starts
        e = exps[name]
        rp.source_entry(e, numbers)
        plans[name] = rp.plan(e, seeds or e.seeds, args.out, overrides, check_data=not args.report_only,
                              reuse_any=args.reuse_any)
        if not args.report_only:
            rp.check_jobs(plans[name], args.jobs)
    for name in args.experiments:
        e = exps[name]
        if not args.report_only:
            rp.execute(plans[name], jobs=args.jobs)
        e = rp.replace(e, cli_overrides=tuple(overrides))  # recorded in the table's header, scale line and JSON
        path = write_table(e, plans[name], args.out, numbers, report=not args.no_report)
        if args.smoke:
            from raysim.app.reproduction_cost import label_smoke

            label_smoke(path)
        print(path.read_text())
        print(f"table: {path}")
    return 0


def _cmd_tune(args) -> int:
    # the CLI is the application layer: it may import tuning (tuning imports raysim's library, never the reverse);
    # imported here, when a study is asked for, because Optuna takes a second to import
    from raysim.config import parse_override
    from tuning import study
    from tuning.space import load_space

    if args.show is not None:
        from tuning.show import show

        print(printable(show(args.show, args.study_name), keep_newlines=True))
        return 0
    for name, value in (("config", args.config), ("--space", args.space), ("--trials", args.trials)):
        if value is None:
            raise ConfigError(name, "is required to run a study (raysim tune CONFIG --space SPACE --trials N; or "
                                    "--show DIR to look at one)")
    space = load_space(args.space)

    first = dict(parse_override(text) for text in args.first)
    res = study.tune(args.config, space, args.trials, storage=args.storage, study_name=args.study_name,
                     out_dir=args.out, parallel=args.parallel, overrides=args.overrides, first_params=first or None)
    t = res.trials
    states = t["state"].value_counts().to_dict() if len(t) else {}
    print(f"study {res.study_name}: {len(t)} trial(s) {states}; ran {res.ran} in {res.wall_s:.1f} s")
    if res.best_value is not None:
        print(f"best value {res.best_value:.4f} with {res.best_params}; config: {res.files['best']}")
    print(f"trials table: {res.files['trials']}")
    for warning in res.warnings:
        _say(f"WARNING: {warning}")
    print(f"look at it: raysim tune {show_args(args.storage, res)}")
    return 0


def show_args(storage, res) -> str:
    """The --show arguments that find this study again: its output directory holds the study only when no
    --storage was given (study.journal); otherwise the storage, with the study's name (a database may hold several)."""
    if storage is None:
        return f"--show {printable(res.out_dir)}"
    return f"--show {shlex.quote(printable(storage))} --study-name {shlex.quote(printable(res.study_name))}"


def _cmd_report(args) -> int:
    from raysim.app.summary import ReportOptions, build_report
    from raysim.io.rundir import check_writable

    from raysim.app.compare import parse_labels

    check_writable(args.out, "--out")  # a report directory that cannot be created fails before anything is read
    # as in compare: NAME may hold '=' ("lam=1=runs/a"), and a labelled DIR is read too (a run named twice, once)
    given = {name: str(directory) for name, directory in parse_labels(args.label)}
    paths = list(args.runs) + list(given.values())
    if not paths:
        raise ConfigError("RUNS", "name the runs to report (run directories or their parents), or --label NAME=DIR")
    try:
        metrics = [m.strip() for text in args.metric or [] for m in text.split(",") if m.strip()] or None
        files = build_report(paths, args.out, ReportOptions(metrics, args.target, args.time_metric,
                                                                plots=not args.no_plots, per_client=args.per_client,
                                                                tuned_on=args.tuned_on, labels=given or None,
                                                                mixed_metrics=args.mixed_metrics))
    except (KeyError, FileNotFoundError) as e:
        print(f"raysim report: {printable(e.args[0] if e.args else e)}", file=sys.stderr)
        return 2
    print(printable(files["summary.md"].read_text(), keep_newlines=True))
    print("wrote " + ", ".join(printable(p) for p in files.values()))
    return 0


# meanings of hyperparameters whose definition carries no comment (the others come from the Params source)
PARAM_HELP = {
    "lam": "weight of the distillation / regularisation term",
    "temperature": "softmax temperature of the shared logits",
    "mu": "weight of the proximal term (mu/2)||w - w_global||^2",
    "num_clusters": "number of cluster centres K",
    "fail_clients": "client ids that fail on purpose (tests)",
    "fail_round": "first round in which they fail",
}


def param_docs(params_cls) -> dict[str, str]:
    """field name -> the comment on its definition line (searched along the class's bases), else PARAM_HELP."""
    import inspect
    import re
    import textwrap

    docs: dict[str, str] = {}
    for klass in params_cls.__mro__:
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for m in re.finditer(r"^    (\w+)\s*:[^\n#]*#\s*(.+)$", src, re.M):
            docs.setdefault(m.group(1), m.group(2).strip())
    return docs


def _list_measures(name: str) -> None:
    """Which model each of a method's metrics evaluates (issue 52), at its default parameters."""
    from raysim.app.measures import describe

    line = describe(name)
    if line:
        print(f"    measures: {line}")


def _cmd_list() -> int:
    import dataclasses

    from raysim.data.datasets import LOADERS
    from raysim.data.partition import PARTITIONERS, partition_params
    from raysim.models import ARCHS, arch_params
    from raysim.config.registry import ALGORITHMS, algorithm_class

    print("algorithms (hyperparameter = default: meaning; set with --set algorithm.params.NAME=VALUE; 'measures': "
          "which model a metric evaluates, at the defaults; val_* is test_*'s model on the validation split):")
    for name in sorted(ALGORITHMS):
        cls = algorithm_class(name)
        fields = dataclasses.fields(cls.Params)
        print(f"  {name}" + ("" if fields else "  (no hyperparameters)"))
        docs = param_docs(cls.Params)
        for f in fields:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            print(f"      {f.name} = {default!r}: {docs.get(f.name) or PARAM_HELP.get(f.name, '')}".rstrip(": "))
        _list_measures(name)
    print("datasets:")
    for name in LOADERS:
        print(f"  {name}")
    print("  npz, imagefolder, leaf (formats: data.root and data.dataset_params), or package.module:loader (marked "
          "with @raysim.dataset_loader, or registered)")
    print("partitioners:")
    for name in PARTITIONERS:
        print(f"  {name:<12} {', '.join(partition_params(name))}")
    print(f"  {'files':<12} root (a PFLlib/HtFLlib split: config.json, train/<i>.npz, test/<i>.npz)")
    print("model architectures:")
    for name in ARCHS:
        print(f"  {name:<12} {', '.join(arch_params(name))}")
    print("  or package.module:factory (factory(input_shape, num_classes, **model.params) -> nn.Module, marked with "
          "@raysim.model_factory, or an nn.Module class), e.g. torchvision.models:resnet18")
    return 0


def _cmd_run(args) -> int:
    from raysim.config import dryrun
    from raysim.config import load_config
    from raysim.engine.loop import run_experiment
    from raysim.io import rundir

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend.name={args.backend}")
    if args.out:  # resolved and checked before anything loads (symbolic links, '..', '/', files, mount points)
        if args.seeds:
            rundir.check_writable(args.out, "--out")  # the parent of seed<N>/
        else:
            rundir.check_run_dir(args.out, "--out")
    if args.dry_run:
        notes: list = []  # the config's notices (a switched method's parameters), on stderr and in the dry run

        def notify(message: str) -> None:
            notes.append(message)
            _say(f"note: {message}")

        with dryrun.active():  # a dry run writes nothing, whoever's code runs (the user's modules load here)
            cfg = load_config(args.config, overrides, notify=notify)
        return _cmd_dry_run(cfg, args, notes)
    cfg = load_config(args.config, overrides)
    if args.seeds:
        return _cmd_run_seeds(cfg, args)
    result = run_experiment(cfg, out_dir=args.out, progress=False if args.no_progress else None, resume=args.resume)
    mean, std = result.final("test_acc")
    print(f"run {printable(result.run_id)}: final mean local test accuracy {mean:.4f} ± {std:.4f} (sample std over "
          f"{cfg.data.num_clients} clients)")
    if (result.table["metric"] == "test_acc_proto").any():
        pm, ps = result.final("test_acc_proto")
        print(f"  with prototypes: {pm:.4f} ± {ps:.4f}")
    comm = result.table[(result.table["scope"] == "total") & (result.table["metric"] == "up_floats")]["value"].mean()
    print(f"  uploaded floats per round (all clients): {comm:,.0f}")
    sim = result.table[(result.table["scope"] == "env") & (result.table["metric"] == "sim_time")]["value"]
    if len(sim):
        print(f"  simulated time: {sim.iloc[-1]:,.1f} s (environment: {printable(cfg.env.get('preset') or 'custom')})")
    print(f"results: {printable(result.out_dir / 'results.parquet')}")
    _say_failures(result.metadata.get("client_failures"))
    return 0


def _say_failures(summary) -> None:
    """A run that skipped failed clients says so (one notice; the list is in run.json's failures)."""
    if summary and summary.get("count"):
        first = summary["first"]
        _say(f"note: {summary['count']} client step(s) failed and were skipped (on_client_failure: skip) in "
             f"{summary['rounds']} round(s), clients {', '.join(map(str, summary['clients'][:10]))}"
             f"{' ...' if len(summary['clients']) > 10 else ''}; first: round {first['round']}, client "
             f"{first['client_id']}: {str(first['error']).splitlines()[0][:200]} (all of them: the run's failures "
             f"metadata)")


DRY_RUN_CLIENTS = 50  # a dry run lists this many clients at most (issue 50: 1M clients printed 1M lines)


def _cmd_dry_run(cfg, args, notes=()) -> int:
    import numpy as np
    import yaml

    from raysim.config import dryrun
    from raysim.config import to_dict
    from raysim.io.rundir import check_run_dir
    from raysim.engine.prepare import prepare

    if args.out or not args.resume:  # before any data loads
        check_run_dir(args.out or f"{cfg.output.dir}/{cfg.run_id()}", "--out" if args.out else "output.dir")
    with dryrun.active():  # the user's loaders and factories run, but nothing they try to write is written
        prep = prepare(cfg)  # everything a run checks before it starts: config, data, models, resources

    import builtins

    def print(text=""):  # noqa: A001 - every line of the dry run, control characters escaped
        builtins.print(printable(text, keep_newlines=True))

    print(f"# resolved config (run id {cfg.run_id()})")
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    for note in notes:  # e.g. a switched method's kept parameters beside its defaults
        print(f"# note: {note}")
    s = prep.fed_data.summary()
    tr, te = np.array(s["train_sizes"]), np.array(s["test_sizes"])
    ncls = np.array([len(c) for c in s["classes"]])
    from raysim.models import arch_key

    fd = prep.fed_data
    shape = "x".join(map(str, fd.input_shape))
    print(f"# data split: {s['num_clients']} clients of {cfg.data.dataset} ({cfg.data.partition}), "
          f"{fd.num_classes} classes, images {shape}")
    for label, v in (("train samples", tr), ("test samples", te), ("classes", ncls)):
        print(f"  {label:<14} per client: min {v.min()}, median {np.median(v):g}, max {v.max()}, total {v.sum()}")
    n = len(tr)
    shown = range(n) if n <= DRY_RUN_CLIENTS else [*range(DRY_RUN_CLIENTS - 5), *range(n - 5, n)]
    for cid in shown:  # a large population is summarised: the first clients and the last five
        if n > DRY_RUN_CLIENTS and cid == n - 5:
            print(f"  ... {n - DRY_RUN_CLIENTS:,} more clients (the summary above covers all {n:,})")
        a, b, c = tr[cid], te[cid], s["classes"][cid]
        spec = prep.task.archs[cid]
        m = prep.models.get(arch_key(spec), {})
        emb = m.get("embed_dim")
        print(f"  client {cid:>3}: x_train {a}x{shape}  x_test {b}x{shape}  classes {list(c)}  arch {spec.arch}  "
              f"params {m.get('params', 0):,}  embedding {emb if emb is not None else 'none (no body/head split)'}")
    for note in s["notes"] or []:
        print(f"  note: {note}")
    print("dry run: config and data are valid; nothing was trained or written")
    return 0


def _cmd_runs(args) -> int:
    from raysim.io.runs import list_runs

    rows = list_runs(args.dir)
    if not rows:
        print(f"no runs under {printable(args.dir)}")
        return 0
    cols = ["name", "algorithm", "dataset", "rounds", "final acc", "status", "path"]
    rows = [{c: printable(r[c]) for c in cols} for r in rows]  # names and paths from disk: control characters escaped
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols).rstrip())
    return 0


def _cmd_run_seeds(cfg, args) -> int:
    import numpy as np

    from raysim.app.sweep import parse_seeds, run_seeds

    runs = run_seeds(cfg, parse_seeds(args.seeds), out_dir=args.out, progress=False if args.no_progress else None)
    finals = [r.final("test_acc")[0] for r in runs]
    sd = float(np.std(finals, ddof=1)) if len(finals) > 1 else float("nan")
    print(f"{len(runs)} seeds: final mean local test accuracy {np.mean(finals):.4f} ± {sd:.4f} (std over seeds)")
    print("summarise with: raysim report " + " ".join(printable(r.out_dir) for r in runs))
    return 0


def _with_command(text: str, args) -> str:
    """``text`` with ``raysim run CONFIG`` spelled out for this command line."""
    if getattr(args, "command", None) != "run":
        return text
    import shlex

    words = [args.config] + [w for o in args.overrides for w in ("--set", o)] + \
        (["--backend", args.backend] if args.backend else [])
    return text.replace("raysim run CONFIG", "raysim run " + " ".join(shlex.quote(str(w)) for w in words))


def _notes(e: BaseException, args) -> list[str]:
    """The exception's notes, with the resume command spelled out for this command line."""
    return [_with_command(n, args) for n in getattr(e, "__notes__", [])]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a closing session), raised where the process is and handled as Ctrl-C: the
    run stops, checkpoints are kept (resumable), one line says so."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _say(text: str) -> None:
    print(f"raysim: {printable(text)}", file=sys.stderr)


def _main(args) -> int:
    from raysim.io.rundir import RunNotMoved

    try:
        if getattr(args, "overrides", None):  # backend.code given on the command line may lie outside the working
            from raysim.config import usercode  # directory (a config file's may not)

            usercode.allow_from_command_line(args.overrides)
        if args.command == "list":
            return _cmd_list()
        if args.command == "runs":
            return _cmd_runs(args)
        if args.command == "tune":
            return _cmd_tune(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "reproduce":
            return _cmd_reproduce(args)
        if args.command == "compare":
            from raysim.app.compare import command

            return command(args)
        return _cmd_run(args)
    except (ConfigError, DataError) as e:
        cause = getattr(e, "cause", None)  # raised in a Ray actor: the original error, without Ray's traceback
        _say(str(cause if isinstance(cause, (ConfigError, DataError)) else e))
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, and SIGTERM (Terminated): one line, with the resume command if any
        notes = _notes(e, args)
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        _say(what + ("; " + "; ".join(notes) if notes else "; no results written"))
        return 143 if isinstance(e, Terminated) else 130
    except RunNotMoved as e:  # a finished run kept whole in its .incomplete directory: where it is, what to do
        _say(_with_command(str(e), args))
        return 1
    except OSError as e:  # the file system refused something raysim did not check beforehand (disk full, ...)
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        _say(f"cannot access{where}: {e.strerror or e}")
        for note in _notes(e, args):
            _say(note)
        return 1
    except Exception as e:
        from raysim.runner.faults import MachineFault, classify
        from raysim.errors import SimulationError

        fault = None if isinstance(e, MachineFault) else classify(e)  # a disk-full chain (torch.save), an OOM
        if isinstance(e, MachineFault) or fault is not None:  # one line: the resource, the key, the resume command
            text = str(getattr(e, "cause", None) or e) if fault is None else fault.message()
            _say("; ".join([text.splitlines()[0] if text else type(e).__name__] + _notes(e, args)))
            return 1
        if isinstance(e, SimulationError):
            from raysim.runner.safety import NonFiniteError

            _say(str(e) if isinstance(e, NonFiniteError) else f"simulation failed: {e}")
            for note in _notes(e, args):
                _say(note)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
