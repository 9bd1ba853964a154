"""The driver's round loop: ``run_experiment`` validates a run once (:mod:`raysim.engine.prepare`), then walks the
algorithm's step schedules round by round against a backend, recording rows (:mod:`raysim.engine.run_record`) and calling
the callbacks (:mod:`raysim.engine.callbacks`).

``run_experiment`` is a small loop; everything around it (the run directory, checkpoints, the progress bar, tuning
reports, user loggers) is a :class:`~raysim.engine.callbacks.Callback`, called at the points the callbacks module
lists; pass your own with ``run_experiment(cfg, callbacks=[...])``.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from raysim import numerics
from raysim.algorithm import upload_merger
from raysim import rng as rngmod
from raysim.io import rundir
from raysim.runner import safety
from raysim.engine.backend import BackendReport, Follow, NextServerStep, make_backend
from raysim.config import ExperimentConfig, check_path_component, to_dict
from raysim.errors import ConfigError, SimulationError
from raysim.runner.fallbacks import Fallback
from raysim.runner.step_reports import step_token
from raysim.io.checkpoints import find_checkpoint, read_checkpoint_meta
from raysim.io.resume_points import damaged_hint
from raysim.io.tables import Row
from raysim.steps import ALL, ClientStep, ServerStep, flatten
from raysim.engine.callbacks import Callback, Checkpointer, ClusterAgreement, RunDirectory, progress_callback
from raysim.engine.prepare import Prepared, prepare, resume_hash, versions
from raysim.engine.run_record import SETUP_ROUND, Run, RunResult, RoundLog, failure_summary


EQUALITY_POLICY = {
    "bit_identical": "CPU, the per-client loop executor, backend.torch_threads = 1: the same table on every backend, "
                     "actor count, state_memory_mb setting and after a resume, but for the wall-time rows (round_s, "
                     "step_s@<step>; results.without_timing drops them); with backend.numerics = portable (the "
                     "default) also on every machine whose CPU has AVX2, with the same torch and numpy versions",
    "tolerance": "vectorised executors, partial aggregates (backend.partial_aggregate) over several actors and GPU "
                 "runs: metrics within 1e-4 absolute of the CPU reference on short "
                 "runs (not bit-identical: kernels reorder floating-point sums); over long runs the trajectories "
                 "separate as runs on two CPU models do: compare by means over clients and seeds",
}


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


def _merge_into(run: Run, step, nxt) -> Optional[ServerStep]:
    """The server step a client step's uploads feed as partial aggregates (``backend.partial_aggregate``, or a backend
    with one client runner): the next
    step, when it is a training server step whose merge applies to this method (``upload_merger``), and no
    environment decides after the step which uploads arrive (a merged upload cannot be split again)."""
    # auto: one client runner (the sequential backend, Ray with one actor), whose merged upload is exactly what the
    # server would compute from the per-client ones (tests/test_partial_aggregate.py)
    mode = run.cfg.backend.partial_aggregate
    on = mode is True or (mode == "auto" and run.backend.client_runners == 1)
    if not on or run.env is not None or step.mode != "train" or nxt is None:
        return None
    server = nxt[0]
    if not isinstance(server, ServerStep) or server.mode != "train" or upload_merger(run.algorithm, server) is None:
        return None
    return server


def _run_steps(run: Run, schedule, round_idx: int, selected: list[int], step_s: dict) -> None:
    """Walk one schedule (a round's or the setup's): client steps, server steps, repeats. Adds each step's wall
    seconds (summed over its iterations) to ``step_s``."""
    walk = _RoundWalk(run, round_idx, selected, list(flatten(schedule)))
    for pos, (step, it) in enumerate(walk.items):
        t_step = time.perf_counter()
        if isinstance(step, ClientStep):
            walk.client(pos, step, it)
        else:
            walk.server(step, it)
        step_s[step.name] = step_s.get(step.name, 0.0) + time.perf_counter() - t_step
    walk.finish()


@dataclass
class _RoundWalk:
    """One walk through a schedule: what its steps hand on to the next ones."""

    run: Run
    round_idx: int
    selected: list
    items: list
    log: RoundLog = field(default_factory=RoundLog)
    uploads: object = None
    failures: list = field(default_factory=list)  # (client_id, reason) handed to server steps
    out_of_round: set = field(default_factory=set)  # failed, dropped or late: skip the round's later client steps
    keep: Optional[list] = None  # the uploads the environment delivered (None: all)
    to_commit: Optional[tuple] = None  # (client ids, token) of the last client step, not yet committed
    env_seen: bool = False
    t_env: float = 0.0
    compute: float = 0.0

    def _env_pending(self) -> bool:
        """The environment decides once per round, on the round's first client step."""
        return self.run.env is not None and not self.env_seen and self.round_idx >= 0

    def client(self, pos: int, step: ClientStep, it: int) -> None:
        run, backend = self.run, self.run.backend
        everyone = range(run.cfg.data.num_clients)  # not a list: O(1) per round however large the population
        ids = [c for c in (everyone if step.clients == ALL else self.selected) if c not in self.out_of_round]
        if self.to_commit is not None:
            backend.commit(*self.to_commit)
        nxt = self.items[pos + 1] if pos + 1 < len(self.items) else None
        merge = _merge_into(run, step, nxt)
        server = None
        if nxt is not None and isinstance(nxt[0], ServerStep) and not self._env_pending():
            # the server step that follows, as it will be called: its failures are this list plus the step's failed
            # reports, and nothing else can change them before it (the environment decides on a round's first
            # step); a backend may start it early
            server = NextServerStep(nxt[0], list(self.failures), self.keep)
        follow = Follow(merge, server)
        self.uploads, reports = backend.client_step(step, run.payload, self.round_idx, it, ids, follow)
        # committed once the uploads have been consumed too (the next server step), so that a step whose uploads
        # are lost with a node can still be run again from the previous states
        self.to_commit = ([r.client_id for r in reports if r.ok], step_token(self.round_idx, step, it))
        self.compute += sum(r.seconds for r in reports)
        self.log.add(step.name, reports)
        self._failures(step, reports)
        if self._env_pending():
            self._environment(reports)

    def _failures(self, step: ClientStep, reports: list) -> None:
        cfg, round_idx = self.run.cfg, self.round_idx
        skipped = safety.decide(cfg.on_nonfinite, round_idx, reports, step.name)  # raises under stop
        failed = self.run.log_failures(reports)
        if failed and ((cfg.on_client_failure == "stop" and len(failed) > len(skipped)) or len(failed) == len(reports)):
            r = failed[0]
            raise SimulationError(f"round {round_idx}, step '{step.name}': {len(failed)} of {len(reports)} clients "
                                  f"failed; first: client {r.client_id}: {r.error}\n{r.traceback}")
        own = [r for r in failed if not str(r.error).startswith("ActorDied:")]  # dead actors: on_actor_failure's
        if own and len(own) > cfg.max_failed_share * len(reports):
            r = own[0]
            raise SimulationError(f"round {round_idx}, step '{step.name}': {len(failed)} of {len(reports)} clients "
                                  f"failed, more than max_failed_share={cfg.max_failed_share:g} of them, so the run "
                                  f"stops rather than aggregate the rest (first: client {r.client_id}: "
                                  f"{r.error.splitlines()[0] if r.error else '?'}); fix the cause, or raise "
                                  f"max_failed_share")
        self.failures = sorted(set(self.failures) | {(r.client_id, r.error) for r in failed})
        self.out_of_round |= {r.client_id for r in failed}

    def _environment(self, reports: list) -> None:
        """Who delivers this round (the environment's outcome on the first client step's traffic)."""
        self.env_seen = True
        t0 = time.perf_counter()
        outcome = self.run.env.outcome(self.round_idx, reports)
        for row in outcome.rows():
            self.run.table.add(*row)
        self.failures, self.keep = sorted(set(self.failures) | set(outcome.failures())), list(outcome.keep)
        self.out_of_round |= set(r.client_id for r in reports) - set(self.keep)
        self.t_env += time.perf_counter() - t0

    def server(self, step: ServerStep, it: int) -> None:
        run, backend = self.run, self.run.backend
        payload, metrics = backend.server_step(step, self.round_idx, it, self.uploads, self.failures, keep=self.keep)
        if self.to_commit is not None:
            backend.commit(*self.to_commit)
            self.to_commit = None
        safety.check_metrics(self.round_idx, -1, step.name, metrics)
        if payload is not None:
            run.payload = payload
        run.recorder.server(self.round_idx, metrics)

    def finish(self) -> None:
        if self.to_commit is not None:
            self.run.backend.commit(*self.to_commit)
        self.run.recorder.round(self.round_idx, self.log)
        self.run.timing["client_compute_s"].append(self.compute)
        self.run.timing["env_s"].append(self.t_env)


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
    if cfg.server.mode == "async":  # the event-driven server on the simulated clock
        from raysim.engine.async_loop import run_async

        return run_async(run, callbacks, _evaluate)
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
    trained = run.start_round > 0  # a resumed run trained before its checkpoint (a fresh one: in some round below)
    for round_idx in range(run.start_round, cfg.rounds):
        t0 = time.perf_counter()
        selected = sample_clients(cfg, round_idx) if env is None else env.select(round_idx, cfg.clients_per_round)
        trained = trained or bool(selected)
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
    if not trained and run.round_idx >= 0:
        _nobody_trained(run)


def _nobody_trained(run: Run) -> None:
    """A sync run whose environment left every round empty (no client available when a round started) trained
    nothing: its table is the initial model's, so it stops with one line rather than finish as a result (issue 50)."""
    n = run.round_idx + 1
    raise SimulationError(f"no client ever trained: the environment had no client available in any of the {n} "
                          f"round{'s' if n != 1 else ''} (env.participation.availability), so the table would only "
                          f"evaluate the initial model; make clients available (availability p, its trace) or run "
                          f"more rounds")


META_NAME = "meta.pt"


def _loop_made_hint(cfg: ExperimentConfig, stored) -> str:
    """Where ``backend.vectorize: auto`` now trains a method's clients together (MAFML on a CPU) and a checkpoint was
    made by its per-client steps (before that, or with ``vectorize: false``): say how to resume it."""
    if cfg.backend.vectorize != "auto" or not cfg.vectorizes():
        return ""
    from raysim.config import make_config

    d = to_dict(cfg)
    d["backend"]["vectorize"] = False
    return (f"; it was made by the per-client steps, which backend.vectorize: auto no longer picks for "
            f"{cfg.algorithm.name} here: resume it with --set backend.vectorize=false"
            if stored == resume_hash(make_config(d)) else "")


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
        from raysim.errors import DamagedFileError

        raise DamagedFileError(ck / "meta.pt", "it does not hold a raysim checkpoint's meta",
                               damaged_hint(ck))
    stored = (meta.get("extra") or {}).get("resume_hash")
    if stored != resume_hash(cfg):
        raise ConfigError("resume", f"{ck} was written by a different configuration (only rounds may change)"
                                    f"{_loop_made_hint(cfg, stored)}")
    done = int(meta.get("round_idx", -1)) + 1
    if cfg.rounds < done:  # the run's config and id would say fewer rounds than its table holds
        raise ConfigError("rounds", f"{cfg.rounds} is fewer than the {done} rounds the checkpoint {ck} already holds; "
                                    f"--resume continues a run (rounds >= {done}), it never shortens one")
    manifest = meta.get("manifest") or {}
    shards = [manifest.get("server")] + list(manifest.get("clients") or [])
    if cfg.server.mode == "async":  # the event loop's state and the messages of its clients in flight
        from raysim.errors import DamagedFileError

        if not isinstance(meta["extra"].get("async"), dict) or "async" not in manifest:
            raise DamagedFileError(ck / META_NAME, "it holds no async server state (server.mode: async needs the "
                                                   "clients in flight)", damaged_hint(ck))
        shards.append(manifest["async"])
    from raysim.io.files import load_file

    for name in shards:  # every shard must load before a run directory is claimed (a damaged one: one line)
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            from raysim.errors import DamagedFileError

            raise DamagedFileError(ck / META_NAME, f"it lists a shard {name!r} that is not a file name in {ck}",
                                   damaged_hint(ck))
        if not (ck / name).is_file():
            from raysim.errors import DamagedFileError

            raise DamagedFileError(ck / str(name), "a shard the checkpoint's meta.pt lists is missing",
                                   damaged_hint(ck))
        load_file(ck / name, (meta.get("sha256") or {}).get(name))
    return ck.parent.parent, ck, meta


def run_experiment(cfg: ExperimentConfig, *, out_dir: Optional[str | Path] = None,
                   progress: bool | str | None = None, write: bool = True, resume: Optional[str | Path] = None,
                   callbacks: Optional[list[Callback]] = None, prepared: Optional[Prepared] = None) -> RunResult:
    """Run one experiment; every argument after the config is a keyword. ``callbacks`` are :class:`Callback` objects
    (loggers, custom stopping rules; a plain ``fn(round_idx, table) -> stop?`` after every evaluated round is
    ``EvalCallback(fn)``). ``prepared``: the result of ``prepare(cfg)`` when the caller already has it
    (``sweep.run_seeds`` checks every seed first). ``progress``: None takes ``output.progress``; True or ``"auto"``
    a bar on a terminal and one line per evaluated round otherwise; ``"bar"``, ``"lines"``; False none.
    ``output.tensorboard`` / ``output.mlflow`` add the trackers
    (:mod:`raysim.engine.tracking`), checked before anything is claimed.

    With ``output.checkpoint_every`` > 0 a run that fails keeps its checkpoints in ``<run dir>.incomplete``;
    ``resume=`` that directory continues from its latest checkpoint and gives the same table as an uninterrupted run.
    """
    check_path_component("name", cfg.name)  # also for configs built without validation (it names directories)
    run_id = cfg.run_id()
    target, where = (Path(out_dir), "--out") if out_dir else (Path(cfg.output.dir) / run_id, "output.dir")
    if write and resume is None:  # a bad or busy output directory fails before any data is loaded
        rundir.check_writable(target, where)
        rundir.check_free(target, where)
    if prepared is not None and prepared.cfg != cfg:
        raise ValueError("run_experiment: prepared= was prepared from another config")
    from raysim.engine.tracking import trackers as make_trackers

    tracking = make_trackers(cfg)  # output.tensorboard / output.mlflow checked before anything is claimed or loaded
    numerics.enter(cfg.backend.numerics)  # the driver loads and splits the data: with the run's kernels, before it
    prep = prepare(cfg) if prepared is None else prepared
    resume_meta = ck_dir = None
    rd = None
    if resume is not None:
        resume_dir, ck_dir, resume_meta = _resume_point(cfg, resume)
        rd = rundir.RunDir.for_resume(resume_dir, out_dir)
        ck_dir = rd.work / ck_dir.relative_to(resume_dir)  # a finished run's checkpoints were copied
        write = True
    elif write:
        rd = rundir.RunDir.claim(target, where)
    cbs, started = _callbacks(cfg, prep, rd, progress, callbacks, tracking)
    backend = make_backend(prep.spec, prep.fed_data, prep.backend)
    run = Run(prep, backend, run_id)
    try:
        t0 = time.perf_counter()
        backend.start()
        run.timing["setup_s"] = time.perf_counter() - t0
        if resume_meta is not None:
            _restore(run, ck_dir, resume_meta)
        return _drive(run, cbs, started)
    except BaseException as exc:
        for cb in reversed(started):
            try:
                cb.on_run_error(run, exc)
            except Exception:  # never hide the run's own error
                pass
        raise
    finally:
        backend.shutdown()


def _callbacks(cfg: ExperimentConfig, prep: Prepared, rd, progress, callbacks: Optional[list],
               trackers: tuple = ()) -> tuple[list, list]:
    """The run's callbacks in order, and the list of those started so far (the run directory's from the start: the
    claimed directory is cleaned up on any error)."""
    cbs: list[Callback] = []
    if prep.fed_data.domains is not None and getattr(prep.algorithm, "reports_clusters", False):
        cbs.append(ClusterAgreement())  # first: its rows belong to the round the checkpointer saves
    started: list[Callback] = []
    if rd is not None:
        (rd.work / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        started.append(RunDirectory(rd))
        cbs += [started[0], Checkpointer(cfg.output.checkpoint_every, cfg.output.keep_checkpoints)]
    shown = progress_callback(cfg.output.progress if progress is None else progress, prep.algorithm.headline)
    if shown is not None:
        cbs.append(shown)
    return cbs + list(trackers) + list(callbacks or []), started


def _drive(run: Run, cbs: list, started: list) -> RunResult:
    """Start the callbacks, run the rounds, and end with the result."""
    for cb in cbs:
        if cb not in started:
            started.append(cb)
        cb.on_run_start(run)
    run_loop(run, cbs)
    report = run.backend_report = run.backend.report()
    if report.placement:
        run.timing["balance"] = report.placement  # cost-aware placement: per-step loads and moves
    for taken in report.fallbacks:  # on the console once per run (and in the metadata)
        warnings.warn(Fallback(**taken).message(), RuntimeWarning, stacklevel=2)
    result = RunResult(run.run_id, None, run.table.frame(), _metadata(run), run.timing)
    for cb in reversed(cbs):
        cb.on_run_end(run, result)
    return result


def _restore(run: Run, ck_dir: Path, meta: dict) -> None:
    from raysim.errors import DamagedFileError

    try:
        _restore_from(run, ck_dir, meta)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        if isinstance(e, DamagedFileError):
            raise
        raise DamagedFileError(Path(ck_dir) / "meta.pt", f"it does not hold a raysim checkpoint ({type(e).__name__}: "
                               f"{e})", damaged_hint(Path(ck_dir))) from None


def _restore_from(run: Run, ck_dir: Path, meta: dict) -> None:
    extra = meta["extra"]
    run.backend.load_checkpoint(str(ck_dir), meta["manifest"])
    run.table.rows = [Row(run.run_id, *r[1:]) for r in extra["rows"]]  # run_id changes when rounds were extended
    run.failures = list(extra["failures"])
    if run.env is not None and extra.get("env") is not None:
        run.env.load_state_dict(extra["env"])
    run.setup_done = bool(extra.get("setup_done", True))
    if run.cfg.server.mode == "async":  # the event loop restores itself from these (raysim/engine/async_loop.py)
        run.async_resume = (extra["async"], str(Path(ck_dir) / meta["manifest"]["async"]))
    run.start_round = int(meta["round_idx"]) + 1
    run.round_idx = int(meta["round_idx"])


def _metadata(run: Run) -> dict:
    cfg = run.cfg
    report = run.backend_report or BackendReport()
    meta = {
        "run_id": run.run_id,
        "config": to_dict(cfg),
        "config_hash": cfg.config_hash(),
        "seed": cfg.seed,
        "versions": versions(),
        "numerics": numerics.describe(),  # the mode and what it set (raysim/numerics.py), in the driver
        "numerics_processes": list(report.processes),  # and in every other computing process
        "count_metrics": sorted(run.table.counts),  # metrics recorded as integers (exact in every comparison)
        "data": run.prep.fed_data.summary(),  # data.domains: the ground truth of ClusterAgreement
        "data_notes": run.prep.fed_data.notes,
        "stopped_early": run.stopped_early,
        "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in run.failures],
        "client_failures": failure_summary(run.failures),
        "equality_policy": EQUALITY_POLICY,
        "actor_failures": list(report.runner_failures),  # client-runner deaths and what was done (Ray: actors)
        # tensor bytes between processes per round (Ray: through its object store, payload reads by the actors'
        # calls and returned uploads)
        "object_store_bytes": [dict(round=r, **v) for r, v in sorted(report.transport_bytes.items())],
        "fallbacks": list(report.fallbacks),  # from one executor or form to another, each once, with its reason
        "schedule": [f"{type(s).__name__}:{s.name}" + (f"#{i}" if i else "") for s, i in flatten(run.algorithm.schedule())],
    }
    if run.algorithm.setup_schedule() is not None:
        meta["setup_schedule"] = [f"{type(s).__name__}:{s.name}" for s, _ in flatten(run.algorithm.setup_schedule())]
    if run.env is not None:
        meta["env"] = run.env.summary()
    if run.async_summary is not None:
        meta["async"] = run.async_summary
    return meta
