"""What a client step reports back (:class:`ClientReport`), and the names of a step's executions: the token its staged
states carry and the purpose of its per-client random streams. Shared by the client runner and its batched step
executors (:mod:`raysim.engine.executors`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from raysim import rng as rngmod


@dataclass
class ClientReport:
    client_id: int
    round_idx: int
    stage: str  # the step name ("update", "evaluate", ...)
    ok: bool = True
    metrics: dict = field(default_factory=dict)  # name -> value or (value, weight)
    up: dict = field(default_factory=dict)  # kind -> (floats, bytes)
    down: dict = field(default_factory=dict)
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0  # wall time (diagnostic only; never in the result table)
    iteration: int = 0
    nonfinite: str = ""  # what was NaN/inf in the update (raysim.engine.safety); the update was discarded


class StepReports(list):
    """One runner call's reports (a list of :class:`ClientReport`), with the bytes of the uploads the call returned
    beside them (``upload_bytes``: the Ray backend counts what travels through its object store)."""

    upload_bytes: int = 0


def step_token(round_idx: int, step, iteration: int) -> str:
    """Names one execution of a client step (its staged states on disk carry it)."""
    return f"{round_idx}.{step.name}.{iteration}"


def step_purpose(step, iteration: int) -> str:
    return rngmod.step_stream(step.method, step.name, iteration)
