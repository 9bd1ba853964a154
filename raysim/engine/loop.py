"""The driver: validates a run once, then walks the algorithm's step schedules round by round against a backend.

``run_experiment`` is a small loop; everything around it — the run directory, checkpoints, the progress bar, tuning
reports, user loggers — is a :class:`Callback`:

    on_run_start(run)                      after the backend started (and a resume restored its states)
    on_setup_end(run)                      after the setup schedule ran (only for methods that have one)
    on_round_end(run, round_idx, evaluated) -> stop?   after every round (and its evaluation)
    on_run_end(run, result)                after the last round (called in reverse order of registration)
    on_run_error(run, exc)                 when the run failed (reverse order)

Built in: :class:`RunDirectory` (writes the run directory atomically), :class:`Checkpointer`, :class:`ProgressBar`,
:class:`EvalCallback` (``callback(round_idx, table) -> stop`` on evaluated rounds; tuning uses it),
:class:`ClusterAgreement` (ARI of a clustered method's ``cluster`` reports against the ground-truth domains). Pass your own
with ``run_experiment(cfg, callbacks=[...])`` (e.g. a TensorBoard or MLflow logger reading ``run.table``).
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd
import yaml

from raysim import rng as rngmod
from raysim.io import rundir
from raysim.engine import safety
from raysim.algorithm import Task
from raysim.backends import make_backend, preflight
from raysim.config import ConfigError, ExperimentConfig, check_path_component, from_dict, to_dict
from raysim.data.federated import FederatedData, build_federated_data
from raysim.models import client_archs
from raysim.registry import algorithm_class, algorithm_target, make_environment
from raysim.io.results import RESULTS_FILE, ROUND_TIME, STEP_TIME, ResultTable, write_parquet
from raysim.io.results import final as results_final
from raysim.errors import SimulationError
from raysim.engine.runners import ClientReport, RunSpec, step_token
from raysim.io.checkpoints import find_checkpoint, read_checkpoint_meta, write_checkpoint
from raysim.steps import ALL, ClientStep, ServerStep, check_schedule, flatten

COMM_METRICS = ("up_floats", "up_bytes", "down_floats", "down_bytes")
SETUP_ROUND = rngmod.NO_ROUND  # the setup phase's rows carry round -1

EQUALITY_POLICY = {
    "bit_identical": "CPU, the per-client loop executor, backend.torch_threads = 1: the same table on every backend, "
                     "actor count, state_memory_mb setting and after a resume, but for the wall-time rows (round_s, "
                     "step_s@<step>; results.without_timing drops them)",
    "tolerance": "vectorised executors and GPU runs: metrics within 1e-4 absolute of the CPU reference (not "
                 "bit-identical: kernels reorder floating-point sums)",
}


# ----------------------------------------------------------------------------------------------------------------
# validation (once, on the driver)

@dataclass
class Prepared:
    cfg: ExperimentConfig
    fed_data: FederatedData
    task: Task
    spec: RunSpec
    env: Any = None  # envs.Environment when the config has an env section
    algorithm: Any = None  # a driver-side instance (schedules only; never trained)
    models: dict = field(default_factory=dict)  # arch key -> {"params": count, "embed_dim": size or None}


def prepare(cfg: ExperimentConfig) -> Prepared:
    """Everything that can be checked before a run starts, cheapest first: algorithm and model parameters, then the
    data (loading and partitioning), then the algorithm against the task, then the resources the backend needs.
    The typed Params travel to the runners, which never parse or validate again."""
    from raysim.adapt import WholeModel, describe, resolve_factory, suggest_embedding
    from raysim.models import ARCHS, arch_key, arch_params, build_model

    algo_cls = algorithm_class(cfg.algorithm.name)
    params = from_dict(algo_cls.Params, dict(cfg.algorithm.params or {}), "algorithm.params")
    specs = [("model", cfg.model)] if cfg.model.per_client is None else [
        (f"model.per_client[{i}]", s) for i, s in enumerate(cfg.model.per_client)]
    for path, spec in specs:
        if spec.arch not in ARCHS:
            resolve_factory(spec.arch, f"{path}.arch")  # a user model: its import path resolves (built below)
            continue
        for k in spec.params:
            if k not in arch_params(spec.arch):
                raise ConfigError(f"{path}.params.{k}", f"unknown parameter for {spec.arch}; allowed: "
                                                         f"{', '.join(arch_params(spec.arch))}")
    _notice_dropped(cfg)
    _check_population_memory(cfg)
    fed = build_federated_data(cfg.data, cfg.seed)
    env = make_environment(cfg, fed)  # None without an env section
    env_tiers = env is not None and cfg.model.assign == "tier" and getattr(cfg.model, "tiers", None) is None
    archs = tuple(env.archs(cfg.model) if env_tiers else client_archs(cfg.model, cfg.data.num_clients))
    task = Task(fed.num_classes, tuple(fed.input_shape), cfg.data.num_clients, archs, cfg.train, cfg.seed, cfg.rounds,
                fed.public, cfg.data.val_fraction, len(fed.server_val) if fed.server_val is not None else 0)
    models = {}  # arch key -> {"params": count, "embed_dim": size or None}
    for i, spec in enumerate(archs):  # build each architecture once: bad values fail here, naming the field
        if arch_key(spec) not in models:
            path = "model" if cfg.model.per_client is None else _per_client_path(cfg.model, spec, i)
            _check_model_size(spec, task, path)
            try:
                built = build_model(spec, task.input_shape, task.num_classes, path)
            except (TypeError, ValueError, RuntimeError) as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(f"{path}.params", f"cannot build {spec.arch} with {spec.params}: {e}") from None
            models[arch_key(spec)] = describe(built)
            if isinstance(built, WholeModel) and algo_cls.needs_embedding:
                hint = suggest_embedding(built)
                raise ConfigError(f"{path}.embedding",
                                  f"{cfg.algorithm.name} needs the model's embedding, and {spec.arch} has no known "
                                  f"body/head split: set {path}.embedding to the layer whose output is the embedding"
                                  f"{f' (e.g. {hint!r}, the input of the last linear layer)' if hint else ''}, or give "
                                  f"the module `features` (input -> embedding) and `classifier` (embedding -> logits) "
                                  f"attributes, or return a raysim.models.SplitModel")
            if cfg.backend.vectorize and cfg.train.local_steps is not None:
                raise ConfigError("train.local_steps", "is not supported with backend.vectorize (the vectorised "
                                                       "executor runs whole epochs); use local_epochs")
            if cfg.backend.vectorize:
                from raysim.engine.vectorized import check_model

                check_model(built, spec.arch)
    algorithm = algo_cls(params, task)
    algorithm.validate()
    for where, sched in (("schedule()", algorithm.schedule()), ("setup_schedule()", algorithm.setup_schedule()),
                         ("evaluation_schedule()", algorithm.evaluation_schedule())):
        check_schedule(sched, algorithm, where)
    preflight(cfg)
    if env is not None:
        env.bind(task)
    from raysim import registry, usercode

    code = usercode.code_to_ship(cfg) if cfg.backend.name == "ray" else ()
    spec = RunSpec(cfg, task, algorithm_target(cfg.algorithm.name), params, registry=registry.snapshot(),
                   code=tuple(code), cwd=None if cfg.backend.code == "working_dir" else os.getcwd())
    return Prepared(cfg, fed, task, spec, env, algorithm, models)


def _per_client_path(model_cfg, spec, i: int) -> str:
    """The per_client entry an architecture came from (its index in the list)."""
    for k, s in enumerate(model_cfg.per_client):
        if s.arch == spec.arch and dict(s.params) == dict(spec.params):
            return f"model.per_client[{k}]"
    return f"model.per_client[{i % len(model_cfg.per_client)}]"


def _available_bytes() -> Optional[int]:
    from raysim.data.datasets import available_memory

    return available_memory()


POPULATION_BYTES_PER_CLIENT = 256  # CSR offsets of train/test/val (24 B), the runners' masks, the driver's per-client
#                                    bookkeeping (sizes, domains, placement), with room to spare
POPULATION_SHARE = 0.5  # of the free memory a population's index data may take (the data pools and models need the rest)


def population_bytes(cfg: ExperimentConfig) -> int:
    """Estimate of the memory a population's client bookkeeping takes on the driver before any data is built:
    per-client index arrays (8 bytes per sample index; partitioners that draw ``samples_per_client`` /
    ``test_per_client`` per client, with replacement across clients) plus a fixed per-client overhead. Partitioners
    that split a pool give each sample to one client: their index data is bounded by the pool (not counted)."""
    p = dict(cfg.data.partition_params or {})
    per = 0
    for key in ("samples_per_client", "test_per_client"):
        v = p.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            per += int(v)
    return int(cfg.data.num_clients) * (8 * per + POPULATION_BYTES_PER_CLIENT)


def _check_population_memory(cfg: ExperimentConfig, avail: Optional[int] = None) -> None:
    """Refuse, before any data is built, a population whose client bookkeeping alone would not fit in half of this
    machine's free memory, with the estimate and the keys to change."""
    need = population_bytes(cfg)
    avail = _available_bytes() if avail is None else avail
    if avail is not None and need > POPULATION_SHARE * avail:
        p = cfg.data.partition_params or {}
        per = " x ".join(f"{k} {p[k]}" for k in ("samples_per_client", "test_per_client") if k in p)
        raise ConfigError("data.num_clients", f"{cfg.data.num_clients:,} clients" + (f" ({per})" if per else "")
                          + f" need about {need / 2**30:,.1f} GiB for their index data and bookkeeping alone, more "
                          f"than half of the {avail / 2**30:,.1f} GiB free here; lower data.num_clients"
                          + (" or data.partition_params.samples_per_client / test_per_client" if per else ""))


def _check_model_size(spec, task: Task, path: str) -> None:
    """Count the architecture's parameters without allocating them (torch's meta device) and refuse a model whose
    weights, gradients and optimiser state (4 copies of float32) would not fit in this machine's free memory."""
    import torch

    from raysim.models import build_model

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in build_model(spec, task.input_shape, task.num_classes, path).parameters())
    except ConfigError:
        raise
    except Exception:  # an architecture that cannot be built on the meta device is built (and checked) for real
        return
    need, avail = 16 * n, _available_bytes()
    if avail is not None and need > avail:
        raise ConfigError(f"{path}.params", f"{spec.arch} with {spec.params} has {n:,} parameters: about "
                                            f"{need / 2**30:,.1f} GiB for weights, gradients and optimiser state, "
                                            f"more than the {avail / 2**30:,.1f} GiB free here; make it smaller")


_NOTICED: set = set()


def _notice_once(message: str) -> None:
    if message not in _NOTICED:  # prepare runs again per seed and per trial: say it once
        _NOTICED.add(message)
        rundir.notice(message)


def _notice_dropped(cfg: ExperimentConfig, notify: Callable[[str], None] = _notice_once) -> None:
    """Values the run caps or leaves unused get one line each (never silently)."""
    n = cfg.data.num_clients
    per = cfg.model.per_client
    if per is not None and cfg.model.assign in ("cycle", "blocks") and len(per) > n:
        unused = [f"{i}: {s.arch}" for i, s in enumerate(per) if i >= n]
        notify(f"note: model.per_client lists {len(per)} architectures but data.num_clients is {n}: entries "
               f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''} are not used")
    tiers = cfg.model.tiers
    if cfg.model.assign == "tier" and tiers is not None and len(tiers) > n:
        notify(f"note: model.tiers lists {len(tiers)} tiers but data.num_clients is {n}: the last {len(tiers) - n} "
               f"are not used")
    rot = cfg.data.rotations
    if rot is not None and len(rot) > n:
        notify(f"note: data.rotations lists {len(rot)} angles but data.num_clients is {n}: the last {len(rot) - n} "
               f"are not used")
    if cfg.backend.name == "ray" and cfg.backend.num_actors > n:
        notify(f"note: backend.num_actors={cfg.backend.num_actors} exceeds data.num_clients={n}: {n} client actors "
               f"are started (one client each)")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("raysim", "torch", "ray", "numpy", "pandas", "pyarrow"):
        try:
            out[pkg] = importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def sample_clients(cfg: ExperimentConfig, round_idx: int) -> list[int]:
    n = cfg.data.num_clients
    k = cfg.clients_per_round or n
    if k >= n:
        return list(range(n))
    r = rngmod.numpy_rng(cfg.seed, round_idx, rngmod.SERVER, "sampling")
    return sorted(r.choice(n, size=k, replace=False).tolist())


def eval_clients(cfg: ExperimentConfig, round_idx: int) -> list[int]:
    """The clients evaluated after ``round_idx``: all, or a seeded sample of ``eval.fraction`` of them."""
    n = cfg.data.num_clients
    if cfg.eval.fraction >= 1.0:
        return list(range(n))
    k = max(1, math.ceil(cfg.eval.fraction * n))
    r = rngmod.numpy_rng(cfg.seed, round_idx, rngmod.SERVER, "eval-sampling")
    return sorted(r.choice(n, size=k, replace=False).tolist())


def resume_hash(cfg: ExperimentConfig) -> str:
    """The identity a checkpoint is checked against: everything that changes the numbers except ``rounds``."""
    return cfg.config_hash(drop=("rounds",))


# ----------------------------------------------------------------------------------------------------------------
# results

@dataclass
class RunResult:
    run_id: str
    out_dir: Optional[Path]
    table: pd.DataFrame
    metadata: dict
    timing: dict = field(default_factory=dict)

    def final(self, metric: str = "test_acc") -> tuple[float, float]:
        """(mean, sample std over clients) of ``metric`` at the last evaluated round: ``results.final`` of this run;
        (nan, nan) when the run has no such client metric."""
        if not ((self.table["scope"] == "client") & (self.table["metric"] == metric)).any():
            return math.nan, math.nan
        row = results_final(self.table, metric).iloc[0]
        return float(row["mean"]), float(row["std"])


def _value_weight(v):
    if isinstance(v, (tuple, list)):
        return float(v[0]), float(v[1])
    return float(v), 1.0


class _RoundLog:
    """What a round's client steps moved and reported, per client, written as rows when the round ends."""

    def __init__(self):
        self.clients: dict[int, dict] = {}
        self.order: list[int] = []
        self.steps: list[str] = []

    def add(self, step: str, reports: list[ClientReport]) -> None:
        if step not in self.steps:
            self.steps.append(step)
        for r in reports:
            c = self.clients.get(r.client_id)
            if c is None:
                c = self.clients[r.client_id] = {"down": {}, "up": {}, "step": {}, "failed": False, "metrics": {}}
                self.order.append(r.client_id)
            per_step = c["step"].setdefault(step, {"down": [0, 0], "up": [0, 0]})
            for direction, sizes in (("down", r.down), ("up", r.up if r.ok else {})):
                for kind, (f, b) in sizes.items():
                    acc = c[direction].setdefault(kind, [0, 0])
                    acc[0] += f
                    acc[1] += b
                    per_step[direction][0] += f
                    per_step[direction][1] += b
            if not r.ok:
                c["failed"] = True
                continue
            for name, v in r.metrics.items():
                c["metrics"].setdefault(name, []).append(_value_weight(v))


class _Recorder:
    def __init__(self, table: ResultTable):
        self.t = table

    def round(self, round_idx: int, log: _RoundLog) -> None:
        totals = dict.fromkeys(COMM_METRICS, 0.0)
        step_totals = {s: dict.fromkeys(COMM_METRICS, 0.0) for s in log.steps}
        for cid in sorted(log.order):
            c = log.clients[cid]
            for direction in ("down", "up"):
                sizes = c[direction]
                f = sum(v[0] for v in sizes.values())
                b = sum(v[1] for v in sizes.values())
                self.t.add(round_idx, cid, "client", f"{direction}_floats", f)
                self.t.add(round_idx, cid, "client", f"{direction}_bytes", b)
                totals[f"{direction}_floats"] += f
                totals[f"{direction}_bytes"] += b
                for kind, (kf, kb) in sorted(sizes.items()):
                    self.t.add(round_idx, cid, "client", f"{direction}_floats:{kind}", kf)
                    self.t.add(round_idx, cid, "client", f"{direction}_bytes:{kind}", kb)
            for step, d in c["step"].items():
                for direction in ("down", "up"):
                    f, b = d[direction]
                    self.t.add(round_idx, cid, "client", f"{direction}_floats@{step}", f)
                    self.t.add(round_idx, cid, "client", f"{direction}_bytes@{step}", b)
                    step_totals[step][f"{direction}_floats"] += f
                    step_totals[step][f"{direction}_bytes"] += b
            if c["failed"]:
                self.t.add(round_idx, cid, "client", "failed", 1.0)
                continue
            for name, vws in sorted(c["metrics"].items()):
                if len(vws) == 1:
                    val, w = vws[0]
                else:  # a metric reported by several steps / iterations of the round: their mean
                    val, w = float(np.mean([v for v, _ in vws])), float(np.mean([w for _, w in vws]))
                self.t.add(round_idx, cid, "client", name, val, w)
        for name in COMM_METRICS:
            self.t.add(round_idx, -1, "total", name, totals[name])
        for step in log.steps:
            for name in COMM_METRICS:
                self.t.add(round_idx, -1, "total", f"{name}@{step}", step_totals[step][name])
        self.t.add(round_idx, -1, "total", "participants", sum(not c["failed"] for c in log.clients.values()))
        self.t.add(round_idx, -1, "total", "failures", sum(c["failed"] for c in log.clients.values()))

    def timing(self, round_idx: int, round_s: float, step_s: dict) -> None:
        """Wall-time rows (scope total; they differ run to run: results.without_timing drops them)."""
        self.t.add(round_idx, -1, "total", ROUND_TIME, round_s)
        for name, s in step_s.items():
            self.t.add(round_idx, -1, "total", STEP_TIME + name, s)

    def server(self, round_idx: int, metrics: dict) -> None:
        for name, v in sorted(metrics.items()):
            val, w = _value_weight(v)
            self.t.add(round_idx, -1, "server", name, val, w)

    def evaluation(self, round_idx: int, reports: list[ClientReport]) -> None:
        per_metric: dict[str, list[tuple[float, float]]] = {}
        for r in reports:
            if not r.ok:
                self.t.add(round_idx, r.client_id, "client", "eval_failed", 1.0)
                continue
            for name, v in sorted(r.metrics.items()):
                val, w = _value_weight(v)
                self.t.add(round_idx, r.client_id, "client", name, val, w)
                per_metric.setdefault(name, []).append((val, w))
        for name, vw in sorted(per_metric.items()):
            vals = np.array([v for v, _ in vw])
            ws = np.array([w for _, w in vw])
            self.t.add(round_idx, -1, "mean", name, float(vals.mean()), len(vals))
            sd = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan  # sample std over clients, as results.*
            self.t.add(round_idx, -1, "std", name, sd, len(vals))
            if ws.sum() > 0:
                self.t.add(round_idx, -1, "wmean", name, float((vals * ws).sum() / ws.sum()), float(ws.sum()))


# ----------------------------------------------------------------------------------------------------------------
# the run

class Run:
    """The driver's state of one run, handed to every callback."""

    def __init__(self, prep: Prepared, backend, run_id: str):
        self.prep, self.cfg, self.backend, self.run_id = prep, prep.cfg, backend, run_id
        self.algorithm = prep.algorithm
        self.env = prep.env
        self.table = ResultTable(run_id)
        self.recorder = _Recorder(self.table)
        self.failures: list[dict] = []
        self.timing = {"setup_s": 0.0, "round_s": [], "client_compute_s": [], "env_s": [], "setup_phase_s": 0.0}
        self.round_idx = -1  # the last finished round
        self.start_round = 0
        self.setup_done = prep.algorithm.setup_schedule() is None
        self.payload = None
        self.dir: Optional[Path] = None  # the directory being written (RunDirectory)
        self.final_dir: Optional[Path] = None
        self.stopped_early = False
        self.resume_from: Optional[dict] = None  # checkpoint meta when resuming

    def log_failures(self, reports: list[ClientReport]) -> list[ClientReport]:
        failed = [r for r in reports if not r.ok]
        for r in failed:
            self.failures.append({"round": r.round_idx, "client_id": r.client_id, "stage": r.stage, "error": r.error,
                                  "traceback": r.traceback})
        return failed

    def checkpoint_extra(self) -> dict:
        return {"rows": list(self.table.rows), "failures": list(self.failures), "resume_hash": resume_hash(self.cfg),
                "env": self.env.state_dict() if self.env is not None else None, "setup_done": self.setup_done}


class Callback:
    def on_run_start(self, run: Run) -> None: ...

    def on_setup_end(self, run: Run) -> None: ...

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool) -> Optional[bool]: ...

    def on_run_end(self, run: Run, result: RunResult) -> None: ...

    def on_run_error(self, run: Run, exc: BaseException) -> None: ...


def _run_steps(run: Run, schedule, round_idx: int, selected: list[int], step_s: dict) -> None:
    """Walk one schedule (a round's or the setup's): client steps, server steps, repeats. Adds each step's wall
    seconds (summed over its iterations) to ``step_s``."""
    cfg, backend, env = run.cfg, run.backend, run.env
    log = _RoundLog()
    uploads = None
    failures: list = []  # (client_id, reason) handed to server steps
    out_of_round: set[int] = set()  # failed, dropped or late this round: skip the round's later client steps
    keep = None
    to_commit = None  # (client ids, token) of the last client step, not yet committed
    env_seen = False
    t_env = 0.0
    compute = 0.0
    all_clients = range(cfg.data.num_clients)  # not a list: O(1) per round however large the population
    items = list(flatten(schedule))
    ahead = getattr(backend, "runs_server_step_ahead", False)
    for pos, (step, it) in enumerate(items):
        t_step = time.perf_counter()
        if isinstance(step, ClientStep):
            ids = [c for c in (all_clients if step.clients == ALL else selected) if c not in out_of_round]
            if to_commit is not None:
                backend.commit(*to_commit)
            nxt = items[pos + 1] if pos + 1 < len(items) else None
            if (ahead and nxt is not None and isinstance(nxt[0], ServerStep)
                    and not (env is not None and not env_seen and round_idx >= 0)):
                # the backend may submit the server step that follows right behind this one, without waiting for
                # the reports: its failures are this list plus the step's failed reports (computed where it runs)
                # and nothing else can change them before it (the environment decides on a round's first step)
                uploads, reports = backend.client_step(step, run.payload, round_idx, it, ids,
                                                       then=(nxt[0], list(failures), keep))
            else:
                uploads, reports = backend.client_step(step, run.payload, round_idx, it, ids)
            # committed once the uploads have been consumed too (the next server step), so that a step whose
            # uploads are lost with a node can still be run again from the previous states
            to_commit = ([r.client_id for r in reports if r.ok], step_token(round_idx, step, it))
            compute += sum(r.seconds for r in reports)
            log.add(step.name, reports)
            skipped = safety.decide(cfg.on_nonfinite, round_idx, reports, step.name)  # raises under stop
            failed = run.log_failures(reports)
            if failed and ((cfg.on_client_failure == "stop" and len(failed) > len(skipped)) or len(failed) == len(reports)):
                r = failed[0]
                raise SimulationError(f"round {round_idx}, step '{step.name}': {len(failed)} of {len(reports)} clients "
                                      f"failed; first: client {r.client_id}: {r.error}\n{r.traceback}")
            failures = sorted(set(failures) | {(r.client_id, r.error) for r in failed})
            out_of_round |= {r.client_id for r in failed}
            if env is not None and not env_seen and round_idx >= 0:
                # the environment decides once per round, on the first client step's traffic, who delivers
                env_seen = True
                t0 = time.perf_counter()
                outcome = env.outcome(round_idx, reports)
                for row in outcome.rows():
                    run.table.add(*row)
                failures, keep = sorted(set(failures) | set(outcome.failures())), list(outcome.keep)
                out_of_round |= set(r.client_id for r in reports) - set(keep)
                t_env += time.perf_counter() - t0
        else:
            payload, metrics = backend.server_step(step, round_idx, it, uploads, failures, keep=keep)
            if to_commit is not None:
                backend.commit(*to_commit)
                to_commit = None
            safety.check_metrics(round_idx, -1, step.name, metrics)
            if payload is not None:
                run.payload = payload
            run.recorder.server(round_idx, metrics)
        step_s[step.name] = step_s.get(step.name, 0.0) + time.perf_counter() - t_step
    if to_commit is not None:
        backend.commit(*to_commit)
    run.recorder.round(round_idx, log)
    run.timing["client_compute_s"].append(compute)
    run.timing["env_s"].append(t_env)


def _evaluate(run: Run, round_idx: int, step_s: dict) -> None:
    for step, it in flatten(run.algorithm.evaluation_schedule()):
        t_step = time.perf_counter()
        if isinstance(step, ClientStep):
            _, reports = run.backend.client_step(step, run.payload, round_idx, it, eval_clients(run.cfg, round_idx))
            for r in reports:
                safety.check_metrics(round_idx, r.client_id, step.name, r.metrics)
            run.recorder.evaluation(round_idx, reports)
            run.log_failures(reports)
        else:
            _, metrics = run.backend.server_step(step, round_idx, it, None, [])
            safety.check_metrics(round_idx, -1, step.name, metrics)
            run.recorder.server(round_idx, metrics)
        step_s[step.name] = step_s.get(step.name, 0.0) + time.perf_counter() - t_step


def run_loop(run: Run, callbacks: list[Callback]) -> None:
    cfg, backend, env = run.cfg, run.backend, run.env
    if not run.setup_done:
        t0 = time.perf_counter()
        step_s: dict = {}
        _run_steps(run, run.algorithm.setup_schedule(), SETUP_ROUND, list(range(cfg.data.num_clients)), step_s)
        run.setup_done = True
        run.timing["setup_phase_s"] = time.perf_counter() - t0
        run.recorder.timing(SETUP_ROUND, run.timing["setup_phase_s"], step_s)
        for cb in callbacks:
            cb.on_setup_end(run)
    run.payload = backend.initial_payload(run.start_round)
    schedule = run.algorithm.schedule()
    for round_idx in range(run.start_round, cfg.rounds):
        t0 = time.perf_counter()
        selected = sample_clients(cfg, round_idx) if env is None else env.select(round_idx, cfg.clients_per_round)
        step_s = {}
        _run_steps(run, schedule, round_idx, selected, step_s)
        evaluated = (round_idx + 1) % cfg.eval.every == 0 or round_idx == cfg.rounds - 1
        if evaluated:
            _evaluate(run, round_idx, step_s)
        run.round_idx = round_idx
        run.timing["round_s"].append(time.perf_counter() - t0)
        run.recorder.timing(round_idx, run.timing["round_s"][-1], step_s)
        stop = False
        for cb in callbacks:
            stop = bool(cb.on_round_end(run, round_idx, evaluated)) or stop
        if stop:
            run.stopped_early = True
            break


# ----------------------------------------------------------------------------------------------------------------
# callbacks

class RunDirectory(Callback):
    """Writes the run directory (see :mod:`raysim.io.rundir`): the run is built in the visible, locked
    ``<name>.incomplete`` (claimed before the backend starts) and renamed to ``<name>`` when it finishes, with
    results.parquet, config.yaml and run.json. A run that stops keeps ``<name>.incomplete`` when it holds checkpoints
    (resumable) or diverged (its run.json says where); otherwise it is removed."""

    def __init__(self, rd: "rundir.RunDir"):
        self.rd = rd

    def on_run_start(self, run: Run) -> None:
        run.dir, run.final_dir = self.rd.work, self.rd.final

    def on_run_end(self, run: Run, result: RunResult) -> None:
        cfg, d = run.cfg, self.rd.work
        digest = write_parquet(result.table, d / RESULTS_FILE, result.metadata)
        (d / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        summary = {"status": "finished", **{k: v for k, v in result.metadata.items() if k != "config"}}
        t = run.timing
        summary["timing"] = {"setup_s": t["setup_s"], "setup_phase_s": t["setup_phase_s"],
                             "total_round_s": float(np.sum(t["round_s"])),
                             "mean_round_s": float(np.mean(t["round_s"])) if t["round_s"] else math.nan,
                             "total_env_s": float(np.sum(t["env_s"])), "backend": cfg.backend.name}
        summary["store"] = getattr(run, "store_stats", [])
        summary["failures"] = run.failures
        summary["results_sha256"] = digest  # verified whenever the table is read (results.check_table)
        (d / "run.json").write_text(json.dumps(summary, indent=1, default=str))
        result.out_dir = self.rd.finalise()

    def on_run_error(self, run: Run, exc: BaseException) -> None:
        rd, cfg = self.rd, run.cfg
        resumable = find_checkpoint(rd.work) is not None
        status = ("diverged" if isinstance(exc, safety.NonFiniteError) else
                  "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        keep = resumable or status == "diverged"
        if keep:
            info = {"status": status, "run_id": run.run_id, "config_hash": cfg.config_hash(), "seed": cfg.seed,
                    "error": (str(exc).splitlines() or [type(exc).__name__])[0], "resumable": resumable,
                    "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in run.failures]}
            if isinstance(exc, safety.NonFiniteError):
                info["nonfinite"] = exc.event.record()
            (rd.work / "run.json").write_text(json.dumps(info, indent=1, default=str))
        kept = rd.abandon(keep)
        if kept is not None and hasattr(exc, "add_note"):
            if resumable:
                exc.add_note(f"checkpoints kept in {kept}; continue with: raysim run CONFIG --resume {kept}")
            else:
                exc.add_note(f"no result table was written; {kept / 'run.json'} records where the run stopped")


class Checkpointer(Callback):
    """Every ``every`` rounds (and after the setup phase, and at the end) the backend writes state shards and the
    driver writes the checkpoint's meta (result rows so far, failure log, environment state, config hash)."""

    def __init__(self, every: int):
        self.every = every

    def _save(self, run: Run, name: str, round_idx: int) -> None:
        write_checkpoint(run.dir / "checkpoints" / name, round_idx, run.backend, run.checkpoint_extra())

    def on_setup_end(self, run: Run) -> None:
        if self.every:
            self._save(run, "setup", SETUP_ROUND)

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        if self.every and (round_idx + 1) % self.every == 0:
            self._save(run, f"round_{round_idx:05d}", round_idx)
        return None

    def on_run_end(self, run: Run, result: RunResult) -> None:
        self._save(run, "final", run.round_idx)


class ProgressBar(Callback):
    def __init__(self):
        self.bar = None

    def on_run_start(self, run: Run) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=run.cfg.rounds, desc=f"{run.cfg.algorithm.name} [{run.cfg.backend.name}]", unit="round",
                        file=sys.stderr)
        if run.start_round:
            self.bar.update(run.start_round)

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        post = {}
        for m in ("test_acc", "test_acc_proto"):
            v = run.table.latest(m)
            if v is not None:
                post[m.replace("test_", "")] = f"{v:.4f}"
        if run.env is not None:
            post["sim"] = f"{run.env.sim_time:.0f}s"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        return None

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_run_end(self, run, result):
        self._close()

    def on_run_error(self, run, exc):
        self._close()


class ClusterAgreement(Callback):
    """ARI of a clustered method's assignment against the ground-truth domains, after every evaluated round.

    The driver alone holds the domains (``FederatedData.domains``: rotation index or data source); the methods never
    see them. A clustered method reports each evaluated client's cluster as the client metric ``cluster``; this
    callback reads those rows and writes scikit-learn's ``adjusted_rand_score(domains, clusters)`` over the evaluated
    clients as the server-scope metric ``ari`` (weight: the number of clients). It runs before the checkpointer, so
    checkpoints (and a resume) carry the row."""

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        domains = run.prep.fed_data.domains
        if not evaluated or domains is None:
            return None
        clusters = {}
        for row in reversed(run.table.rows):
            if row[1] != round_idx:
                break
            if row[3] == "client" and row[4] == "cluster":
                clusters[row[2]] = int(row[5])
        if clusters:
            from sklearn.metrics import adjusted_rand_score

            ids = sorted(clusters)
            ari = adjusted_rand_score([domains[c] for c in ids], [clusters[c] for c in ids])
            run.table.add(round_idx, -1, "server", "ari", float(ari), len(ids))
        return None


class EvalCallback(Callback):
    """``fn(round_idx, table) -> stop?`` after every evaluated round (the tuning monitor's interface)."""

    def __init__(self, fn: Callable[[int, ResultTable], bool]):
        self.fn = fn

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        return bool(self.fn(round_idx, run.table)) if evaluated else None


# ----------------------------------------------------------------------------------------------------------------
# entry point

META_NAME = "meta.pt"


def _resume_point(cfg: ExperimentConfig, resume: str | Path) -> tuple[Path, Path, dict]:
    """The run directory to continue, its latest complete checkpoint and that checkpoint's meta."""
    path = Path(resume)
    if not path.exists() and rundir.work_path(path).is_dir():  # the intended name of an unfinished run
        path = rundir.work_path(path)
    ck = find_checkpoint(path) if path.is_dir() else None
    if ck is None:
        raise ConfigError("resume", f"no checkpoints under {path} (runs keep them with output.checkpoint_every > 0)")
    meta = read_checkpoint_meta(ck)
    if not isinstance(meta, dict) or not isinstance(meta.get("extra"), dict):
        from raysim.data.datasets import DamagedFileError

        raise DamagedFileError(ck / "meta.pt", "it does not hold a raysim checkpoint's meta",
                               f"remove {ck} to resume from the checkpoint before it, or start the run again")
    if (meta.get("extra") or {}).get("resume_hash") != resume_hash(cfg):
        raise ConfigError("resume", f"{ck} was written by a different configuration (only rounds may change)")
    manifest = meta.get("manifest") or {}
    shards = [manifest.get("server")] + list(manifest.get("clients") or [])
    if (ck / "server_clients.pt").exists():
        shards.append("server_clients.pt")
    from raysim.engine.store import load_file

    for name in shards:  # every shard must load before a run directory is claimed (a damaged one: one line)
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            from raysim.data.datasets import DamagedFileError

            raise DamagedFileError(ck / META_NAME, f"it lists a shard {name!r} that is not a file name in {ck}",
                                   f"remove {ck} to resume from the checkpoint before it, or start the run again")
        if not (ck / name).is_file():
            from raysim.data.datasets import DamagedFileError

            raise DamagedFileError(ck / str(name), "a shard the checkpoint's meta.pt lists is missing",
                                   f"remove {ck} to resume from the checkpoint before it, or start the run again")
        load_file(ck / name, (meta.get("sha256") or {}).get(name))
    return ck.parent.parent, ck, meta


def run_experiment(cfg: ExperimentConfig, out_dir: Optional[str | Path] = None, progress: Optional[bool] = None,
                   callback: Optional[Callable[[int, ResultTable], bool]] = None, write: bool = True,
                   resume: Optional[str | Path] = None, callbacks: Optional[list[Callback]] = None) -> RunResult:
    """Run one experiment. ``callback(round_idx, table) -> stop?`` is called after every evaluated round;
    ``callbacks`` are :class:`Callback` objects (loggers, custom stopping rules).

    With ``output.checkpoint_every`` > 0 a run that fails keeps its checkpoints in ``<run dir>.incomplete``;
    ``resume=`` that directory continues from its latest checkpoint and gives the same table as an uninterrupted run.
    """
    check_path_component("name", cfg.name)  # also for configs built without validation (it names directories)
    run_id = cfg.run_id()
    target, where = (Path(out_dir), "--out") if out_dir else (Path(cfg.output.dir) / run_id, "output.dir")
    if write and resume is None:  # a bad or busy output directory fails before any data is loaded
        rundir.check_writable(target, where)
        rundir.check_free(target, where)
    prep = prepare(cfg)
    resume_meta = ck_dir = None
    rd = None
    if resume is not None:
        resume_dir, ck_dir, resume_meta = _resume_point(cfg, resume)
        rd = rundir.RunDir.for_resume(resume_dir, out_dir)
        ck_dir = rd.work / ck_dir.relative_to(resume_dir)  # a finished run's checkpoints were copied
        write = True
    elif write:
        rd = rundir.RunDir.claim(target, where)
    cbs: list[Callback] = [ClusterAgreement()]  # first: its rows belong to the round the checkpointer saves
    if rd is not None:
        (rd.work / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        cbs += [RunDirectory(rd), Checkpointer(cfg.output.checkpoint_every)]
    if cfg.output.progress if progress is None else progress:
        cbs.append(ProgressBar())
    if callback is not None:
        cbs.append(EvalCallback(callback))
    cbs += list(callbacks or [])

    backend = make_backend(cfg.backend.name, prep.spec, prep.fed_data)
    run = Run(prep, backend, run_id)
    started: list[Callback] = cbs[1:2] if rd is not None else []  # the claimed directory is cleaned up on any error
    try:
        t0 = time.perf_counter()
        backend.start()
        run.timing["setup_s"] = time.perf_counter() - t0
        if resume_meta is not None:
            _restore(run, ck_dir, resume_meta)
        for cb in cbs:
            if cb not in started:
                started.append(cb)
            cb.on_run_start(run)
        run_loop(run, cbs)
        run.store_stats = backend.store_stats()
        if getattr(backend, "balance_log", None):
            run.timing["balance"] = backend.balance_log  # cost-aware placement: per-step loads and moves
        result = RunResult(run_id, None, run.table.frame(), _metadata(run), run.timing)
        for cb in reversed(cbs):
            cb.on_run_end(run, result)
        return result
    except BaseException as exc:
        for cb in reversed(started):
            try:
                cb.on_run_error(run, exc)
            except Exception:  # never hide the run's own error
                pass
        raise
    finally:
        backend.shutdown()


def _restore(run: Run, ck_dir: Path, meta: dict) -> None:
    from raysim.data.datasets import DamagedFileError

    try:
        _restore_from(run, ck_dir, meta)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        if isinstance(e, DamagedFileError):
            raise
        raise DamagedFileError(Path(ck_dir) / "meta.pt", f"it does not hold a raysim checkpoint ({type(e).__name__}: "
                               f"{e})", f"remove {ck_dir} to resume from the checkpoint before it, or start the run "
                               f"again") from None


def _restore_from(run: Run, ck_dir: Path, meta: dict) -> None:
    extra = meta["extra"]
    run.backend.load_checkpoint(str(ck_dir), meta["manifest"])
    run.table.rows = [(run.run_id, *r[1:]) for r in extra["rows"]]  # run_id changes when rounds were extended
    run.failures = list(extra["failures"])
    if run.env is not None and extra.get("env") is not None:
        run.env.load_state_dict(extra["env"])
    run.setup_done = bool(extra.get("setup_done", True))
    run.start_round = int(meta["round_idx"]) + 1
    run.round_idx = int(meta["round_idx"])


def _metadata(run: Run) -> dict:
    cfg = run.cfg
    meta = {
        "run_id": run.run_id,
        "config": to_dict(cfg),
        "config_hash": cfg.config_hash(),
        "seed": cfg.seed,
        "versions": versions(),
        "data": run.prep.fed_data.summary(),  # data.domains: the ground truth of ClusterAgreement
        "data_notes": run.prep.fed_data.notes,
        "stopped_early": run.stopped_early,
        "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in run.failures],
        "equality_policy": EQUALITY_POLICY,
        "actor_failures": list(getattr(run.backend, "actor_failures", [])),
        "schedule": [f"{type(s).__name__}:{s.name}" + (f"#{i}" if i else "") for s, i in flatten(run.algorithm.schedule())],
    }
    if run.algorithm.setup_schedule() is not None:
        meta["setup_schedule"] = [f"{type(s).__name__}:{s.name}" for s, _ in flatten(run.algorithm.setup_schedule())]
    if run.env is not None:
        meta["env"] = run.env.summary()
    return meta
