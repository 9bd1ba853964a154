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
import os
import shutil
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
import yaml

from raysim.io import results
from raysim.config import ConfigError, apply_overrides, check_path_component, load_config_dict, make_config, to_dict
from raysim.data.datasets import DataError
from tuning.space import SearchSpace, apply_params, check_against_config, parse_space, resolve_objective

FINISHED_OUTCOMES = ("complete", "pruned", "diverged", "error")


# ----------------------------------------------------------------------------------------------------------------
# storage


STORAGE_TIMEOUT_S = 5.0  # how long --storage's server may take to accept a connection
_DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433, "oracle": 1521}
_DRIVER_HINTS = {"postgresql": "pip install psycopg2-binary", "mysql": "pip install pymysql (and use mysql+pymysql://)",
                 "mariadb": "pip install pymysql (and use mysql+pymysql://)"}


def _storage_error(message: str) -> ConfigError:
    return ConfigError("--storage", message)


def _check_file_target(path: Path, kind: str, header: Optional[bytes] = None) -> None:
    """A storage file: its directory can be created and written; an existing file is a readable, writable regular
    file (of the right kind when ``header`` is given)."""
    import os

    path = path.expanduser()
    if path.exists() or path.is_symlink():
        if path.is_dir():
            raise _storage_error(f"{path} is a directory; give a file path for the {kind}")
        if not path.is_file():
            raise _storage_error(f"{path} is not a regular file; give a file path for the {kind}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise _storage_error(f"{path} cannot be read and written (permissions); fix them or choose another "
                                 f"--storage")
        if header is not None and path.stat().st_size:
            with open(path, "rb") as f:
                if f.read(len(header)) != header:
                    raise _storage_error(f"{path} is not a {kind} (damaged or another kind of file); move it away "
                                         f"or choose another --storage")
        return
    anc = path.parent.absolute()
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise _storage_error(f"cannot create {path}: {anc} is a file, not a directory; choose another --storage")
    import tempfile

    try:  # root passes os.access everywhere: try it
        fd, probe = tempfile.mkstemp(prefix=".raysim-probe-", dir=anc)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _storage_error(f"cannot create {path}: {anc} is not writable ({e.strerror or e}); choose another "
                             f"--storage") from None


def _sqlite_quick_check(db: Path) -> None:
    """SQLite's own structural check of an existing database (read-only): a damaged file is refused up front."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
        problem = None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:2])
    except sqlite3.Error as e:
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise _storage_error(f"{db} is a damaged SQLite database ({problem[:200]}); move it away or choose another "
                             f"--storage")


def check_storage(url: str, timeout_s: float = STORAGE_TIMEOUT_S) -> None:
    """Before the study starts: the scheme is supported, its driver installed, the server reachable within
    ``timeout_s``, the file (SQLite, journal) writable. Every problem is one ConfigError naming --storage."""
    import socket

    if not url or not str(url).strip():
        raise _storage_error("is empty; give sqlite:///study.db or journal:study.log")
    if "://" not in url:
        path = url[len("journal:"):] if url.startswith("journal:") else url
        if not url.startswith("journal:") and Path(path).suffix not in (".log", ".journal", ".jsonl"):
            raise _storage_error(f"{url!r} is not a storage URL; use sqlite:///PATH.db, journal:PATH or a PATH ending "
                                 f"in .log, .journal or .jsonl")
        if not path:
            raise _storage_error("journal: needs a file path, e.g. journal:study.log")
        _check_file_target(Path(path), "journal file")
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        u = make_url(url)
    except (ArgumentError, ValueError) as e:
        raise _storage_error(f"{url!r} is not a database URL ({e}); use sqlite:///PATH.db or "
                             f"postgresql://USER:PASSWORD@HOST:PORT/DB") from None
    backend = u.get_backend_name()
    try:
        dialect = u.get_dialect()
    except NoSuchModuleError:
        raise _storage_error(f"the scheme {u.drivername!r} is not supported; use sqlite:///PATH.db, "
                             f"postgresql://..., mysql+pymysql://... or journal:PATH") from None
    try:
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()
    except ImportError as e:
        hint = _DRIVER_HINTS.get(backend, f"install the Python driver for {u.drivername}")
        raise _storage_error(f"the database driver for {u.drivername} is not installed ({e.name or e}); {hint}, or "
                             f"use sqlite:///PATH.db or journal:PATH") from None
    if backend == "sqlite":
        if u.database and u.database != ":memory:":
            db = Path(u.database).expanduser()
            _check_file_target(db, "SQLite database", b"SQLite format 3\x00")
            if db.is_file() and db.stat().st_size:
                _sqlite_quick_check(db)
        return
    if u.host:
        port = u.port or _DB_PORTS.get(backend)
        if port:
            try:
                socket.create_connection((u.host, int(port)), timeout=timeout_s).close()
            except socket.gaierror as e:
                raise _storage_error(f"unknown host {u.host!r} ({e.strerror or e}); check the URL") from None
            except (socket.timeout, TimeoutError):
                raise _storage_error(f"{u.host}:{port} did not answer within {timeout_s:g} s; is the {backend} server "
                                     f"running and reachable from here?") from None
            except OSError as e:
                raise _storage_error(f"cannot reach {u.host}:{port} ({e.strerror or e}); is the {backend} server "
                                     f"running there, and the port right?") from None


def open_storage(url: str):
    """``sqlite:///path.db`` (any SQLAlchemy URL) -> RDBStorage; ``journal:PATH`` or a path ending in .log/.journal/
    .jsonl -> a JournalStorage on that file (no server needed, safe for several processes on one file system).
    The storage is checked first (:func:`check_storage`); what still fails (credentials, a damaged file) is one
    ConfigError naming --storage."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    check_storage(url)
    try:
        if "://" in url:
            if url.startswith("sqlite:///"):
                Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
            kwargs = ({"connect_args": {"timeout": 60}} if url.startswith("sqlite") else  # several writers wait
                      {"connect_args": {"connect_timeout": int(STORAGE_TIMEOUT_S)}} if url.startswith("postgres") else None)
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        path = url[len("journal:"):] if url.startswith("journal:") else url
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(Path(path).expanduser())))
    except ConfigError:
        raise
    except Exception as e:
        raise storage_failure(url, e) from None


def storage_failure(url: str, e: BaseException) -> ConfigError:
    """A storage that passed the checks but fails in use (credentials, a damaged database or journal)."""
    text = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0][:200]
    what = f"{type(getattr(e, 'orig', None) or e).__name__}: {text}"
    if "://" not in url or url.startswith("sqlite"):
        return _storage_error(f"cannot use {url}: the file is damaged or unusable ({what}); move it away or choose "
                              f"another --storage")
    return _storage_error(f"cannot use {url} ({what}); check the user, password and database name in the URL")


def absolute_storage_url(url: str) -> str:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(url[len("sqlite:///"):]).expanduser().resolve())
    if "://" in url:
        return url
    path = url[len("journal:"):] if url.startswith("journal:") else url
    return f"journal:{Path(path).expanduser().resolve()}"


def _driver_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(trial, grace_s: float = 60.0) -> bool:
    """A RUNNING trial whose driver process is gone (same host), or that never got a driver attribute."""
    driver = trial.user_attrs.get("driver")
    if driver is None:
        started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        return time.time() - started > grace_s
    host, _, pid = driver.rpartition(":")
    if host != socket.gethostname():
        return False  # cannot tell from here; another machine's driver may still own it
    return int(pid) != os.getpid() and not _pid_alive(int(pid))


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
        for r in rows:  # (run_id, round, client_id, scope, metric, value, weight)
            if r[3] == "client" and r[4].startswith("train_") and not math.isfinite(r[5]):
                self.diverged = f"diverged: {r[4]}={r[5]} at round {r[1]} (client {r[2]})"
                return True
        acc = table.latest(self.obj.metric)
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


def trial_config(base: dict, space: SearchSpace, params: dict, trial_number: int):
    seed = None
    if space.trial_seed == "trial":
        seed = int(make_config(base).seed) + int(trial_number)
    return apply_params(base, params, seed)


def execute_trial(trial, base: dict, space: SearchSpace, run_dir: str | Path) -> TrialOutcome:
    """Run one trial's experiment; never raises for a diverging or failing run (only for a bad config)."""
    from raysim.errors import SimulationError
    from raysim.engine.callbacks import EvalCallback
    from raysim.engine.loop import run_experiment
    from raysim.engine.safety import NonFiniteError

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


@dataclass
class TuneResult:
    study_name: str
    out_dir: Path
    trials: pd.DataFrame
    best_params: dict
    best_value: Optional[float]
    ran: int  # trials run by this call
    wall_s: float
    files: dict = field(default_factory=dict)


def _outcome(t) -> Optional[str]:
    return t.user_attrs.get("outcome")


def counted(trials) -> int:
    """Finished trials towards ``--trials N`` (interrupted ones are retried and do not count)."""
    import optuna

    S = optuna.trial.TrialState
    n = 0
    for t in trials:
        if t.state in (S.COMPLETE, S.PRUNED):
            n += 1
        elif t.state == S.FAIL and _outcome(t) in ("diverged", "error"):
            n += 1
    return n


def recover_stale(study, log: Callable = print) -> int:
    """Mark trials orphaned by a killed driver as failed (interrupted) and enqueue their parameters again."""
    import optuna

    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not _is_stale(t):
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


def _begin_trial(study, space: SearchSpace, base: dict, out_dir: Path):
    trial = study.ask()
    trial.set_user_attr("driver", _driver_id())
    params = space.suggest(trial)
    cfg = trial_config(base, space, params, trial.number)
    trial.set_user_attr("seed", int(cfg.seed))
    trial.set_user_attr("config_hash", cfg.config_hash())
    run_dir = out_dir / "trials" / f"trial_{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir))
    return trial, params, run_dir


def tune(config: str | Path | dict, space: SearchSpace | dict, n_trials: int, storage: str | None = None,
         study_name: str | None = None, out_dir: str | Path | None = None, parallel: int = 1,
         overrides: list[str] | None = None, log: Callable = print, first_params: Optional[dict] = None,
         stop_after: Optional[int] = None) -> TuneResult:
    """Run (or resume) a study until it holds ``n_trials`` finished trials. ``first_params``: values (dotted key ->
    value) the first trial of a new study runs, e.g. the method's default, as a baseline the sampler and pruner see.
    ``stop_after`` (tests): return after starting this many trials in this call, as if interrupted."""
    import optuna

    t_start = time.perf_counter()
    if n_trials < 1:
        raise ConfigError("--trials", f"must be >= 1, got {n_trials}")
    if parallel < 1:
        raise ConfigError("--parallel", f"must be >= 1, got {parallel}")
    base = load_config_dict(config) if not isinstance(config, dict) else dict(config)
    base = apply_overrides(base, list(overrides or []) + ["output.progress=false"])
    cfg = make_config(base)
    if not isinstance(space, SearchSpace):
        space = parse_space(space)
    check_against_config(space, base)
    space = resolve_objective(space, cfg, log)
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
    store = open_storage(storage_url)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(study_name=study_name, storage=store, direction=space.objective.direction,
                                    sampler=space.build_sampler(), pruner=space.pruner.build(), load_if_exists=True)
        study.user_attrs  # reads the stored study: a damaged journal or database fails here
    except ConfigError:
        raise
    except Exception as e:
        raise storage_failure(storage_url, e) from None
    identity = {"space_hash": space.space_hash(), "config_hash": cfg.config_hash()}
    for key, value in identity.items():
        old = study.user_attrs.get(key)
        if old is not None and old != value:
            what = "search space" if key == "space_hash" else "base config"
            raise ConfigError("--study-name", f"study {study_name!r} in {storage_url} was created with another {what} "
                                              f"({old} != {value}); use a new --study-name or storage")
        study.set_user_attr(key, value)
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("base_config", to_dict(cfg))
    out_dir.mkdir(parents=True, exist_ok=True)

    if first_params and not study.get_trials(deepcopy=False):
        study.enqueue_trial(dict(first_params), user_attrs={"baseline": True})
    recover_stale(study, log)
    study.sampler = space.build_sampler(resumed_at=len(study.get_trials(deepcopy=False)))
    done = counted(study.get_trials(deepcopy=False))
    todo = max(0, n_trials - done)
    log(f"study {study_name!r} ({storage_url}): {done} finished trial(s), running {todo} more"
        f"{f' on Ray, {parallel} at a time' if parallel > 1 and todo else ''}")
    ran = 0
    if todo:
        if parallel > 1:
            ran = _run_parallel(study, space, base, out_dir, storage_url, study_name, todo, parallel, log, stop_after)
        else:
            ran = _run_sequential(study, space, base, out_dir, todo, log, stop_after)
    res = export(study, out_dir, base, space)
    res.ran, res.wall_s = ran, time.perf_counter() - t_start
    return res


def _run_sequential(study, space, base, out_dir, todo, log, stop_after) -> int:
    from optuna.trial import TrialState

    ran = 0
    while ran < todo and (stop_after is None or ran < stop_after):
        trial, params, run_dir = _begin_trial(study, space, base, out_dir)
        ran += 1
        try:
            out = execute_trial(trial, base, space, run_dir)
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


def _run_parallel(study, space, base, out_dir, storage_url, study_name, todo, parallel, log, stop_after) -> int:
    from optuna.trial import TrialState

    from raysim.backends.ray_tasks import LostTask, TaskPool

    cfg = make_config(base)
    r = space.trial_resources
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
                trial, params, run_dir = _begin_trial(study, space, base, out_dir)
                running[trial.number] = (trial, params)
                pool.submit(trial.number, _remote_trial, storage_url, study_name, trial._trial_id, base,
                            space.to_dict(), str(run_dir.resolve()))
                started += 1
            number, out, err = pool.wait()
            trial, params = running.pop(number)
            if isinstance(err, LostTask):  # its worker or node died: not the trial's fault; run its values again
                _interrupt(study, trial, params, reason=f"interrupted: {err}")
                log(f"trial {trial.number} lost its Ray worker ({err}); its parameters are enqueued again")
                started -= 1
                continue
            if err is not None:
                if isinstance(err, (ConfigError, DataError)):
                    trial.set_user_attr("outcome", "config_error")
                    trial.set_user_attr("fail_reason", str(err))
                    study.tell(trial, state=TrialState.FAIL)
                    raise err
                out = TrialOutcome("error", reason=f"error: the Ray task failed: {type(err).__name__}: {err}")
            _tell(study, trial, out, log)
            finished += 1
    except KeyboardInterrupt:
        for trial, params in running.values():
            _interrupt(study, trial, params)
        raise
    finally:
        pool.shutdown()
    return started


# ----------------------------------------------------------------------------------------------------------------
# export


def trials_frame(study) -> pd.DataFrame:
    """number, state, outcome, value, params_<key>..., seed, config_hash, run_dir, reason, last_round, seconds."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"number": t.number, "state": t.state.name, "outcome": _outcome(t), "value": t.value}
        for key, v in sorted(t.params.items()):
            row[f"params_{key}"] = v
        a = t.user_attrs
        row.update({"seed": a.get("seed"), "config_hash": a.get("config_hash"), "run_dir": a.get("run_dir"),
                    "reason": a.get("fail_reason") or a.get("prune_reason"), "last_round": a.get("last_round"),
                    "seconds": a.get("seconds"), "retry_of": a.get("retry_of"),
                    "datetime_start": t.datetime_start, "datetime_complete": t.datetime_complete})
        rows.append(row)
    return pd.DataFrame(rows)


def tuned_seeds(df: pd.DataFrame) -> list[int]:
    """The seeds a study's trials ran (trials.parquet column ``seed``; study attribute ``tuned_seeds``)."""
    if df.empty or "seed" not in df:
        return []
    return sorted({int(x) for x in df["seed"].dropna()})


def export(study, out_dir: Path, base: dict, space: SearchSpace) -> TuneResult:
    import optuna

    df = trials_frame(study)
    seeds = tuned_seeds(df)
    study.set_user_attr("tuned_seeds", seeds)
    files = {"trials": out_dir / "trials.parquet"}
    tmp = out_dir / ".trials.parquet.tmp"
    df.to_parquet(tmp, index=False)
    tmp.replace(files["trials"])
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    best_params, best_value = {}, None
    if complete:
        bt = study.best_trial
        best_params, best_value = dict(bt.params), bt.value
        cfg = trial_config(base, space, best_params, bt.number)
        best = to_dict(cfg)
        best["output"]["progress"] = True
        header = (f"# best trial {bt.number} of study {study.study_name!r}: {space.objective.mode} "
                  f"{space.objective.metric} = {bt.value:.6g}\n# tuned: "
                  + ", ".join(f"{k}={v!r}" for k, v in best_params.items()) + "\n"
                  + f"# tuned on seeds: {', '.join(str(x) for x in seeds)} (compare methods on other seeds)\n")
        files["best"] = out_dir / "best.yaml"
        files["best"].write_text(header + yaml.safe_dump(best, sort_keys=False))
    return TuneResult(study.study_name, out_dir, df, best_params, best_value, 0, 0.0, files)
