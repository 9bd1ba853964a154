"""``--dry-run`` never lets the user's code write: while :func:`active` holds (the dry run), the user's code runs
inside :func:`user_code` (importing a module a config names, calling a loader or a model factory), and there an audit
hook (PEP 578) refuses every file-system write and every new program Python is asked for (opening a file for
writing, creating, removing, renaming or changing a file or directory, ``os.system``, ``subprocess``,
``exec*``/``spawn*``, SQLite files), whichever library the user's code calls to do it. The dry run still imports the
user's modules and calls their loaders and factories (it reports the data and the models they give), but none of
that code can write: the refused operation raises PermissionError inside it, and the dry run then ends in one
ConfigError naming the config key whose code tried and what it tried, even when that code caught the error.
raysim's own code and the libraries it loads for itself are not restricted (a cache directory found on first use).

What the user's code leaves behind writes nothing either, until the process exits: a thread it started (and the
threads those start) and an atexit hook it registered meet the same refusal after the dry run has ended.

Python's own byte-code cache (``__pycache__``) is written through the same calls; importlib ignores the refusal, so
a dry run leaves no ``.pyc`` behind either. Outside a dry run the hook returns at once."""
from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import sys
import threading
import weakref
from typing import Iterator, Optional

from raysim.errors import ConfigError

# audit events that change the file system or start another program (https://docs.python.org/3/library/audit_events.html)
_WRITE_EVENTS = frozenset({
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.chflags",
    "os.lchflags", "os.link", "os.symlink", "os.utime", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod",
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.startfile", "os.kill", "os.killpg", "pty.spawn",
    "subprocess.Popen", "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
    "shutil.copytree", "shutil.chown", "shutil.make_archive", "shutil.unpack_archive", "tempfile.mkstemp",
    "tempfile.mkdtemp", "webbrowser.open",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_state = threading.local()
_lock = threading.Lock()
_active = 0  # nesting depth of active(); read by the hook without the lock
_refused: list[tuple[Optional[str], str, str]] = []  # (key, what, operation) refused while active
_keys: list[tuple[str, str]] = []  # the user code running now: (config key, what)
_installed = False


def _operation(event: str, args: tuple) -> Optional[str]:
    """A description of the write ``event`` stands for, or None when it writes nothing."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if path == os.devnull:
            return None
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                 (isinstance(flags, int) and flags & _WRITE_FLAGS)
        return f"open {path!r} for writing" if writes else None
    if event == "sqlite3.connect":
        db = args[0] if args else None
        return None if db in (":memory:", b":memory:", "") else f"open the SQLite database {db!r}"
    if event in _WRITE_EVENTS:
        first = args[0] if args else ""
        return f"{event}({first!r})" if isinstance(first, (str, bytes, os.PathLike)) else event
    return None


# what the user's code left running after its window (issue 50): threads it started (threading.Thread objects, and
# the entry functions' code of raw _thread threads) and atexit hooks it registered still write nothing, for as long
# as the process lives
_tainted_threads: "weakref.WeakSet" = weakref.WeakSet()
_tainted_code: set = set()
_armed = False  # something is tainted, or the process is exiting after a dry run whose code registered atexit hooks
_at_exit = False


def _taint(thread=None, fn=None) -> None:
    global _armed
    if thread is not None:
        _tainted_threads.add(thread)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None:
        _tainted_code.add(code)
    _armed = True


def _started_by_user_code() -> bool:
    """The thread starting a new one is the dry run's user code (in its window) or was started by it."""
    return bool((_active and _keys) or (_armed and _tainted_now()))


_thread_start = threading.Thread.start
_raw_start = _thread.start_new_thread


def _start(self, *args, **kwargs):  # threading.Thread.start while a dry run may have run user code
    if _started_by_user_code():
        _taint(thread=self)
    return _thread_start(self, *args, **kwargs)


def _start_new_thread(fn, *args, **kwargs):  # _thread.start_new_thread, likewise
    if _started_by_user_code():
        _taint(fn=fn)
    return _raw_start(fn, *args, **kwargs)


def _tainted_now() -> bool:
    """The calling thread was started by the user's code in a dry run (or the process is exiting after one)."""
    if _at_exit or (_tainted_threads and threading.current_thread() in _tainted_threads):
        return True
    if _tainted_code:
        f = sys._getframe(1)
        while f.f_back is not None:
            f = f.f_back
        return f.f_code in _tainted_code
    return False


def _late(event: str, args: tuple) -> None:
    """Outside the user code's windows: a write from what that code left behind is refused all the same."""
    if getattr(_state, "inside", False) or _operation(event, args) is None:
        return
    _state.inside = True  # what the check calls must not recurse into the hook
    try:
        tainted = _tainted_now()
    finally:
        _state.inside = False
    if not tainted:
        return
    raise LateRefusal(f"a dry run writes nothing, not even after it ended: refused to {_operation(event, args)}")


class LateRefusal(PermissionError):
    """A write refused after the dry run's window (a thread or an atexit hook its user code left behind). When the
    code does not catch it, one line says so instead of a traceback (:func:`_quiet_hooks`)."""


def _say_late(exc) -> bool:
    if isinstance(exc, LateRefusal):
        print(f"raysim: note: {exc} (by code a --dry-run imported or called; nothing was written)", file=sys.stderr)
        return True
    return False


def _quiet_hooks() -> None:
    """An uncaught :class:`LateRefusal` in a thread or an atexit hook is one line, not a traceback."""
    thread_hook, unraisable = threading.excepthook, sys.unraisablehook

    def on_thread(args):
        if not _say_late(args.exc_value):
            thread_hook(args)

    def on_unraisable(args):
        if not _say_late(args.exc_value):
            unraisable(args)

    threading.excepthook, sys.unraisablehook = on_thread, on_unraisable


def _hook(event: str, args: tuple) -> None:
    if not _active or not _keys or getattr(_state, "inside", False):
        if _armed:
            _late(event, args)
        return
    op = _operation(event, args)
    if op is None:
        return
    first = args[0] if args else None
    if isinstance(first, (str, bytes, os.PathLike)) and "__pycache__" in os.fsdecode(first):
        raise PermissionError("a dry run writes no byte-code cache")  # importlib ignores it; not the user's write
    _state.inside = True  # the hook itself must not recurse (formatting a path may audit)
    try:
        key, what = _keys[-1]
        _refused.append((key, what, op))
    finally:
        _state.inside = False
    raise PermissionError(f"a dry run writes nothing: refused to {op}")


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            sys.addaudithook(_hook)
            # Python has no audit event for a new thread: the two ways to start one learn whether the dry run's user
            # code (or a thread it started) is starting it
            threading.Thread.start = _start
            _thread.start_new_thread = _start_new_thread
            _quiet_hooks()
            _installed = True


def is_active() -> bool:
    return bool(_active)


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Everything inside writes nothing (the dry run). On leaving, a refused write is one ConfigError."""
    global _active
    import tempfile

    _install()
    tempfile.gettempdir()  # found (by writing a probe file) once per process: before anything is refused
    with _lock:
        if not _active:
            _refused.clear()
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            refused = list(_refused) if not _active else []
    if refused:
        key, what, op = refused[0]
        raise ConfigError(key or "--dry-run", f"{what} tried to {op} during --dry-run; a dry run writes nothing, so "
                                              f"nothing was written — run without --dry-run, or let that code write "
                                              f"only when it is really run")


@contextlib.contextmanager
def user_code(key: str, what: str, report: bool = True) -> Iterator[None]:
    """The user's code for config ``key`` runs inside (importing a module, calling a loader or factory): in a dry
    run, a write it tries is refused and reported naming ``key`` (even when the code caught the PermissionError).
    ``report=False`` (an installed package's own import: a cache directory it makes on first use): the write is
    refused all the same, but reported only when the code did not cope with the refusal (it raised)."""
    if not _active:
        yield
        return
    _keys.append((key, what))
    before = len(_refused)
    hooks = atexit._ncallbacks()
    try:
        yield
    except BaseException:
        if len(_refused) > before:
            _raise_refused(before)
        raise
    finally:
        _keys.pop()
        if atexit._ncallbacks() > hooks:  # the code registered atexit hooks: they run when the process exits
            _arm_exit()
    if len(_refused) > before:
        if not report:
            del _refused[before:]
            return
        _raise_refused(before)


def _refuse_from_now_on() -> None:
    global _at_exit, _armed
    _at_exit = _armed = True


def _arm_exit() -> None:
    """atexit runs hooks last-registered first: registered after the user's hooks, this one runs before them and
    makes every write from then on (the user's hooks') a refusal."""
    atexit.register(_refuse_from_now_on)


def _raise_refused(before: int) -> None:
    key, what, op = _refused[before]
    del _refused[before:]
    raise ConfigError(key, f"{what} tried to {op} during --dry-run; a dry run writes nothing, so nothing was "
                           f"written — run without --dry-run, or let that code write only when it is really run") \
        from None
