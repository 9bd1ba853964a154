"""Run directories on disk: where a run is built, who holds it, and what a stopped run leaves behind.

A run with intended directory ``<out>/<name>`` is built in the visible ``<out>/<name>.incomplete`` and renamed to
``<name>`` when it finishes, so at every moment the disk shows either a finished run or an unfinished one:

* the working directory is claimed atomically (``os.mkdir``) and locked with ``flock`` on ``<work>/.lock`` (holding
  the pid) for the whole run. The kernel drops the lock when the process dies, even by ``kill -9``, so a stale lock
  never blocks a resume, while a second run into a directory that a live run holds fails at once;
* a run that stops without finishing (an exception, Ctrl-C, ``kill -9``) leaves ``<name>.incomplete``; when it holds
  checkpoints, ``raysim run CONFIG --resume <name>.incomplete`` continues it and finishes into ``<name>``;
* a finished run is never overwritten: a new name (``<name>-2``, ...) is chosen and one line says so;
* the directory a run is meant for is resolved and checked before any data loads (:func:`check_run_dir`): a
  symbolic link (even a dangling one) is followed, ``..`` and ``.`` are resolved, and the root of the file system, a
  file, a directory holding other files than a run, an unfinished run's ``.incomplete`` name and a mount point (a
  run is renamed into place, which cannot cross file systems) are refused in one line;
* every working directory raysim creates holds a marker file (:data:`MARKER`); only a marked ``.incomplete``
  directory is ever reused or removed: any other one keeps its files and the run takes the next free name, saying so;
* a finished run whose final rename still fails is never thrown away: its ``.incomplete`` directory stays, whole
  and resumable, and the error (:class:`RunNotMoved`) says where it is.

``results.run_index`` and ``raysim report`` skip unfinished and hidden directories (:func:`is_listed_run_path`).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from raysim.errors import ConfigError

INCOMPLETE = ".incomplete"
LOCK_FILE = ".lock"
MARKER = ".raysim-made"  # in every working directory raysim creates: only such a directory is ever reused or removed


def mark(path: Path) -> None:
    """Write raysim's marker into a directory it has just created."""
    (Path(path) / MARKER).write_text("created by raysim; raysim removes or reuses only directories holding this "
                                     "file\n")


def is_marked(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def notice(message: str) -> None:
    from raysim.errors import printable

    print(f"raysim: {printable(message)}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------
# names


def work_path(final: Path) -> Path:
    """The visible working directory of a run whose intended directory is ``final``."""
    final = Path(final)
    return final.with_name(final.name + INCOMPLETE)


def intended_path(path: Path) -> Path:
    """The intended (finished) directory of a working directory: strips ``.incomplete``."""
    path = Path(path)
    name = path.name
    if name.endswith(INCOMPLETE):
        name = name[: -len(INCOMPLETE)]
    return path.with_name(name)


def is_unfinished_name(path: Path) -> bool:
    return Path(path).name.endswith(INCOMPLETE)


def is_listed_run_path(path: Path, root: Optional[Path] = None) -> bool:
    """False for a path inside an unfinished (``*.incomplete``) or hidden (``.*``) directory below ``root``."""
    path = Path(path)
    parts = path.relative_to(root).parts if root is not None and path.is_relative_to(root) else path.parts
    return not any(p.endswith(INCOMPLETE) or (p.startswith(".") and p not in (".", "..")) for p in parts)


def has_checkpoints(path: Path) -> bool:
    from raysim.io.checkpoints import find_checkpoint

    return find_checkpoint(Path(path)) is not None


def _occupied(path: Path) -> bool:
    """A path a new run must not take: a file, or a directory that is not empty (e.g. a finished run)."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


RUN_FILES = ("results.parquet", "run.json", "config.yaml")  # a directory holding one of them is a run


def is_run_dir(path: Path) -> bool:
    """A directory that holds a run (finished or damaged): one of :data:`RUN_FILES` — a ``config.yaml`` only with
    raysim's marker (issue 50: ``--out .`` in a project whose config is ``config.yaml`` took the project for a run
    and wrote to ``../<project>-2``)."""
    p = Path(path)
    return any(os.path.lexists(p / f) for f in RUN_FILES[:2]) or (os.path.lexists(p / "config.yaml")
                                                                    and is_marked(p))


def next_free(final: Path) -> Path:
    """``final-2``, ``final-3``, ... : the first name that neither a run nor an unfinished run uses."""
    i = 2
    while True:
        cand = final.with_name(f"{final.name}-{i}")
        if not cand.exists() and not work_path(cand).exists():
            return cand
        i += 1


# ----------------------------------------------------------------------------------------------------------------
# checks before anything is loaded


def check_writable(path: Path, field: str = "--out") -> None:
    """Fail (ConfigError naming ``field``) unless a run directory can be created at ``path``: the nearest existing
    ancestor must be a directory in which a file can be created. Leaves nothing behind."""
    path = Path(path).absolute()
    anc = path
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(field, f"cannot create {path}: {anc} is a file, not a directory")
    if anc == path and not path.is_dir():
        raise ConfigError(field, f"cannot create {path}: it exists and is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".raysim-probe-", dir=anc)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(field, f"cannot write to {anc} ({e.strerror or e}); choose another --out or output.dir") from None


def resolve_run_path(path, field: str = "--out") -> Path:
    """The directory a run meant for ``path`` really goes to: ``path`` itself (relative paths stay relative) unless
    following symbolic links or resolving ``.``/``..`` changes it, then the resolved absolute path."""
    p = Path(os.path.expanduser(str(path)))
    try:
        real = p.resolve()
    except (RuntimeError, OSError) as e:  # a symbolic-link loop
        raise ConfigError(field, f"cannot resolve {path}: {e.strerror if isinstance(e, OSError) else e} (a loop "
                                 f"of symbolic links?); give a directory path") from None
    if Path(os.path.abspath(p)) != real or p.name in ("", ".", ".."):
        return real
    return p


def check_run_dir(path, field: str = "--out") -> Path:
    """Check, before any data loads, that a run can be built for ``path`` and renamed to it; returns the resolved
    path (:func:`resolve_run_path`). A ConfigError naming ``field`` when it is the root of the file system, a file,
    a directory holding other files than a run, a name ending in ``.incomplete``, a mount point, or inside a
    directory where the working directory cannot be created. A finished run there is fine (the run takes the next
    free name)."""
    shown = str(path)
    final = resolve_run_path(path, field)
    real = final.absolute()
    if real.name in ("", ".", ".."):
        raise ConfigError(field, f"{shown} is the root of the file system; a run needs a directory of its own (e.g. "
                                 f"{real / 'run'})")
    via = f" (= {real})" if final != Path(os.path.expanduser(shown)) else ""  # a link, '..' or '.' resolved
    if real.name.endswith(INCOMPLETE):
        raise ConfigError(field, f"{shown}{via} is the name of an unfinished run's working directory; continue that "
                                 f"run with --resume {shown}, or give another name")
    if real.exists() and not real.is_dir():
        raise ConfigError(field, f"cannot create {shown}{via}: it is a file, not a directory")
    if real.is_dir():
        try:
            entries = [e for e in os.listdir(real)]
        except OSError as e:
            raise ConfigError(field, f"cannot read {shown}{via}: {e.strerror or e}") from None
        if entries and not is_run_dir(real):
            raise ConfigError(field, f"{shown}{via} is a directory holding other files, not a run; --out names the "
                                     f"run's own directory (new or empty): give {shown.rstrip('/')}/NAME, or set "
                                     f"output.dir to put runs under it" if field == "--out" else
                              f"{shown}{via} is a directory holding other files, not a run; choose another {field}")
        try:
            mount = os.stat(real).st_dev != os.stat(real.parent).st_dev
        except OSError:
            mount = False
        if mount and not entries:
            raise ConfigError(field, f"{shown}{via} is a mount point (another file system than {real.parent}); a run "
                                     f"is built beside its directory and renamed into place, which cannot cross file "
                                     f"systems: give a directory inside it, e.g. {shown.rstrip('/')}/run")
    check_writable(real.parent if real.exists() else real, field)  # where the .incomplete directory is created
    return final


def holder(work: Path) -> Optional[str]:
    """'pid N on HOST' when a live process holds the lock of working directory ``work``, else None."""
    lock = Path(work) / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        finally:
            os.close(fd)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


class RunDirBusy(ConfigError):
    """A live run holds the working directory (its lock)."""


class RunNotMoved(Exception):
    """A finished run could not be renamed from its working directory to its directory: it stays whole (results,
    run.json, checkpoints) in ``work``."""

    def __init__(self, work: Path, final: Path, reason: str):
        self.work, self.final, self.reason = Path(work), Path(final), reason
        super().__init__(f"the run finished, but {work} could not be renamed to {final} ({reason}); nothing is lost: "
                         f"the run is whole in {work} — move it yourself (mv {work} {final}) or finish it into "
                         f"another directory with: raysim run CONFIG --resume {work} --out DIR")


def check_free(final: Path, field: str = "--out") -> None:
    """Fail at once when ``final`` cannot take a run (:func:`check_run_dir`) or a running run holds its working
    directory."""
    final = check_run_dir(final, field)
    who = holder(work_path(final))
    if who:
        raise RunDirBusy(field, f"{work_path(final)} is being written by a running run ({who}); wait for it to "
                                f"finish or choose another --out")


# ----------------------------------------------------------------------------------------------------------------
# the claimed directory


class RunDir:
    """A locked working directory and the directory it becomes when the run finishes.

    ``claim`` (a new run) or ``for_resume`` (an unfinished one), then exactly one of ``finalise`` (success) or
    ``abandon`` (the run stopped)."""

    def __init__(self, final: Path, work: Path, fd: int, created: list[Path]):
        self.final, self.work, self._fd, self._created = Path(final), Path(work), fd, created

    # -- acquiring ----------------------------------------------------------------------------------------------
    @staticmethod
    def _lock(work: Path, field: str) -> int:
        fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirBusy(field, f"{work} is being written by a running run ({who}); wait for it to finish or "
                                    f"choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        return fd

    @classmethod
    def claim(cls, final: Path, field: str = "--out", notify: Callable[[str], None] = notice) -> "RunDir":
        """Claim a working directory for a new run meant for ``final``. A finished run at ``final``, or an
        unfinished one with checkpoints (kept for a resume), makes it pick the next free name and say so; a stale
        unfinished one without checkpoints is reused; one that a live run holds is an error."""
        final = check_run_dir(final, field)
        while True:
            work = work_path(final)
            if _occupied(final):
                new = next_free(final)
                notify(f"{final} holds a finished run (never overwritten); writing this run to {new}")
                final = new
                continue
            created = [p for p in reversed(work.parents) if not p.exists()]
            try:
                work.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(work)
            except FileExistsError:
                if not is_marked(work):  # not made by raysim (or by a version before the marker): never touched
                    new = next_free(final)
                    notify(f"{work} exists but raysim did not create it (no {MARKER} file): its files are kept; "
                           f"writing this run to {new}")
                    final = new
                    continue
                fd = cls._lock(work, field)  # raises when a live run holds it
                if has_checkpoints(work):
                    os.close(fd)
                    new = next_free(final)
                    notify(f"{work} holds an unfinished run (continue it with --resume {work}); writing this run "
                           f"to {new}")
                    final = new
                    continue
                for p in work.iterdir():  # raysim's own stale start without checkpoints: nothing worth keeping
                    if p.name not in (LOCK_FILE, MARKER):
                        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                return cls(final, work, fd, [])
            except OSError as e:
                raise ConfigError(field, f"cannot create {work}: {e.strerror or e}") from None
            mark(work)
            return cls(final, work, cls._lock(work, field), created + [work])

    @classmethod
    def for_resume(cls, path: Path, out_dir: Optional[Path] = None,
                   notify: Callable[[str], None] = notice) -> "RunDir":
        """The working directory to continue the run whose checkpoints are under ``path``: an unfinished directory
        is locked and continued in place (it becomes its intended directory, or ``out_dir``); a finished run's
        checkpoints are copied into a newly claimed directory (the finished run stays as it is)."""
        path = Path(path)
        if out_dir:
            out_dir = check_run_dir(out_dir, "--out")
        if is_unfinished_name(path):
            fd = cls._lock(path, "resume")
            return cls(Path(out_dir) if out_dir else intended_path(path), path, fd, [])
        rd = cls.claim(Path(out_dir) if out_dir else path, "resume", notify)
        shutil.copytree(path / "checkpoints", rd.work / "checkpoints", dirs_exist_ok=True)
        return rd

    # -- releasing ----------------------------------------------------------------------------------------------
    def _release(self, lock_in: Path) -> None:
        if self._fd is not None:
            try:
                (lock_in / LOCK_FILE).unlink(missing_ok=True)
            finally:
                os.close(self._fd)
                self._fd = None

    def finalise(self, notify: Callable[[str], None] = notice) -> Path:
        """Rename the working directory to the intended one (or the next free name if a finished run got there
        first) and release the lock. Returns the run's directory."""
        final = self.final
        try:
            if _occupied(final):
                new = next_free(final)
                notify(f"{final} holds a finished run (never overwritten); writing this run to {new}")
                final = new
            if final.is_dir() and not final.is_symlink():
                final.rmdir()  # an empty directory the user made for the run
            os.rename(self.work, final)
        except OSError as e:  # the run is whole in self.work: keep it, unlocked, and say where it is
            self._release(self.work)
            raise RunNotMoved(self.work, final, e.strerror or str(e)) from None
        self._release(final)
        self.final = final
        return final

    def abandon(self, keep: bool) -> Optional[Path]:
        """The run stopped: keep the working directory (``keep``: it holds checkpoints or a record of why it
        stopped) and return it, or remove it and any parent directories the claim created."""
        if keep or not is_marked(self.work):  # a directory raysim did not create is never removed
            self._release(self.work)
            return self.work if keep else None
        self._release(self.work)
        shutil.rmtree(self.work, ignore_errors=True)
        for p in reversed(self._created[:-1]):
            try:
                p.rmdir()
            except OSError:
                break
        return None
