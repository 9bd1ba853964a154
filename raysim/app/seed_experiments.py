"""Seed experiments: every method of one experiment of a seed paper, run over several seeds at the seed's protocol,
and a table of our numbers beside the seed's (``raysim reproduce``).

An experiment is declared in ``configs/<seed folder>/experiments.yaml`` (format: ``configs/SEED_EXPERIMENTS.md``);
the seeds' published numbers live in one file, ``configs/seed_numbers.yaml``. Runs go to
``<out>/<experiment>/<run slug>/seed<N>/``; a finished run whose stored configuration hash equals the resolved one is
reused (an interrupted reproduction resumes without redoing finished runs), one whose hash differs is an error, so a
table never mixes configurations; a finished run made by another code version (:mod:`raysim.engine.provenance`) is reused
only with ``reuse_any`` (``--reuse-any``), else one error names the runs and the versions. The table is written by :func:`write_table`; ``raysim report`` (:func:`raysim.app.summary
.build_report`) writes the usual summary and plots beside it.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional


from raysim.app.reproduction_cost import TimeLeft
from raysim.config import load_config, load_yaml_mapping
from raysim.errors import ConfigError

CONFIGS_ROOT = Path(__file__).resolve().parents[2] / "configs"
NUMBERS_FILE = "seed_numbers.yaml"
MANIFEST = "experiments.yaml"
_KEYS = {"title", "source", "seeds", "min_seeds", "metric", "extra_metrics", "select", "select_per", "percent", "scaled", "set",
         "runs", "claims", "extends", "description", "window", "seed_setting"}
_RUN_KEYS = {"label", "config", "set", "paper", "metric"}
_CLAIM_KEYS = {"text", "better", "worse", "metric", "lower_is_better"}


def slug(label: str) -> str:
    """A run label as a directory name: lower case, '+' spelled 'plus' (PN-ICFL+ is not PN-ICFL), every run of other
    non-alphanumerics replaced by '-'."""
    s = re.sub(r"[^a-z0-9]+", "-", str(label).lower().replace("+", " plus ")).strip("-")
    if not s:
        raise ConfigError("runs.label", f"{label!r} has no letters or digits to name a directory with")
    return s


@dataclass(frozen=True)
class RunSpec:
    label: str
    config: Path
    overrides: tuple = ()
    paper: Optional[str] = None
    metric: Optional[str] = None  # the metric the seed reports for this method, when it is not the experiment's
    #                               (e.g. FedTGP's prototype accuracy beside the baselines' classifiers): claims
    #                               without a metric of their own compare each side on its run's metric

    @property
    def slug(self) -> str:
        return slug(self.label)


@dataclass(frozen=True)
class Claim:
    text: str
    better: str
    worse: str
    metric: Optional[str] = None
    lower_is_better: bool = False


@dataclass(frozen=True)
class Experiment:
    name: str
    folder: Path
    title: str
    source: str
    seeds: tuple
    metric: str
    runs: tuple
    extra_metrics: tuple = ()
    select: str = "last"
    select_per: str = "run"
    percent: bool = True
    scaled: str = ""
    overrides: tuple = ()
    claims: tuple = ()
    description: str = ""
    min_seeds: int = 3  # paired seeds a claim needs for a verdict (5 where the seed paper ran 5); fewer: n too small
    window: int = 5  # select 'last': a run's verdict value is the mean of its last `window` evaluated rounds (issue 51)
    seed_setting: Optional[bool] = None  # the runs use the seed's dataset, model and protocol (default: scaled is "")
    cli_overrides: tuple = ()  # the overrides this reproduction was made with (raysim reproduce --set, --backend)

    @property
    def matches_seed(self) -> bool:
        """Whether the seed's numbers are comparable value for value (the table's diff column): the manifest says the
        runs use the seed's dataset, model and protocol (``seed_setting``; by default, when nothing is ``scaled``)."""
        return (not self.scaled) if self.seed_setting is None else bool(self.seed_setting)

    def run(self, label: str) -> RunSpec:
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(label)


def _as_list(v, field_name: str) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    if isinstance(v, str):
        return [v]
    raise ConfigError(field_name, f"expected a list, got {type(v).__name__}")


def _overrides(v, field_name: str) -> tuple:
    items = _as_list(v, field_name)
    if isinstance(v, dict):
        items = [f"{k}={json.dumps(x) if not isinstance(x, str) else x}" for k, x in v.items()]
    for s in items:
        if not isinstance(s, str) or "=" not in s:
            raise ConfigError(field_name, f"{s!r} is not KEY=VALUE")
    return tuple(items)


def _manifests(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob(f"*/{MANIFEST}") if p.is_file())


def load_experiments(root: str | Path = CONFIGS_ROOT) -> dict[str, Experiment]:
    """Every experiment declared under ``root`` (``<root>/*/experiments.yaml``), ``extends`` resolved."""
    raw: dict[str, tuple[Path, dict]] = {}
    for path in _manifests(Path(root)):
        data = load_yaml_mapping(path, str(path))
        for name, body in data.items():
            where = f"{path}: {name}"
            if not isinstance(body, dict):
                raise ConfigError(where, "an experiment must be a mapping (see configs/SEED_EXPERIMENTS.md)")
            if name in raw:
                raise ConfigError(where, f"experiment name {name!r} is also declared in {raw[name][0]}")
            unknown = set(body) - _KEYS
            if unknown:
                raise ConfigError(f"{where}.{sorted(unknown)[0]}", f"unknown key; allowed: {', '.join(sorted(_KEYS))}")
            raw[name] = (path, body)

    def merged(name: str, seen: tuple = ()) -> dict:
        path, body = raw[name]
        if "extends" not in body:
            return dict(body)
        base = body["extends"]
        if base not in raw:
            raise ConfigError(f"{path}: {name}.extends", f"{base!r} is not an experiment; choose one of: "
                                                         f"{', '.join(sorted(raw))}")
        if base in seen:
            raise ConfigError(f"{path}: {name}.extends", f"circular: {' -> '.join(seen + (name, base))}")
        if raw[base][0].parent != path.parent:
            raise ConfigError(f"{path}: {name}.extends", f"{base!r} lives in another folder ({raw[base][0]})")
        out = merged(base, seen + (name,))
        for k, v in body.items():
            if k == "set":
                out["set"] = list(_overrides(out.get("set"), f"{name}.set")) + list(_overrides(v, f"{name}.set"))
            elif k != "extends":
                out[k] = v
        return out

    return {name: _build(name, raw[name][0], merged(name)) for name in raw}


def _selection(body: dict, where: str) -> tuple[str, str, int]:
    """An experiment's rule for a run's value: ``select`` (last, or a validation metric), ``select_per`` (run or
    client) and ``window`` (the last evaluated rounds averaged under ``last``; issue 51: >= 5, fixed in advance)."""
    window = body.get("window", 5)
    if isinstance(window, bool) or not isinstance(window, int) or window < 5:
        raise ConfigError(f"{where}.window", f"{window!r}: the last evaluated rounds a run's value averages, an "
                                             f"integer >= 5, fixed before the runs (issue 51)")
    select = str(body.get("select", "last"))
    select_per = str(body.get("select_per", "run"))
    if select_per not in ("run", "client"):
        raise ConfigError(f"{where}.select_per", f"{select_per!r} is not allowed; choose one of: run, client")
    if select != "last" and not select.startswith("val_"):
        raise ConfigError(f"{where}.select", f"{select!r}: choose 'last' or a validation metric (val_*); a test "
                                             f"metric never selects")
    return select, select_per, window


def _build(name: str, path: Path, body: dict) -> Experiment:
    where = f"{path}: {name}"
    folder = path.parent
    for k in ("title", "source", "metric", "runs"):
        if k not in body:
            raise ConfigError(f"{where}.{k}", "missing (see configs/SEED_EXPERIMENTS.md)")
    runs = []
    for i, r in enumerate(_as_list(body["runs"], f"{where}.runs")):
        if not isinstance(r, dict) or "label" not in r or "config" not in r:
            raise ConfigError(f"{where}.runs[{i}]", "each run needs 'label' and 'config'")
        unknown = set(r) - _RUN_KEYS
        if unknown:
            raise ConfigError(f"{where}.runs[{i}].{sorted(unknown)[0]}", f"unknown key; allowed: {', '.join(sorted(_RUN_KEYS))}")
        cfg = folder / str(r["config"])
        if not cfg.is_file():
            raise ConfigError(f"{where}.runs[{i}].config", f"{cfg} does not exist")
        metric = None if r.get("metric") is None else str(r["metric"])
        shown = [str(body["metric"]), *[str(m) for m in _as_list(body.get("extra_metrics"), f"{where}.extra_metrics")]]
        if metric is not None and metric not in shown:
            raise ConfigError(f"{where}.runs[{i}].metric", f"{metric!r} must be the experiment's metric or one of its "
                                                           f"extra_metrics ({', '.join(shown)})")
        runs.append(RunSpec(str(r["label"]), cfg, _overrides(r.get("set"), f"{where}.runs[{i}].set"),
                            None if r.get("paper") is None else str(r["paper"]), metric))
    slugs = [r.slug for r in runs]
    if len(set(slugs)) != len(slugs):
        raise ConfigError(f"{where}.runs", f"two run labels give the same directory name: {slugs}")
    labels = {r.label for r in runs}
    claims = []
    for i, c in enumerate(_as_list(body.get("claims"), f"{where}.claims")):
        if not isinstance(c, dict) or not {"better", "worse"} <= set(c):
            raise ConfigError(f"{where}.claims[{i}]", "each claim needs 'better' and 'worse' (run labels)")
        unknown = set(c) - _CLAIM_KEYS
        if unknown:
            raise ConfigError(f"{where}.claims[{i}].{sorted(unknown)[0]}", f"unknown key; allowed: {', '.join(sorted(_CLAIM_KEYS))}")
        for side in ("better", "worse"):
            if c[side] not in labels:
                raise ConfigError(f"{where}.claims[{i}].{side}", f"{c[side]!r} is not a run label; choose one of: "
                                                                 f"{', '.join(sorted(labels))}")
        claims.append(Claim(str(c.get("text") or f"{c['better']} > {c['worse']}"), str(c["better"]),
                            str(c["worse"]), c.get("metric"), bool(c.get("lower_is_better", False))))
    seeds = tuple(int(s) for s in _as_list(body.get("seeds", [1, 2, 3]), f"{where}.seeds"))
    min_seeds = body.get("min_seeds", 3)
    if isinstance(min_seeds, bool) or not isinstance(min_seeds, int) or min_seeds < 3:
        raise ConfigError(f"{where}.min_seeds", f"{min_seeds!r}: the seeds a verdict needs, an integer >= 3 (5 where "
                                                f"the seed paper ran 5)")
    select, select_per, window = _selection(body, where)
    seed_setting = body.get("seed_setting")
    if seed_setting is not None and not isinstance(seed_setting, bool):
        raise ConfigError(f"{where}.seed_setting", f"{seed_setting!r}: true when the runs use the seed's dataset, "
                                                   f"model and protocol (its numbers are then compared value for "
                                                   f"value), else false")
    return Experiment(name=name, folder=folder, title=str(body["title"]), source=str(body["source"]), seeds=seeds,
                      metric=str(body["metric"]), runs=tuple(runs),
                      extra_metrics=tuple(_as_list(body.get("extra_metrics"), f"{where}.extra_metrics")),
                      select=select, select_per=select_per, percent=bool(body.get("percent", True)),
                      scaled=str(body.get("scaled") or ""), overrides=_overrides(body.get("set"), f"{where}.set"),
                      claims=tuple(claims), description=str(body.get("description") or ""), min_seeds=min_seeds,
                      window=window, seed_setting=seed_setting)


# overrides that change where or how a run is computed, not what it computes: a reproduction with only these keeps
# the seed's protocol (they are still recorded)
NEUTRAL_OVERRIDES = ("backend.", "output.", "data.root=")


def protocol_overrides(overrides) -> list[str]:
    """The overrides (``KEY=VALUE``) that change what the runs compute: all but ``backend.*``, ``output.*`` and
    ``data.root`` (where the files are)."""
    return [o for o in overrides or () if not str(o).strip().startswith(NEUTRAL_OVERRIDES)]


def load_numbers(root: str | Path = CONFIGS_ROOT) -> dict:
    path = Path(root) / NUMBERS_FILE
    return load_yaml_mapping(path, str(path)) if path.exists() else {}


def source_entry(exp: Experiment, numbers: dict) -> dict:
    """The seed_numbers.yaml entry ``<seed key>.<table key>`` an experiment compares with; a ConfigError naming
    the experiment's source when the file has no such entry."""
    seed_key, _, table = exp.source.partition(".")
    entry = (numbers.get(seed_key) or {}).get(table) if table else None
    if entry is None:
        raise ConfigError(f"{exp.name}.source", f"{exp.source!r} is not an entry of {NUMBERS_FILE} "
                                                f"(write it as <seed key>.<table key>)")
    return entry


def paper_value(exp: Experiment, numbers: dict, run: RunSpec, metric: str) -> float:
    if run.paper is None:
        return math.nan
    values = source_entry(exp, numbers).get("values") or {}
    if run.paper not in values:
        raise ConfigError(f"{exp.name}.runs.paper", f"{run.paper!r} is not under {exp.source}.values in "
                                                    f"{NUMBERS_FILE}; choose one of: {', '.join(sorted(values))}")
    v = values[run.paper]
    if isinstance(v, dict):
        v = v.get(metric, math.nan)
    return math.nan if v is None else float(v)


# ----------------------------------------------------------------------------------------------------------------
# running

@dataclass
class Planned:
    run: RunSpec
    seed: int
    cfg: object
    target: Path
    status: str = "to run"  # to run | reuse | resume | diverged
    code: Optional[dict] = None  # a reused run's recorded code version (raysim.engine.provenance)


def plan(exp: Experiment, seeds, out: str | Path, overrides=(), check_data: bool = True,
         reuse_any: bool = False) -> list[Planned]:
    """Resolve every (run, seed) of ``exp``: its config (the experiment's, the run's, then ``overrides``), its target
    directory and whether it is reused, resumed or run. Raises ConfigError before anything is written when a config
    or the data is bad, when a target holds a run of another configuration, or when a finished run of this
    configuration was made by another code version than this process's (one line naming the runs and the versions;
    ``reuse_any`` reuses them knowingly, and the table names every code version it holds)."""
    from raysim.engine import provenance
    from raysim.io import rundir
    from raysim.engine.prepare import prepare

    out_root = Path(out)
    out = out_root / exp.name
    planned = []
    for r in exp.runs:
        base = load_config(r.config, list(exp.overrides) + list(r.overrides) + list(overrides))
        if base.output.checkpoint_every == 0:  # a reproduction is long: keep checkpoints so it can resume
            base = replace(base, output=replace(base.output, checkpoint_every=max(1, base.rounds // 10)))
        for i, s in enumerate(seeds):
            cfg = replace(base, seed=int(s))
            if check_data and i == 0:
                prepare(cfg)  # the data and partition are checked once per run before any run starts
            target = out / r.slug / f"seed{int(s)}"
            p = Planned(r, int(s), cfg, target)
            if _finished(target, cfg):
                p.status = "reuse"
                p.code = provenance.recorded(target)
            elif diverged_reason(target, cfg) is not None:
                p.status = "diverged"  # it diverged with this very config: running it again would diverge again
            elif rundir.has_checkpoints(rundir.work_path(target)):
                p.status = "resume"
            planned.append(p)
    if not reuse_any:
        check_code(planned, out_root)
    return planned


def check_code(planned: list[Planned], out: str | Path) -> None:
    """The runs planned for reuse were made by this process's code version, or one ConfigError (field
    ``--reuse-any``) names them, their versions and this one."""
    from raysim.engine import provenance

    here = provenance.code_version()
    other = [p for p in planned if p.status == "reuse" and not provenance.same(p.code, here)]
    if not other:
        return
    groups: dict[str, list[str]] = {}
    for p in other:
        groups.setdefault(provenance.label(p.code), []).append(f"{p.run.label} seed {p.seed}")
    names = "; ".join(f"{', '.join(runs)}: {version}" for version, runs in groups.items())
    raise ConfigError("--reuse-any", f"{len(other)} finished run(s) under {out} were made by another code version "
                                     f"than this one ({provenance.label(here)}): {names}; reuse them knowingly with "
                                     f"--reuse-any (the table names every code version), or run them again under "
                                     f"another --out")


def _finished(target: Path, cfg) -> bool:
    """Whether ``target`` holds a finished run of ``cfg``; a finished run of another configuration is an error (a
    table never mixes configurations)."""
    if not (target / "results.parquet").exists():
        return False
    stored = _stored_hash(target)
    if stored != cfg.config_hash():
        raise ConfigError("--out", f"{target} holds a run of another configuration (hash {stored}, this one "
                                   f"{cfg.config_hash()}); a table never mixes configurations: use another --out or "
                                   f"remove that run")
    return True


def _stored_hash(path: Path) -> Optional[str]:
    try:
        return json.loads((path / "run.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        return None


DIVERGED = "DIVERGED.json"  # in a run's working directory: the run diverged (on_nonfinite: stop) with this config


def diverged_reason(target: Path, cfg) -> Optional[str]:
    """The divergence message recorded for ``target`` when it diverged under this very config, else None."""
    from raysim.io import rundir

    try:
        rec = json.loads((rundir.work_path(target) / DIVERGED).read_text())
    except (OSError, ValueError):
        return None
    return rec.get("message") if rec.get("config_hash") == cfg.config_hash() else None


def check_jobs(planned: list[Planned], jobs: int) -> None:
    """``--jobs``: at least 1, and runs side by side only on the sequential backend (checked before anything runs)."""
    if jobs < 1:
        raise ConfigError("--jobs", f"must be >= 1, got {jobs}")
    if jobs > 1:
        ray_runs = sorted({p.run.label for p in planned if p.status not in ("reuse", "diverged")
                           and p.cfg.backend.name == "ray"})
        if ray_runs:
            raise ConfigError("--jobs", f"runs side by side need the sequential backend; {', '.join(ray_runs)} "
                                        f"use(s) backend ray: use --jobs 1 or --backend sequential")


def execute(planned: list[Planned], progress: Optional[bool] = None, log: Callable = print, jobs: int = 1) -> None:
    """Run every planned run not finished yet, ``jobs`` at a time (``jobs`` > 1: each in its own process, sequential
    backend; the same numbers as one at a time). Each run's state is looked at again when it starts (:func:`run_one`):
    one that another process finished meanwhile is reused, one that another process is running (its working directory
    is locked: a second ``raysim reproduce`` on the same ``--out``) is left to it. A run that diverges (NaN/inf under
    ``on_nonfinite: stop``) is a result, not a crash: it is recorded beside its checkpoints (``DIVERGED.json``), named
    in the table, and the other runs go on; planning it again with the same config skips it."""
    check_jobs(planned, jobs)
    todo = [p for p in planned if p.status not in ("reuse", "diverged")]
    gone = sum(p.status == "diverged" for p in planned)
    log(f"{len(planned)} run(s): {len(planned) - len(todo) - gone} finished and reused, "
        + (f"{gone} diverged before, " if gone else "") + f"{len(todo)} to run" + (f", {jobs} at a time" if jobs > 1 else ""))

    left = TimeLeft(todo, jobs)  # each finished run's time and the estimate of what is left

    def finish(p: Planned, outcome: tuple) -> None:
        kind, message, seconds = outcome
        name = f"{p.run.label} seed {p.seed}"
        if kind == "diverged":
            p.status = "diverged"
            log(f"    {name}: {message}")
        elif kind == "busy":
            log(f"    {name}: {message}; left to the process that holds it")
        elif kind == "reused":
            p.status = "reuse"
            log(f"    {name}: finished meanwhile by another process; reused")
        else:  # done
            log(f"    {name}: done in {left.done(seconds)}")
            p.status = "reuse"

    if jobs == 1:
        for k, p in enumerate(todo, 1):
            log(f"[{k}/{len(todo)}] {p.run.label} seed {p.seed} -> {p.target}" + (" (resumed)" if p.status == "resume" else ""))
            finish(p, run_one(p.cfg, p.target, "auto" if progress is None else progress))  # whatever the configs say
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from raysim.config import registry

    # the workers start fresh: the registrations made in this process (register_algorithm, ...) and its environment
    # go with them
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=_job_context(), initializer=_start_job_worker,
                               initargs=(registry.snapshot(), dict(os.environ)))
    futures = {}
    try:
        for k, p in enumerate(todo, 1):
            log(f"[{k}/{len(todo)}] {p.run.label} seed {p.seed} -> {p.target} (queued)")
            futures[pool.submit(run_one, p.cfg, p.target, "lines" if progress is not False else False)] = p
        for f in as_completed(futures):
            finish(futures[f], f.result())  # a crash (not a divergence) raises here
    except BaseException:
        # Ctrl-C (the workers got it too and stop their runs, resumable) or a crash: start nothing more; a crash
        # stops the runs still going (killed runs resume from their checkpoints next time)
        workers = list((getattr(pool, "_processes", None) or {}).values())  # before shutdown forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            proc.terminate()
        log("stopped: no run is started any more; unfinished runs resume from their checkpoints next time")
        raise
    pool.shutdown(wait=True)


def _job_context():
    """How ``--jobs`` workers start: forked from a server process that has imported torch and raysim once (Linux,
    macOS: ``forkserver``; each worker then starts in a fraction of a second instead of importing torch again), else
    fresh interpreters (``spawn``). Either way nothing of this process's state is inherited but what the workers are
    given: its registrations, environment, working directory and import path."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["raysim.app.seed_experiments", "raysim.engine.loop"])  # no effect once it runs
        return ctx
    return multiprocessing.get_context("spawn")


def _start_job_worker(snapshot: dict, environ: dict) -> None:
    """A ``--jobs`` worker: the parent's environment as it is now (the fork server keeps the one it started with)
    and registrations. Numerics (raysim/numerics.py) were chosen when the fork server imported raysim, from the
    environment of the parent that started it."""
    from raysim.config import registry

    os.environ.clear()
    os.environ.update(environ)
    registry.install(snapshot)


def run_one(cfg, target: Path, progress: Optional[bool]) -> tuple[str, str, float]:
    """One planned run (in this process or a worker's), its state looked at as it starts: ("done" | "reused" |
    "diverged" | "busy", message, seconds). A finished run of the same config is reused (another process finished
    it), of another config is an error; a locked working directory is left to its holder; one with checkpoints is
    resumed. A divergence is recorded beside the run's checkpoints (``DIVERGED.json``)."""
    import time

    from raysim.io import rundir
    from raysim.engine.loop import run_experiment
    from raysim.runner.safety import NonFiniteError

    t0 = time.perf_counter()
    target = Path(target)
    if _finished(target, cfg):
        return "reused", "", 0.0
    message = diverged_reason(target, cfg)
    if message is not None:
        return "diverged", message, 0.0
    work = rundir.work_path(target)
    who = rundir.holder(work) if work.exists() else None
    if who:
        return "busy", f"running in another process ({who})", 0.0
    resume = work if rundir.has_checkpoints(work) else None
    try:
        run_experiment(cfg, out_dir=target, progress=progress, resume=resume)
    except NonFiniteError as e:
        work.mkdir(parents=True, exist_ok=True)
        (work / DIVERGED).write_text(json.dumps({"config_hash": cfg.config_hash(), "message": str(e)}))
        return "diverged", str(e), time.perf_counter() - t0
    except rundir.RunDirBusy as e:  # another process took it between the look and the start
        return "busy", str(e), time.perf_counter() - t0
    return "done", "", time.perf_counter() - t0
