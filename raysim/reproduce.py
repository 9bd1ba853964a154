"""Seed experiments: every method of one experiment of a seed paper, run over several seeds at the seed's protocol,
and a table of our numbers beside the seed's (``raysim reproduce``).

An experiment is declared in ``configs/<seed folder>/experiments.yaml`` (format: ``configs/SEED_EXPERIMENTS.md``);
the seeds' published numbers live in one file, ``configs/seed_numbers.yaml``. Runs go to
``<out>/<experiment>/<run slug>/seed<N>/``; a finished run whose stored configuration hash equals the resolved one is
reused (an interrupted reproduction resumes without redoing finished runs), one whose hash differs is an error, so a
table never mixes configurations. The table is written by :func:`write_table`; ``raysim report`` (:func:`raysim.io.report
.build_report`) writes the usual summary and plots beside it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from raysim.config import ConfigError, load_config, load_yaml_mapping

CONFIGS_ROOT = Path(__file__).resolve().parent.parent / "configs"
NUMBERS_FILE = "seed_numbers.yaml"
MANIFEST = "experiments.yaml"
_KEYS = {"title", "source", "seeds", "metric", "extra_metrics", "select", "select_per", "percent", "scaled", "set",
         "runs", "claims", "extends", "description"}
_RUN_KEYS = {"label", "config", "set", "paper"}
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
        runs.append(RunSpec(str(r["label"]), cfg, _overrides(r.get("set"), f"{where}.runs[{i}].set"),
                            None if r.get("paper") is None else str(r["paper"])))
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
    select = str(body.get("select", "last"))
    select_per = str(body.get("select_per", "run"))
    if select_per not in ("run", "client"):
        raise ConfigError(f"{where}.select_per", f"{select_per!r} is not allowed; choose one of: run, client")
    if select != "last" and not select.startswith("val_"):
        raise ConfigError(f"{where}.select", f"{select!r}: choose 'last' or a validation metric (val_*); a test "
                                             f"metric never selects")
    return Experiment(name=name, folder=folder, title=str(body["title"]), source=str(body["source"]), seeds=seeds,
                      metric=str(body["metric"]), runs=tuple(runs),
                      extra_metrics=tuple(_as_list(body.get("extra_metrics"), f"{where}.extra_metrics")),
                      select=select, select_per=select_per, percent=bool(body.get("percent", True)),
                      scaled=str(body.get("scaled") or ""), overrides=_overrides(body.get("set"), f"{where}.set"),
                      claims=tuple(claims), description=str(body.get("description") or ""))


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


def plan(exp: Experiment, seeds, out: str | Path, overrides=(), check_data: bool = True) -> list[Planned]:
    """Resolve every (run, seed) of ``exp``: its config (the experiment's, the run's, then ``overrides``), its target
    directory and whether it is reused, resumed or run. Raises ConfigError before anything is written when a config
    or the data is bad, or when a target holds a run of another configuration."""
    from raysim.io import rundir
    from raysim.engine.prepare import prepare

    out = Path(out) / exp.name
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
            elif _diverged(target, cfg) is not None:
                p.status = "diverged"  # it diverged with this very config: running it again would diverge again
            elif rundir.has_checkpoints(rundir.work_path(target)):
                p.status = "resume"
            planned.append(p)
    return planned


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


def _diverged(target: Path, cfg) -> Optional[str]:
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
        else:
            p.status = "reuse"
            if jobs > 1:
                log(f"    {name}: done in {seconds:.0f} s")

    if jobs == 1:
        for k, p in enumerate(todo, 1):
            log(f"[{k}/{len(todo)}] {p.run.label} seed {p.seed} -> {p.target}" + (" (resumed)" if p.status == "resume" else ""))
            finish(p, run_one(p.cfg, p.target, progress))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from raysim import registry

    # the workers start fresh: the registrations made in this process (register_algorithm, ...) go with them
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=registry.install, initargs=(registry.snapshot(),))
    futures = {}
    try:
        for k, p in enumerate(todo, 1):
            log(f"[{k}/{len(todo)}] {p.run.label} seed {p.seed} -> {p.target} (queued)")
            futures[pool.submit(run_one, p.cfg, p.target, False)] = p
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


def run_one(cfg, target: Path, progress: Optional[bool]) -> tuple[str, str, float]:
    """One planned run (in this process or a worker's), its state looked at as it starts: ("done" | "reused" |
    "diverged" | "busy", message, seconds). A finished run of the same config is reused (another process finished
    it), of another config is an error; a locked working directory is left to its holder; one with checkpoints is
    resumed. A divergence is recorded beside the run's checkpoints (``DIVERGED.json``)."""
    import time

    from raysim.io import rundir
    from raysim.engine.loop import run_experiment
    from raysim.engine.safety import NonFiniteError

    t0 = time.perf_counter()
    target = Path(target)
    if _finished(target, cfg):
        return "reused", "", 0.0
    message = _diverged(target, cfg)
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


# ----------------------------------------------------------------------------------------------------------------
# the table

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
    diverged = [(p, _diverged(p.target, p.cfg)) for p in planned if not (p.target / "results.parquet").exists()]
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
