"""Who owns a fault: the client or the machine (issue 50).

A client's own failure (its maths diverges, its user code raises) is the client's: ``on_client_failure: skip``
may drop it and the run goes on. A fault of the machine is not: a full or read-only disk under raysim's client-state
store, checkpoints or tables, a file-system error raised inside raysim's own writers, ``MemoryError``, CUDA's
out-of-memory error, an allocator that cannot allocate. Skipping those would drop healthy clients and end in a
wrong result with exit 0 (5 of 6 clients "failed" every round on a full disk: accuracy 0.19 instead of 1.00), so
:func:`classify` names the resource and the key to change, and the runner raises :class:`MachineFault` (a
:class:`~raysim.errors.SimulationError`: exit 1, checkpoints kept to resume).

Pure functions of the exception (its ``__cause__`` / ``__context__`` chain and traceback frames): ``torch.save`` on
a full disk raises a ``RuntimeError`` whose context is the ``OSError(ENOSPC)``, so the whole chain is read.
"""
from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from typing import Iterator, Optional

from raysim.errors import SimulationError

# an OSError with one of these is the machine's whoever raised it (no client's code can fix a full disk)
MACHINE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EIO,
                                       errno.ENOMEM, errno.EMFILE, errno.ENFILE) if e is not None)
# an OSError raised inside these raysim modules (any errno) is the machine's too: raysim's own files
_OWN_WRITERS = {("runner", "store.py"): ("the client-state store", "backend.state_dir"),
                ("io", "checkpoints.py"): ("the checkpoints", "output.dir"),
                ("io", "tables.py"): ("the result table", "output.dir"),
                ("io", "rundir.py"): ("the run directory", "output.dir"),
                ("io", "files.py"): ("raysim's files", "backend.state_dir or output.dir")}
_ALLOCATOR = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory",
              "failed to allocate")


class MachineFault(SimulationError):
    """A fault of the machine (disk, memory) met while running clients: the run stops (exit 1), keeping its
    checkpoints, instead of counting healthy clients as failed."""

    def __reduce__(self):  # crosses process boundaries (Ray actors) intact
        return (type(self), self.args)


@dataclass(frozen=True)
class Fault:
    resource: str  # what ran out or failed: "disk (the client-state store)", "GPU memory", ...
    problem: str  # the system's words: "No space left on device: /x/y"
    fix: str  # the key(s) to change

    def message(self) -> str:
        return f"{self.resource}: {self.problem}; this is the machine's fault, not the clients': {self.fix}"


def chain(e: BaseException, limit: int = 16) -> Iterator[BaseException]:
    """``e`` and the exceptions it was raised from or during (``__cause__``, else ``__context__``), once each."""
    seen = set()
    while e is not None and id(e) not in seen and len(seen) < limit:
        seen.add(id(e))
        yield e
        e = e.__cause__ if e.__cause__ is not None else e.__context__


def _frames(e: BaseException) -> list[str]:
    out, t = [], e.__traceback__
    while t is not None:
        out.append(t.tb_frame.f_code.co_filename)
        t = t.tb_next
    return out


def _writer(e: BaseException) -> Optional[tuple[str, str]]:
    """(resource, key) of the raysim writer the error was raised in (the innermost store/io module that names a
    resource; io/files.py, below them all, only when no other is on the stack), else None."""
    found = []
    for filename in reversed(_frames(e)):
        parts = filename.replace(os.sep, "/").split("/")
        if len(parts) >= 3 and parts[-3] == "raysim" and tuple(parts[-2:]) in _OWN_WRITERS:
            found.append(tuple(parts[-2:]))
    best = [f for f in found if f != ("io", "files.py")] or found
    return _OWN_WRITERS[best[0]] if best else None


def _memory(e: BaseException) -> Optional[Fault]:
    name = type(e).__name__
    text = str(e).splitlines()[0][:200] if str(e) else name
    low = text.lower()
    cuda = name == "OutOfMemoryError" or ("cuda" in low and "out of memory" in low)
    if cuda:
        return Fault("GPU memory", text, "lower train.batch_size, or give each actor more of a GPU (backend.num_gpus, "
                                         "backend.model_resources[].gpu_memory_mb) or fewer clients per actor")
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(a in low for a in _ALLOCATOR)):
        return Fault("memory", f"{name}: {text}" if text != name else name,
                     "lower backend.state_memory_mb or backend.decoded_cache_mb (client states and data held in "
                     "memory) or train.batch_size, or run fewer actors (backend.num_actors)")
    return None


def _disk(e: OSError, writer: Optional[tuple[str, str]]) -> Optional[Fault]:
    if e.errno not in MACHINE_ERRNOS and writer is None:
        return None  # e.g. the user's own code opening a missing file: the client's failure
    where = f": {e.filename}" if getattr(e, "filename", None) else ""
    problem = f"{e.strerror or type(e).__name__}{where}"
    resource, key = writer or ("the file system", "backend.state_dir or output.dir")
    if e.errno in (errno.ENOMEM,):
        return Fault("memory", problem, "lower backend.state_memory_mb or train.batch_size")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return Fault("open files", problem, "raise the open-file limit (ulimit -n) or run fewer actors "
                                            "(backend.num_actors)")
    fix = (f"free space there or point {key} at a disk with room" if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
           else f"point {key} at a writable, healthy disk")
    if key == "backend.state_dir":
        fix += " (or raise backend.state_memory_mb so fewer states spill)"
    return Fault(f"disk ({resource})", problem, fix)


def classify(e: BaseException, writer: Optional[tuple[str, str]] = None) -> Optional[Fault]:
    """The machine fault ``e`` stands for (anywhere in its chain), or None when it is the client's own failure.
    ``writer``: (resource, key) when the caller knows what was being written (else read off the traceback)."""
    links = list(chain(e))
    for x in links:
        writer = writer or _writer(x)
    for x in links:
        fault = _memory(x)
        if fault is not None:
            return fault
        if isinstance(x, OSError):
            fault = _disk(x, writer)
            if fault is not None:
                return fault
    return None


def raise_if_machine(e: BaseException, writer: Optional[tuple[str, str]] = None) -> None:
    """Raise :class:`MachineFault` (from ``e``) when ``e`` is a machine fault; return when it is the client's."""
    if isinstance(e, MachineFault):
        raise e
    fault = classify(e, writer)
    if fault is not None:
        raise MachineFault(fault.message()) from e


CHECKPOINTS = ("the checkpoints", "output.dir")


@contextlib.contextmanager
def machine_faults(writer: Optional[tuple[str, str]] = None):
    """Inside, a machine fault (a full disk while the store commits or writes a checkpoint shard: ``writer`` =
    :data:`CHECKPOINTS`) leaves as :class:`MachineFault`; anything else as it is."""
    try:
        yield
    except MachineFault:
        raise
    except Exception as e:
        if classify(e, writer) is None:
            raise
        raise_if_machine(e, writer)
