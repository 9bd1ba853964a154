"""Fallbacks from one executor or form to another (a method's group form to its per-client steps, the grouped forward
to vmap, ``client_final_group`` or ``evaluate_group`` to the per-client calls): the same numbers, another way, and
never silent. Where one is taken, :func:`note` records it, with its reason, in the log of the client runner running
the step (:class:`FallbackLog`, one per runner and run: :func:`collecting` makes it the current one); the backend
hands the logs to the driver at the end (``BackendReport.fallbacks``), which puts each fallback once in the run's
metadata (``fallbacks``) and on the console."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import asdict, dataclass
from typing import Optional

REASON_CHARS = 300  # an exception's message is cut to this many characters


@dataclass(frozen=True)
class Fallback:
    """``what`` (the form or executor that failed) fell back to ``to``, because of ``reason`` (the first error)."""

    what: str
    to: str
    reason: str

    def message(self) -> str:
        return f"{self.what} failed ({self.reason}); {self.to}"


class FallbackLog:
    """The fallbacks one client runner took in a run, each (what, to) once, with its first reason."""

    def __init__(self):
        self._taken: dict[tuple[str, str], Fallback] = {}

    def note(self, what: str, to: str, error: BaseException) -> None:
        if (what, to) not in self._taken:
            reason = f"{type(error).__name__}: {error}"
            self._taken[what, to] = Fallback(what, to, reason[:REASON_CHARS])

    def taken(self) -> list[dict]:
        """The fallbacks as plain dicts (they travel from a runner's process to the driver), in the order taken."""
        return [asdict(f) for f in self._taken.values()]


_CURRENT: contextvars.ContextVar[Optional[FallbackLog]] = contextvars.ContextVar("raysim_fallbacks", default=None)


@contextlib.contextmanager
def collecting(log: FallbackLog):
    """Fallbacks noted inside go to ``log`` (a client runner's, around each step it runs)."""
    token = _CURRENT.set(log)
    try:
        yield log
    finally:
        _CURRENT.reset(token)


def note(what: str, to: str, error: BaseException) -> None:
    """``what`` failed with ``error`` and the step goes on as ``to`` says: recorded in the current runner's log (outside
    a runner's step, e.g. a direct call in a test, nowhere)."""
    log = _CURRENT.get()
    if log is not None:
        log.note(what, to, error)


def merged(logs: list[list[dict]]) -> list[dict]:
    """The fallbacks of several runners (each a :meth:`FallbackLog.taken` list), each (what, to) once, the first
    runner's reason."""
    out: dict[tuple, dict] = {}
    for taken in logs:
        for f in taken:
            out.setdefault((f["what"], f["to"]), f)
    return list(out.values())
