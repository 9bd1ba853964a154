"""Where a study lives: a journal file, SQLite, or a database server (checked before anything runs: reachable,
the right kind of file, the driver installed), and which driver owns a RUNNING trial (a trial whose driver process is
gone is stale: recovered by the next run of the study)."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Optional


from raysim.errors import ConfigError

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


SQLITE_CHECK_TIMEOUT_S = 10.0  # how long the check waits for a database another process holds locked
SQLITE_BUSY_TIMEOUT_S = 60  # how long a study's writes wait for one another (several writers on one file)


def sqlite_locked(e: BaseException) -> bool:
    """``e`` (sqlite3's, or SQLAlchemy's wrapping it) says the database is locked or busy: another process holds it,
    nothing is damaged."""
    text = str(getattr(e, "orig", None) or e).lower()
    return "database is locked" in text or "database table is locked" in text or "database is busy" in text


def _locked_error(db, waited_s: float) -> ConfigError:
    return _storage_error(f"{db} is locked by another process (another raysim tune, or a program holding a write "
                          f"transaction on it) and stayed locked for {waited_s:g} s; the study is not "
                          f"damaged: wait for that process to finish (or stop it) and run again, or use a journal "
                          f"file (journal:PATH), which several processes share without locking")


def _sqlite_quick_check(db: Path) -> None:
    """SQLite's own structural check of an existing database (read-only): a damaged file is refused up front, and a
    database another process holds locked is called locked (never damaged: moving it away would lose the study)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=SQLITE_CHECK_TIMEOUT_S)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
        problem = None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:2])
    except sqlite3.Error as e:
        if sqlite_locked(e):
            raise _locked_error(db, SQLITE_CHECK_TIMEOUT_S) from None
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise _storage_error(f"{db} is a damaged SQLite database ({problem[:200]}); move it away or choose another "
                             f"--storage")


# the tables Optuna's RDB storage creates (and SQLite's own): a database holding any other belongs to another
# application, whose file a study must not write into (issue 50: --storage sqlite:///app.db)
OPTUNA_TABLES = frozenset({"alembic_version", "studies", "study_directions", "study_system_attributes",
                           "study_user_attributes", "trial_heartbeats", "trial_intermediate_values", "trial_params",
                           "trial_system_attributes", "trial_user_attributes", "trial_values", "trials",
                           "version_info", "study_attributes", "trial_attributes"})


def _sqlite_only_optuna(db: Path) -> None:
    """An existing SQLite database holds only Optuna's tables (read-only look), else one ConfigError naming it."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=SQLITE_CHECK_TIMEOUT_S)
        try:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error:
        return  # the quick check above speaks for an unreadable file
    foreign = sorted(n for n in names - OPTUNA_TABLES if not n.startswith("sqlite_"))
    if foreign:
        raise _storage_error(f"{db} holds tables that are not a study's ({', '.join(foreign[:5])}"
                             f"{', ...' if len(foreign) > 5 else ''}): another application's database; give a file of "
                             f"its own, e.g. sqlite:///{db.with_name(db.stem + '-study.db')}")


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
                _sqlite_only_optuna(db)
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
            kwargs = ({"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}} if url.startswith("sqlite") else  # writers wait
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
    if url.startswith("sqlite") and sqlite_locked(e):
        return _locked_error(url[len("sqlite:///"):] if url.startswith("sqlite:///") else url, SQLITE_BUSY_TIMEOUT_S)
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


def driver_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(trial, grace_s: float = 60.0) -> bool:
    """A RUNNING trial whose driver process is gone (same host), or that never got a driver attribute."""
    driver = trial.user_attrs.get("driver")
    if driver is None:
        started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        return time.time() - started > grace_s
    host, _, pid = driver.rpartition(":")
    if host != socket.gethostname():
        return False  # cannot tell from here; another machine's driver may still own it
    return int(pid) != os.getpid() and not _pid_alive(int(pid))
