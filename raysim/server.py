"""The federated round loop (the server's control flow), independent of the backend that executes it.

``run_experiment`` validates everything (config, data, algorithm, resources) before any Ray process starts, runs the
rounds, and writes the run directory atomically: results.parquet, config.yaml, run.json and checkpoints/. A failure
leaves no partial run directory behind.
"""
from __future__ import annotations

import json
import math
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
from raysim import rundir, safety
from raysim.algorithm import Task
from raysim.backends import make_backend, preflight
from raysim.config import ConfigError, ExperimentConfig, to_dict
from raysim.data.federated import FederatedData, build_federated_data
from raysim.models import client_archs
from raysim.registry import algorithm_class, algorithm_target, make_environment
from raysim.results import RESULTS_FILE, ResultTable, write_parquet
from raysim.runtime import ClientReport, RunSpec, SimulationError
from raysim.state import load_checkpoint, save_checkpoint

COMM_METRICS = ("up_floats", "up_bytes", "down_floats", "down_bytes")


@dataclass
class Prepared:
    cfg: ExperimentConfig
    fed_data: FederatedData
    task: Task
    spec: RunSpec
    env: Any = None  # envs.Environment when the config has an env section


def prepare(cfg: ExperimentConfig) -> Prepared:
    """Everything that can be checked before a run starts, cheapest first: algorithm and model parameters, then the
    data (loading and partitioning), then the algorithm against the task, then the resources the backend needs."""
    from raysim.config import from_dict
    from raysim.models import ARCHS, arch_key, arch_params, build_model

    algo_cls = algorithm_class(cfg.algorithm.name)
    from_dict(algo_cls.Params, dict(cfg.algorithm.params or {}), "algorithm.params")
    specs = [("model", cfg.model)] if cfg.model.per_client is None else [
        (f"model.per_client[{i}]", s) for i, s in enumerate(cfg.model.per_client)]
    for path, spec in specs:
        if spec.arch not in ARCHS:
            raise ConfigError(f"{path}.arch", f"{spec.arch!r} is not allowed; choose one of: {', '.join(ARCHS)}")
        for k in spec.params:
            if k not in arch_params(spec.arch):
                raise ConfigError(f"{path}.params.{k}", f"unknown parameter for {spec.arch}; allowed: "
                                                         f"{', '.join(arch_params(spec.arch))}")
    fed = build_federated_data(cfg.data, cfg.seed)
    env = make_environment(cfg, fed)  # None without an env section
    env_tiers = env is not None and cfg.model.assign == "tier" and getattr(cfg.model, "tiers", None) is None
    archs = tuple(env.archs(cfg.model) if env_tiers else client_archs(cfg.model, cfg.data.num_clients))
    task = Task(fed.num_classes, tuple(fed.input_shape), cfg.data.num_clients, archs, cfg.train, cfg.seed, cfg.rounds,
                fed.public)
    seen = set()
    for i, spec in enumerate(archs):  # build each architecture once: bad values fail here, naming the field
        if arch_key(spec) not in seen:
            seen.add(arch_key(spec))
            path = "model" if cfg.model.per_client is None else f"model.per_client[{i % len(cfg.model.per_client)}]"
            try:
                build_model(spec, task.input_shape, task.num_classes, path)
            except (TypeError, ValueError, RuntimeError) as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(f"{path}.params", f"cannot build {spec.arch} with {spec.params}: {e}") from None
    algo_cls.from_config(cfg.algorithm.params, task)
    preflight(cfg)
    if env is not None:
        env.bind(task)
    return Prepared(cfg, fed, task, RunSpec(cfg, task, algorithm_target(cfg.algorithm.name)), env)


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


@dataclass
class RunResult:
    run_id: str
    out_dir: Optional[Path]
    table: pd.DataFrame
    metadata: dict
    timing: dict = field(default_factory=dict)

    def final(self, metric: str = "test_acc") -> tuple[float, float]:
        """(mean, sample std over clients) of ``metric`` at the last evaluated round, as ``results.final``."""
        d = self.table[(self.table["scope"] == "client") & (self.table["metric"] == metric)]
        last = d[d["round"] == d["round"].max()]["value"]
        return float(last.mean()), float(last.std(ddof=1))


def _value_weight(v):
    if isinstance(v, (tuple, list)):
        return float(v[0]), float(v[1])
    return float(v), 1.0


class _Recorder:
    def __init__(self, table: ResultTable):
        self.t = table

    def updates(self, round_idx: int, reports: list[ClientReport]) -> None:
        totals = dict.fromkeys(COMM_METRICS, 0.0)
        for r in reports:
            cid = r.client_id
            for direction, sizes in (("down", r.down), ("up", r.up if r.ok else {})):
                f = sum(v[0] for v in sizes.values())
                b = sum(v[1] for v in sizes.values())
                self.t.add(round_idx, cid, "client", f"{direction}_floats", f)
                self.t.add(round_idx, cid, "client", f"{direction}_bytes", b)
                totals[f"{direction}_floats"] += f
                totals[f"{direction}_bytes"] += b
                for kind, (kf, kb) in sorted(sizes.items()):
                    self.t.add(round_idx, cid, "client", f"{direction}_floats:{kind}", kf)
                    self.t.add(round_idx, cid, "client", f"{direction}_bytes:{kind}", kb)
            if not r.ok:
                self.t.add(round_idx, cid, "client", "failed", 1.0)
                continue
            for name, v in sorted(r.metrics.items()):
                val, w = _value_weight(v)
                self.t.add(round_idx, cid, "client", name, val, w)
        for name in COMM_METRICS:
            self.t.add(round_idx, -1, "total", name, totals[name])
        self.t.add(round_idx, -1, "total", "participants", sum(r.ok for r in reports))
        self.t.add(round_idx, -1, "total", "failures", sum(not r.ok for r in reports))

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


INCOMPLETE = rundir.INCOMPLETE


def _resume_point(cfg: ExperimentConfig, resume: str | Path) -> tuple[Path, dict]:
    """The run directory to continue and its latest checkpoint, checked against the config."""
    path = Path(resume)
    if not path.exists() and rundir.work_path(path).is_dir():  # the intended name of an unfinished run
        path = rundir.work_path(path)
    ckpts = sorted(path.glob("checkpoints/round_*.pt")) if path.is_dir() else [path]
    if not ckpts or not ckpts[-1].exists():
        raise ConfigError("resume", f"no checkpoints under {path} (runs keep them with output.checkpoint_every > 0)")
    ck = load_checkpoint(ckpts[-1])
    extra = ck.get("extra") or {}
    if extra.get("resume_hash") != _resume_hash(cfg):
        raise ConfigError("resume", f"{ckpts[-1]} was written by a different configuration (only rounds may change)")
    run_dir = ckpts[-1].parent.parent
    return run_dir, ck


def _resume_hash(cfg: ExperimentConfig) -> str:
    import hashlib

    d = cfg.science_dict()
    d.pop("rounds", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def run_experiment(cfg: ExperimentConfig, out_dir: Optional[str | Path] = None, progress: Optional[bool] = None,
                   callback: Optional[Callable[[int, ResultTable], bool]] = None, write: bool = True,
                   resume: Optional[str | Path] = None) -> RunResult:
    """Run one experiment. ``callback(round_idx, table) -> stop?`` is called after every evaluated round.

    The run is built in the visible ``<run dir>.incomplete`` (locked while it runs; see :mod:`raysim.rundir`) and
    renamed to ``<run dir>`` when it finishes. A run that stops without finishing keeps ``<run dir>.incomplete`` when
    it holds checkpoints (``output.checkpoint_every`` > 0) or when it diverged (its run.json says where);
    ``resume=`` that directory continues from its latest checkpoint, finishes into ``<run dir>`` (or ``out_dir``) and
    gives the same table as an uninterrupted run.
    """
    run_id = cfg.run_id()
    target, where = (Path(out_dir), "--out") if out_dir else (Path(cfg.output.dir) / run_id, "output.dir")
    if write and resume is None:  # a bad or busy output directory fails before any data is loaded
        rundir.check_writable(target, where)
        rundir.check_free(target, where)
    prep = prepare(cfg)
    ck, rd = None, None
    if resume is not None:
        resume_dir, ck = _resume_point(cfg, resume)
        rd = rundir.RunDir.for_resume(resume_dir, out_dir)
        write = True
    elif write:
        rd = rundir.RunDir.claim(target, where)
    tmp_dir = rd.work if rd is not None else None
    if tmp_dir is not None:
        (tmp_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    table = ResultTable(run_id)
    rec = _Recorder(table)
    failures_log: list[dict] = []
    start_round = 0
    timing = {"setup_s": 0.0, "round_s": [], "client_compute_s": [], "env_s": []}
    env = prep.env
    show = cfg.output.progress if progress is None else progress
    bar = None
    backend = make_backend(cfg.backend.name, prep.spec, prep.fed_data)
    t_setup = time.perf_counter()
    try:
        backend.start()
        timing["setup_s"] = time.perf_counter() - t_setup
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.rounds, desc=f"{cfg.algorithm.name} [{cfg.backend.name}]", unit="round", file=sys.stderr)
        if ck is not None:
            backend.set_state(ck["server_state"], ck["client_states"])
            extra = ck["extra"]
            table.rows = [(run_id, *r[1:]) for r in extra["rows"]]  # run_id changes when rounds were extended
            failures_log = list(extra["failures"])
            if env is not None and extra.get("env") is not None:
                env.load_state_dict(extra["env"])
            start_round = int(ck["round_idx"]) + 1
            if bar is not None:
                bar.update(start_round)
        payload = backend.broadcast(start_round)
        all_clients = list(range(cfg.data.num_clients))
        stop = False
        round_idx = start_round - 1
        for round_idx in range(start_round, cfg.rounds):
            t0 = time.perf_counter()
            selected = sample_clients(cfg, round_idx) if env is None else env.select(round_idx, cfg.clients_per_round)
            env_s = time.perf_counter() - t0
            uploads, reports = backend.client_updates(payload, round_idx, selected)
            rec.updates(round_idx, reports)
            skipped = safety.decide(cfg.on_nonfinite, round_idx, reports)  # raises under on_nonfinite: stop
            failed = [r for r in reports if not r.ok]
            for r in failed:
                failures_log.append({"round": round_idx, "client_id": r.client_id, "stage": r.stage, "error": r.error,
                                     "traceback": r.traceback})
            if failed and ((cfg.on_client_failure == "stop" and len(failed) > len(skipped)) or len(failed) == len(reports)):
                r = failed[0]
                raise SimulationError(f"round {round_idx}: {len(failed)} of {len(reports)} clients failed; first: client "
                                      f"{r.client_id} in stage '{r.stage}': {r.error}\n{r.traceback}")
            failures, keep = [(r.client_id, r.error) for r in failed], None
            if env is not None:  # simulated times; dropped and late uploads never reach the algorithm
                t_env = time.perf_counter()
                outcome = env.outcome(round_idx, reports)
                for row in outcome.rows():
                    table.add(*row)
                failures, keep = sorted(failures + outcome.failures()), outcome.keep
                env_s += time.perf_counter() - t_env
            if keep is None or keep:  # a round in which nobody delivered leaves the server state as it was
                agg_metrics = backend.aggregate(round_idx, uploads, failures, keep=keep)
                safety.check_metrics(round_idx, -1, "aggregate", agg_metrics)
                rec.server(round_idx, agg_metrics)
            payload = backend.broadcast(round_idx + 1)  # the next round's payload; also what evaluation uses
            evaluated = (round_idx + 1) % cfg.eval.every == 0 or round_idx == cfg.rounds - 1
            if evaluated:
                ev = backend.evaluate_clients(payload, round_idx, all_clients)
                for r in ev:
                    safety.check_metrics(round_idx, r.client_id, "evaluate", r.metrics)
                rec.evaluation(round_idx, ev)
                for r in ev:
                    if not r.ok:
                        failures_log.append({"round": round_idx, "client_id": r.client_id, "stage": r.stage,
                                             "error": r.error, "traceback": r.traceback})
                srv_metrics = backend.evaluate_server(round_idx)
                safety.check_metrics(round_idx, -1, "evaluate_server", srv_metrics)
                rec.server(round_idx, srv_metrics)
            timing["round_s"].append(time.perf_counter() - t0)
            timing["client_compute_s"].append(sum(r.seconds for r in reports))
            timing["env_s"].append(env_s if env is not None else 0.0)
            if write and cfg.output.checkpoint_every and (round_idx + 1) % cfg.output.checkpoint_every == 0:
                s, c = backend.get_state()
                save_checkpoint(tmp_dir / "checkpoints" / f"round_{round_idx:05d}.pt", round_idx, s, c, {
                    "rows": list(table.rows), "failures": failures_log, "resume_hash": _resume_hash(cfg),
                    "env": env.state_dict() if env is not None else None})
            if bar is not None:
                post = {}
                for m in ("test_acc", "test_acc_proto"):
                    v = table.latest(m)
                    if v is not None:
                        post[m.replace("test_", "")] = f"{v:.4f}"
                if env is not None:
                    post["sim"] = f"{env.sim_time:.0f}s"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if evaluated and callback is not None and callback(round_idx, table):
                stop = True
                break
        if write:
            s, c = backend.get_state()
            save_checkpoint(tmp_dir / "checkpoints" / "final.pt", round_idx, s, c)
    except BaseException as exc:
        if rd is not None:
            _stopped(rd, exc, run_id, cfg, failures_log)
        raise
    finally:
        if bar is not None:
            bar.close()
        backend.shutdown()

    df = table.frame()
    meta = {
        "run_id": run_id,
        "config": to_dict(cfg),
        "config_hash": cfg.config_hash(),
        "seed": cfg.seed,
        "versions": versions(),
        "data": prep.fed_data.summary(),
        "data_notes": prep.fed_data.notes,
        "stopped_early": stop,
        "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in failures_log],
    }
    if env is not None:
        meta["env"] = env.summary()
    result = RunResult(run_id, None, df, meta, timing)
    if write:
        write_parquet(df, tmp_dir / RESULTS_FILE, meta)
        (tmp_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        summary = {"status": "finished", **{k: v for k, v in meta.items() if k != "config"}}
        summary["timing"] = {"setup_s": timing["setup_s"], "total_round_s": float(np.sum(timing["round_s"])),
                             "mean_round_s": float(np.mean(timing["round_s"])) if timing["round_s"] else math.nan,
                             "total_env_s": float(np.sum(timing["env_s"])),
                             "backend": cfg.backend.name}
        summary["failures"] = failures_log
        (tmp_dir / "run.json").write_text(json.dumps(summary, indent=1, default=str))
        result.out_dir = rd.finalise()
    return result


def _stopped(rd: "rundir.RunDir", exc: BaseException, run_id: str, cfg: ExperimentConfig, failures_log: list) -> None:
    """A run stopped before its end: keep its visible working directory when it holds checkpoints (resumable) or
    when it diverged (run.json records where), with a run.json saying why; otherwise remove it."""
    resumable = rundir.has_checkpoints(rd.work)
    status = ("diverged" if isinstance(exc, safety.NonFiniteError) else
              "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
    keep = resumable or status == "diverged"
    if keep:
        info = {"status": status, "run_id": run_id, "config_hash": cfg.config_hash(), "seed": cfg.seed,
                "error": (str(exc).splitlines() or [type(exc).__name__])[0], "resumable": resumable,
                "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in failures_log]}
        if isinstance(exc, safety.NonFiniteError):
            info["nonfinite"] = exc.event.record()
        (rd.work / "run.json").write_text(json.dumps(info, indent=1, default=str))
    kept = rd.abandon(keep)
    if kept is not None and hasattr(exc, "add_note"):
        if resumable:
            exc.add_note(f"checkpoints kept in {kept}; continue with: raysim run CONFIG --resume {kept}")
        else:
            exc.add_note(f"no result table was written; {kept / 'run.json'} records where the run stopped")
