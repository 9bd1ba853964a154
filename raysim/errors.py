"""The errors every layer raises, in one module that imports nothing of raysim (so any module may import it):

* :class:`ConfigError` — a bad configuration value, naming its dotted key;
* :class:`DataError` — bad or missing data, naming the config key; :class:`DamagedFileError` — a file raysim reads
  is damaged or unreadable, naming the file, the problem and the fix;
* :class:`SimulationError` — the run could not go on (every sampled client failed, a run diverged);
* :class:`MetricError` — a result table does not hold the metric asked for (the message lists the ones it does).

ConfigError and DataError cross process boundaries (Ray actors, ``reproduce --jobs`` workers) intact."""
from __future__ import annotations

import gzip
from typing import Optional


class ConfigError(ValueError):
    """A bad configuration value. ``field`` is the dotted path of the offending key."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"config error at '{field_path}': {message}")

    def __reduce__(self):  # crosses process boundaries (reproduce --jobs workers, Ray) intact, subclasses too
        return (rebuild_error, (type(self), dict(self.__dict__), self.args))


def rebuild_error(cls, state: dict, args: tuple):
    """Unpickle an error whose constructor takes other arguments than its message (ConfigError, DataError and
    their subclasses): the message and the attributes as they were, no constructor call."""
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class DataError(ValueError):
    """Bad or missing data, or a partition the dataset cannot satisfy. ``field`` names the config key."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"data error at '{field_path}': {message}")

    def __reduce__(self):  # crosses process boundaries (Ray actors, reproduce --jobs workers) intact
        return (rebuild_error, (type(self), dict(self.__dict__), self.args))


class DamagedFileError(DataError):
    """A file raysim reads is damaged (truncated, bytes changed, empty), unreadable, or not a file. The message names
    the file, what is wrong and what to do: ``cannot read PATH [(field)]: problem; fix``."""

    def __init__(self, path, problem: str, fix: str, field_path: Optional[str] = None):
        self.path, self.problem, self.fix = str(path), problem, fix
        self.field = field_path or str(path)
        where = f"{path} ({field_path})" if field_path else str(path)
        ValueError.__init__(self, f"cannot read {where}: {problem}; {fix}")


class NotRegularFileError(OSError):
    """A path raysim would read is a FIFO, a device, a socket: reading it could block forever or never end."""


def check_regular(path) -> None:
    """Raise :class:`NotRegularFileError` unless ``path`` is a regular file (a symbolic link is followed; ``stat``
    never blocks, where opening a FIFO would wait for a writer forever). Every reader of data, run and checkpoint
    files calls it first (issue 50: a FIFO in place of an image, a run's config.yaml or a checkpoint's meta.pt hung
    ``raysim run`` and ``raysim runs``)."""
    import os
    import stat

    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a file")
    raise NotRegularFileError(f"it is {kind}, not a regular file")


def read_problem(e: BaseException) -> str:
    """What went wrong reading a file, in a few words (for :class:`DamagedFileError`)."""
    import zlib

    if isinstance(e, NotRegularFileError):
        return str(e)
    if isinstance(e, IsADirectoryError):
        return "it is a directory, not a file"
    if isinstance(e, PermissionError):
        return "permission denied (check its permissions)"
    if isinstance(e, FileNotFoundError):
        return "it does not exist"
    if isinstance(e, (EOFError, gzip.BadGzipFile, zlib.error)):
        return f"truncated or damaged compressed data ({type(e).__name__}: {str(e)[:120]})"
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"damaged or not the expected format ({type(e).__name__}{': ' + text if text else ''})"


class SimulationError(RuntimeError):
    """The run could not go on (e.g. every sampled client failed)."""


class MetricError(KeyError):
    """A metric the table does not hold (the message lists the ones it does)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_BIDI = {0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x200E, 0x200F}


def printable(text, keep_newlines: bool = False) -> str:
    """``text`` safe for a terminal: control characters (escape sequences, carriage returns, NUL, DEL, C1) and
    bidirectional overrides written as ``\\x1b``, ``\\r``, ``\\u202e``; newlines kept only with ``keep_newlines``
    (multi-line output such as a report), else written as ``\\n`` (one-line messages stay one line)."""
    text = str(text)
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\n" and keep_newlines:
            out.append(ch)
        elif ch == "\t":
            out.append(ch if keep_newlines else "\\t")
        elif o < 0x20 or 0x7F <= o < 0xA0 or o in _BIDI:
            out.append({"\n": "\\n", "\r": "\\r"}.get(ch) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"))
        else:
            out.append(ch)
    return "".join(out)
