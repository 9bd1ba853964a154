"""What a client step reports back (:class:`ClientReport`), and the names of a step's executions: the token its staged
states carry and the purpose of its per-client random streams. Shared by the client runner and its batched step
executors (:mod:`raysim.runner.executors`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raysim import rng as rngmod

# how many times host_values read a device's values (benchmarks and tests count host reads with it; on a CPU the
# read is a plain memory access that no aten operation shows)
HOST_READS = {"count": 0}


def host_values(tensors: list) -> list[float]:
    """The values of 0-dim tensors as Python floats, in order, with one read per device (a stack, then one copy to
    the host): a client step's metrics and checks cost one synchronisation of the runner, not one per client."""
    out: list = [None] * len(tensors)
    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        stacked = torch.stack([tensors[i] for i in idx]) if len(idx) > 1 else tensors[idx[0]].reshape(1)
        HOST_READS["count"] += 1
        for i, v in zip(idx, stacked.tolist()):
            out[i] = float(v)
    return out


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
    nonfinite: str = ""  # what was NaN/inf in the update (raysim.runner.safety); the update was discarded


class StepReports(list):
    """One runner call's reports (a list of :class:`ClientReport`), with the bytes of the uploads the call returned
    beside them (``upload_bytes``: the Ray backend counts what travels through its object store)."""

    upload_bytes: int = 0


def step_token(round_idx: int, step, iteration: int) -> str:
    """Names one execution of a client step (its staged states on disk carry it)."""
    return f"{round_idx}.{step.name}.{iteration}"


def step_purpose(step, iteration: int) -> str:
    return rngmod.step_stream(step.method, step.name, iteration)
