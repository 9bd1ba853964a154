"""Optuna studies over raysim experiments (``raysim tune``).

One trial = one run of :func:`raysim.run_experiment` with the trial's values set by dotted config key. Its
intermediate values are reported to Optuna after every evaluated round (through the round loop's ``callback``) so a
pruner can stop it; its objective is read back from the run's Parquet table. The driver owns every trial's lifecycle
(``study.ask`` ... ``study.tell``); a trial body runs in-process, or, with ``parallel > 1``, as one Ray task per trial
with the sequential backend inside, reporting through the same storage.

Persistence and resume: the study lives in a journal file or SQLite database. ``--trials N`` means N finished trials
(complete, pruned, or failed by divergence/error) in the study; a resumed study runs only the missing ones. A trial
left RUNNING by a driver that no longer exists (killed) is marked FAIL with ``outcome = interrupted`` and its
parameters are enqueued again, so nothing is lost and nothing finished is run twice.

Divergence: a non-finite training loss (any client-scope ``train_*`` metric) or a non-finite objective ends the trial
as FAIL with ``outcome = diverged`` and the reason in the ``fail_reason`` attribute; the study goes on.
"""
from __future__ import annotations

import math
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd

from raysim.io import results
from raysim.config import apply_overrides, check_path_component, load_config_dict, make_config, to_dict
from raysim.errors import ConfigError, DataError
from tuning.export import TuneResult, export, trial_outcome, trials_frame, tuned_seeds
from tuning.space import SearchSpace, check_against_config, parse_space, resolve_objective, trial_config
from tuning.storage import (STORAGE_TIMEOUT_S, driver_id, is_stale, absolute_storage_url, check_storage,
                            open_storage, storage_failure)

FINISHED_OUTCOMES = ("complete", "pruned", "diverged", "error")


# ----------------------------------------------------------------------------------------------------------------
# one trial


@dataclass
class TrialOutcome:
    outcome: str  # complete | pruned | diverged | error
    value: Optional[float] = None
    reason: str = ""
    run_dir: Optional[str] = None
    last_round: Optional[int] = None
    seconds: float = 0.0
    traceback: str = ""


class RoundMonitor:
    """The round loop's callback: divergence check, ``trial.report`` and pruning after every evaluated round."""

    def __init__(self, trial, space: SearchSpace):
        self.trial, self.obj = trial, space.objective
        self.cursor = 0
        self.best = -math.inf
        self.diverged: Optional[str] = None
        self.pruned_at: Optional[int] = None

    def __call__(self, round_idx: int, table) -> bool:
        rows = table.rows[self.cursor:]
        self.cursor = len(table.rows)
        for r in rows:  # raysim.io.tables.Row
            if r.scope == "client" and r.metric.startswith("train_") and not math.isfinite(r.value):
                self.diverged = f"diverged: {r.metric}={r.value} at round {r.round} (client {r.client_id})"
                return True
        acc = table.latest(self.obj.metric)
        if acc is None and not any(r.metric == self.obj.metric for r in table.rows):
            names = sorted({r.metric for r in table.rows if r.scope == "client" and not r.metric.startswith("train_")})
            raise ConfigError("objective.metric", f"the runs record no {self.obj.metric!r} (a missing metric is not a "
                                                  f"diverged trial); choose one they record: {', '.join(names[:20])}")
        if acc is None or not math.isfinite(acc):
            self.diverged = f"diverged: mean {self.obj.metric}={acc} at round {round_idx}"
            return True
        self.best = max(self.best, acc)
        if self.obj.mode == "best":
            value = self.best
        elif self.obj.mode == "time_to_target":
            value = -acc  # the study minimises; a higher accuracy is better here too
        else:
            value = acc
        self.trial.report(value, round_idx)
        if self.trial.should_prune():
            self.pruned_at = round_idx
            return True
        return False


def objective_value(df: pd.DataFrame, space: SearchSpace) -> float:
    """The trial's objective from its result table (as read back from Parquet)."""
    obj = space.objective
    pr = results.per_round(df, obj.metric)
    if pr.empty:
        raise KeyError(f"the run recorded no client-scope '{obj.metric}'")
    if obj.mode == "final":
        return float(pr.sort_values("round")["mean"].iloc[-1])
    if obj.mode == "best":
        return float(pr["mean"].max())
    tt = results.time_to_target(df, obj.metric, obj.target, obj.time)
    t = float(tt["time"].iloc[0])
    if math.isnan(t):  # never reached: a penalty proportional to the whole run's time
        t = obj.miss_penalty * float(results.cumulative(df, obj.time)["x"].max())
    return t


def nonfinite_loss(df: pd.DataFrame) -> Optional[str]:
    d = df[(df["scope"] == "client") & df["metric"].str.startswith("train_")]
    bad = d[~d["value"].map(math.isfinite)]
    if bad.empty:
        return None
    r = bad.iloc[0]
    return f"diverged: {r['metric']}={r['value']} at round {r['round']} (client {r['client_id']})"


def execute_trial(trial, base: dict, space: SearchSpace, run_dir: str | Path) -> TrialOutcome:
    """Run one trial's experiment; never raises for a diverging or failing run (only for a bad config)."""
    from raysim.errors import SimulationError
    from raysim.engine.callbacks import EvalCallback
    from raysim.engine.loop import run_experiment
    from raysim.runner.safety import NonFiniteError

    t0 = time.perf_counter()
    params = space.suggest(trial)  # the values the driver already drew (stored in the trial)
    cfg = trial_config(base, space, params, trial.number)
    mon = RoundMonitor(trial, space)
    out = TrialOutcome("error", run_dir=str(run_dir))
    try:
        res = run_experiment(cfg, out_dir=run_dir, progress=False, callbacks=[EvalCallback(mon)])
        out.run_dir = str(res.out_dir)
        df = results.load(res.out_dir)
        out.last_round = int(df["round"].max()) if len(df) else None
        reason = mon.diverged or nonfinite_loss(df)
        if reason:
            out.outcome, out.reason = "diverged", reason
        elif mon.pruned_at is not None:
            out.outcome, out.reason = "pruned", f"pruned at round {mon.pruned_at}"
        else:
            value = objective_value(df, space)
            if not math.isfinite(value):
                out.outcome, out.reason = "diverged", f"diverged: objective is {value}"
            else:
                out.outcome, out.value = "complete", value
    except (ConfigError, DataError):
        raise
    except NonFiniteError as e:  # the engine stopped the run (on_nonfinite: stop)
        ev = e.event
        out.outcome, out.last_round = "diverged", ev.round_idx
        out.reason = f"diverged: {ev.what} at round {ev.round_idx} ({'server' if ev.client_id < 0 else f'client {ev.client_id}'})"
    except SimulationError as e:
        out.reason = f"simulation failed: {str(e).splitlines()[0]}"
    except Exception as e:  # a trial's crash is recorded, the study goes on
        out.reason = f"error: {type(e).__name__}: {e}"
        out.traceback = traceback.format_exc()
    out.seconds = time.perf_counter() - t0
    return out


def _remote_trial(storage_url: str, study_name: str, trial_id: int, base: dict, space_dict: dict, run_dir: str):
    """A trial body inside a Ray task: reopen the study (same storage), rebuild the trial, run it."""
    import optuna

    space = parse_space(space_dict)
    study = optuna.load_study(study_name=study_name, storage=open_storage(storage_url), pruner=space.pruner.build(),
                              sampler=space.build_sampler())
    trial = optuna.trial.Trial(study, trial_id)
    try:  # where the trial ran (multi-node studies show it)
        from raysim.backends.ray_tasks import current_node

        trial.set_user_attr("node", current_node())
    except Exception:
        pass
    base = apply_overrides(base, ["backend.name=sequential"])
    return execute_trial(trial, base, space, run_dir)


# ----------------------------------------------------------------------------------------------------------------
# the study


def counted(trials) -> int:
    """Finished trials towards ``--trials N`` (interrupted ones are retried and do not count)."""
    import optuna

    S = optuna.trial.TrialState
    n = 0
    for t in trials:
        if t.state in (S.COMPLETE, S.PRUNED):
            n += 1
        elif t.state == S.FAIL and trial_outcome(t) in ("diverged", "error"):
            n += 1
    return n


def recover_stale(study, log: Callable = print) -> int:
    """Mark trials orphaned by a killed driver as failed (interrupted) and enqueue their parameters again."""
    import optuna

    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not is_stale(t):
            continue
        storage = study._storage
        storage.set_trial_user_attr(t._trial_id, "outcome", "interrupted")
        reason = f"interrupted: driver {t.user_attrs.get('driver')} is gone"
        storage.set_trial_user_attr(t._trial_id, "fail_reason", reason)
        storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        if t.params:
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number})
        run_dir = t.user_attrs.get("run_dir")
        if run_dir:  # the killed run's unfinished directory (<name>.incomplete; .tmp-<name> before)
            from raysim.io.rundir import work_path

            shutil.rmtree(work_path(Path(run_dir)), ignore_errors=True)
            shutil.rmtree(Path(run_dir).parent / f".tmp-{Path(run_dir).name}", ignore_errors=True)
        log(f"trial {t.number} was interrupted (driver {t.user_attrs.get('driver')} gone): marked failed, "
            f"{'parameters enqueued again' if t.params else 'no parameters drawn yet'}")
        n += 1
    return n


def _interrupt(study, trial, params: dict, reason: str = "interrupted: KeyboardInterrupt") -> None:
    import optuna

    study._storage.set_trial_user_attr(trial._trial_id, "outcome", "interrupted")
    study._storage.set_trial_user_attr(trial._trial_id, "fail_reason", reason)
    study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    if params:
        study.enqueue_trial(dict(params), user_attrs={"retry_of": trial.number})


def _tell(study, trial, out: TrialOutcome, log: Callable) -> None:
    import optuna

    S = optuna.trial.TrialState
    for key, value in (("outcome", out.outcome), ("run_dir", out.run_dir), ("last_round", out.last_round),
                       ("seconds", round(out.seconds, 3))):
        trial.set_user_attr(key, value)
    if out.reason:
        trial.set_user_attr("fail_reason" if out.outcome != "pruned" else "prune_reason", out.reason)
    if out.outcome == "complete":
        study.tell(trial, out.value)
    elif out.outcome == "pruned":
        study.tell(trial, state=S.PRUNED)
    else:
        study.tell(trial, state=S.FAIL)
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    shown = f"value {out.value:.4f}" if out.value is not None else out.reason
    log(f"trial {trial.number} [{params}] {out.outcome}: {shown} ({out.seconds:.1f} s)")


@dataclass(frozen=True)
class _Session:
    """An open study and what its trials run: the base config (a dict), the search space, the output directory,
    and the storage URL and study name a Ray worker reopens the study from."""
    study: Any
    space: SearchSpace
    base: dict
    out_dir: Path
    storage_url: str
    study_name: str


def _begin_trial(session: _Session):
    study, space = session.study, session.space
    trial = study.ask()
    trial.set_user_attr("driver", driver_id())
    params = space.suggest(trial)
    cfg = trial_config(session.base, space, params, trial.number)
    trial.set_user_attr("seed", int(cfg.seed))
    trial.set_user_attr("config_hash", cfg.config_hash())
    run_dir = session.out_dir / "trials" / f"trial_{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir))
    return trial, params, run_dir


def tune(config: str | Path | dict, space: SearchSpace | dict, n_trials: int, storage: str | None = None,
         study_name: str | None = None, out_dir: str | Path | None = None, parallel: int = 1,
         overrides: list[str] | None = None, log: Callable = print, first_params: Optional[dict] = None,
         stop_after: Optional[int] = None) -> TuneResult:
    """Run (or resume) a study until it holds ``n_trials`` finished trials. ``first_params``: values (dotted key ->
    value) the first trial of a new study runs, e.g. the method's default, as a baseline the sampler and pruner see.
    ``stop_after`` (tests): return after starting this many trials in this call, as if interrupted."""
    t_start = time.perf_counter()
    if n_trials < 1:
        raise ConfigError("--trials", f"must be >= 1, got {n_trials}")
    if parallel < 1:
        raise ConfigError("--parallel", f"must be >= 1, got {parallel}")
    base, cfg, space = _study_space(config, space, overrides, log)
    if space.grid_size is not None and n_trials > space.grid_size:
        raise ConfigError("--trials", f"the grid (sampler: grid) has {space.grid_size} points; ask for at most that "
                                      f"many trials, got {n_trials}")
    unknown = sorted(set(first_params or {}) - set(space.params))
    if unknown:
        raise ConfigError("--first", f"{', '.join(unknown)} is not a tuned key; tuned: {', '.join(space.params)}")
    if study_name is not None:
        check_path_component("--study-name", study_name)  # it names the output directory tune-<study name>
    study_name = study_name or f"{cfg.name}-tune"
    out_dir = Path(out_dir) if out_dir else Path(cfg.output.dir) / f"tune-{study_name}"
    storage_url = storage if storage is not None else f"journal:{out_dir / 'study.journal'}"
    if parallel > 1:  # Ray workers may run in another directory
        storage_url = absolute_storage_url(storage_url)
    made = next((p for p in [*reversed(out_dir.absolute().parents), out_dir.absolute()] if not p.exists()), None)
    study, existed = _open_study(storage_url, study_name, space, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)

    if first_params and not study.get_trials(deepcopy=False):
        study.enqueue_trial(dict(first_params), user_attrs={"baseline": True})
    recover_stale(study, log)
    study.sampler = space.build_sampler(resumed_at=len(study.get_trials(deepcopy=False)))
    done = counted(study.get_trials(deepcopy=False))
    todo = max(0, n_trials - done)
    log(f"study {study_name!r} ({storage_url}): {done} finished trial(s), running {todo} more"
        f"{f' on Ray, {parallel} at a time' if parallel > 1 and todo else ''}")
    session = _Session(study, space, base, out_dir, storage_url, study_name)
    ran = 0
    try:
        if todo:
            ran = (_run_parallel(session, todo, parallel, log, stop_after) if parallel > 1 else
                   _run_sequential(session, todo, log, stop_after))
    except ConfigError:  # a bad setting found by the first trial (a missing objective metric): nothing is kept
        if not existed and done == 0:
            _discard_new_study(study, storage_url, made)
        raise
    res = export(study, out_dir, base, space)
    res.ran, res.wall_s = ran, time.perf_counter() - t_start
    from tuning.show import validation_warnings

    res.trials.attrs["direction"] = space.objective.direction
    res.warnings = validation_warnings(res.trials, space.objective.metric, float(cfg.data.val_fraction))
    return res


def _discard_new_study(study, storage_url: str, made_dir: Optional[Path]) -> None:
    """A study this call created whose first trial found a bad setting: removed from its storage, and the output
    directory this call made removed with it, so that the corrected command starts afresh."""
    import optuna

    try:
        optuna.delete_study(study_name=study.study_name, storage=study._storage)
    except Exception:
        pass
    if made_dir is not None:
        shutil.rmtree(made_dir, ignore_errors=True)


def _study_space(config, space, overrides, log: Callable):
    """(the base config as a dict, the validated config, the search space checked against it, its objective
    resolved)."""
    base = load_config_dict(config) if not isinstance(config, dict) else dict(config)
    base = apply_overrides(base, list(overrides or []) + ["output.progress=false"])
    cfg = make_config(base)
    if not isinstance(space, SearchSpace):
        space = parse_space(space)
    check_against_config(space, base)
    return base, cfg, resolve_objective(space, cfg, log)


def _open_study(storage_url: str, study_name: str, space: SearchSpace, cfg):
    """The study ``study_name`` in ``storage_url``, created or resumed; a resumed study must have been created with
    the same search space and base config (recorded in its user attributes)."""
    import optuna

    store = open_storage(storage_url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    identity = {"space_hash": space.space_hash(), "config_hash": cfg.config_hash()}
    try:
        existed = study_name in optuna.study.get_all_study_names(store)
        if existed and not any(k in optuna.load_study(study_name=study_name, storage=store).user_attrs
                               for k in identity):  # looked at before anything is written to it
            raise ConfigError("--study-name", f"study {study_name!r} in {storage_url} was not created by raysim tune "
                                              f"(it records no search space or base config); use a new --study-name")
        study = optuna.create_study(study_name=study_name, storage=store, direction=space.objective.direction,
                                    sampler=space.build_sampler(), pruner=space.pruner.build(), load_if_exists=True)
        study.user_attrs  # reads the stored study: a damaged journal or database fails here
    except ConfigError:
        raise
    except Exception as e:
        raise storage_failure(storage_url, e) from None
    for key, value in identity.items():
        old = study.user_attrs.get(key)
        if old is not None and old != value:
            what = "search space" if key == "space_hash" else "base config"
            raise ConfigError("--study-name", f"study {study_name!r} in {storage_url} was created with another {what} "
                                              f"({old} != {value}); use a new --study-name or storage")
        study.set_user_attr(key, value)
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("base_config", to_dict(cfg))
    return study, existed


def _run_sequential(session: _Session, todo: int, log: Callable, stop_after: Optional[int]) -> int:
    from optuna.trial import TrialState

    study = session.study
    ran = 0
    while ran < todo and (stop_after is None or ran < stop_after):
        trial, params, run_dir = _begin_trial(session)
        ran += 1
        try:
            out = execute_trial(trial, session.base, session.space, run_dir)
        except KeyboardInterrupt:
            _interrupt(study, trial, params)
            raise
        except (ConfigError, DataError) as e:
            trial.set_user_attr("outcome", "config_error")
            trial.set_user_attr("fail_reason", str(e))
            study.tell(trial, state=TrialState.FAIL)
            raise
        _tell(study, trial, out, log)
    return ran


def _run_parallel(session: _Session, todo: int, parallel: int, log: Callable, stop_after: Optional[int]) -> int:
    from raysim.backends.ray_tasks import TaskPool

    cfg = make_config(session.base)
    r = session.space.trial_resources
    pool = TaskPool(r.num_cpus, r.num_gpus, address=cfg.backend.address, where="space.trial_resources")
    k = min(parallel, pool.slots)
    if k < parallel:
        log(f"the Ray cluster fits {k} trial(s) of {r.num_cpus:g} CPU / {r.num_gpus:g} GPU at a time")
    running: dict = {}
    started = finished = 0
    limit = todo if stop_after is None else min(todo, stop_after)
    try:
        while finished < limit:
            while started < limit and len(running) < k:
                trial, params, run_dir = _begin_trial(session)
                running[trial.number] = (trial, params)
                pool.submit(trial.number, _remote_trial, session.storage_url, session.study_name, trial._trial_id,
                            session.base, session.space.to_dict(), str(run_dir.resolve()))
                started += 1
            number, out, err = pool.wait()
            trial, params = running.pop(number)
            if _settle(session.study, (trial, params), out, err, log):
                finished += 1
            else:
                started -= 1
    except KeyboardInterrupt:
        for trial, params in running.values():
            _interrupt(session.study, trial, params)
        raise
    finally:
        pool.shutdown()
    return started


def _settle(study, started: tuple, out, err, log: Callable) -> bool:
    """Records a parallel trial's result: False when its Ray worker or node was lost (its values enqueued again,
    not the trial's fault), True otherwise; a config or data error fails the trial and is raised."""
    from optuna.trial import TrialState

    from raysim.backends.ray_tasks import LostTask

    trial, params = started
    if isinstance(err, LostTask):  # its worker or node died: not the trial's fault; run its values again
        _interrupt(study, trial, params, reason=f"interrupted: {err}")
        log(f"trial {trial.number} lost its Ray worker ({err}); its parameters are enqueued again")
        return False
    if err is not None:
        if isinstance(err, (ConfigError, DataError)):
            trial.set_user_attr("outcome", "config_error")
            trial.set_user_attr("fail_reason", str(err))
            study.tell(trial, state=TrialState.FAIL)
            raise err
        out = TrialOutcome("error", reason=f"error: the Ray task failed: {type(err).__name__}: {err}")
    _tell(study, trial, out, log)
    return True


# the study's storage (tuning.storage) and export (tuning.export): importable from here as before
__all__ = ["FINISHED_OUTCOMES", "RoundMonitor", "STORAGE_TIMEOUT_S", "TrialOutcome", "TuneResult", "check_storage",
           "counted", "execute_trial", "export", "nonfinite_loss", "objective_value", "open_storage", "recover_stale",
           "storage_failure", "trial_config", "trial_outcome", "trials_frame", "tune", "tuned_seeds"]
