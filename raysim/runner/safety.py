"""Divergence detection: non-finite losses, metrics and uploads, and what the run does about them.

Pure functions, so the round loop (and any future driver) calls them in one line each:

* :func:`check_update` runs on the client runner right after ``client_update``: a NaN/inf metric (``train_loss``)
  or upload tensor gives a short description; the runner then discards that update (state and upload) and reports
  the client as failed with ``nonfinite`` set, so a NaN never reaches the server.
* :func:`check_metrics` checks the server's (aggregation, evaluation) and clients' evaluation losses on the driver.
* :func:`decide` applies ``on_nonfinite`` (``stop`` | ``skip_client``) to a round's reports.

A stopped run raises :class:`NonFiniteError` (a :class:`~raysim.errors.SimulationError`: exit code 1) whose
message names the round, the client and the stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from raysim.errors import SimulationError

NONFINITE_PREFIX = "non-finite "  # the error text of a client report whose update was discarded


class NonFiniteError(SimulationError):
    """A loss, metric or upload became NaN/inf and ``on_nonfinite`` is ``stop`` (the run diverged)."""

    def __init__(self, event: "NonFinite"):
        self.event = event
        super().__init__(event.message())

    def __reduce__(self):  # picklable (process pools, Ray): rebuilt from its event
        return (type(self), (self.event,))


@dataclass(frozen=True)
class NonFinite:
    round_idx: int
    client_id: int  # -1: the server
    stage: str  # update | evaluate | aggregate | evaluate_server
    what: str  # e.g. "train_loss=nan" or "upload 'prototypes'['protos']: 12 non-finite values"

    def message(self) -> str:
        who = "the server" if self.client_id < 0 else f"client {self.client_id}"
        return (f"diverged: round {self.round_idx}, {who}, stage '{self.stage}': {self.what} "
                f"(on_nonfinite: stop; lower train.lr, or set on_nonfinite: skip_client to drop such updates)")

    def record(self) -> dict:
        return {"round": self.round_idx, "client_id": self.client_id, "stage": self.stage, "what": self.what}


def _value(v) -> float:
    if isinstance(v, (tuple, list)):
        v = v[0]
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0  # not a number: not ours to judge


def nonfinite_metrics(metrics: Mapping, losses_only: bool = True) -> Optional[str]:
    """``"name=value"`` of the first NaN/inf loss (a metric named ``train_*`` or containing ``loss``; every metric
    with ``losses_only=False``; values may be ``(value, weight)``), else None. Other metrics may be undefined (NaN)
    on purpose, e.g. an accuracy over no samples."""
    for name in sorted(metrics, key=lambda n: ("loss" not in str(n), str(n))):  # the loss itself first
        if losses_only and not (str(name).startswith("train_") or "loss" in str(name)):
            continue
        v = _value(metrics[name])
        if not math.isfinite(v):
            return f"{name}={v}"
    return None


def nonfinite_upload(upload: Mapping) -> Optional[str]:
    """Description of the first message tensor holding NaN/inf in an upload payload (name -> Message), else None."""
    for name in sorted(upload):
        tensors = getattr(upload[name], "tensors", None) or {}
        for key in sorted(tensors):
            t = tensors[key]
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if t.numel() and math.isfinite(float(t.sum(dtype=torch.float64))):
                    continue  # fast path: a NaN or inf anywhere makes the sum non-finite (float64: no overflow)
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    return f"upload {name!r}[{key!r}]: {bad} of {t.numel()} values non-finite"
    return None


def float_tensors(upload: Mapping) -> list:
    """The floating-point tensors of an upload payload (name -> Message), in the order :func:`nonfinite_upload`
    looks at them (the runner sums each once per step to see whether any holds a NaN/inf)."""
    out = []
    for name in sorted(upload):
        tensors = getattr(upload[name], "tensors", None) or {}
        out += [tensors[k] for k in sorted(tensors) if isinstance(tensors[k], torch.Tensor)
                and tensors[k].is_floating_point() and tensors[k].numel()]
    return out


def upload_sums(uploads: list) -> list:
    """float64 sums (0-dim tensors) that are all finite exactly when every floating tensor of ``uploads`` (payloads:
    name -> Message) is: one per tensor, or, for messages whose tensors are rows of a vectorised group's stacks
    (:class:`raysim.messages.Rows`), one per stacked tensor over the rows the uploads hold (no view per row, one
    reduction for the group). What the runner reads in its one batched divergence check."""
    from raysim.messages import Rows

    sums, stacked = [], {}
    for up in uploads:
        for name in sorted(up):
            tensors = getattr(up[name], "tensors", None)
            if isinstance(tensors, Rows):
                stacked.setdefault(id(tensors.stacks), (tensors.stacks, set()))[1].add(tensors.row)
            elif tensors:
                sums += [t.sum(dtype=torch.float64) for t in float_tensors({name: up[name]})]
    for stacks, rows in stacked.values():
        rows = sorted(rows)
        for key in sorted(stacks):
            t = stacks[key]
            if t.is_floating_point() and t.numel():
                t = t if rows == list(range(t.shape[0])) else t[torch.as_tensor(rows, device=t.device)]
                sums.append(t.sum(dtype=torch.float64))
    return sums


def check_update(metrics: Mapping, upload: Mapping) -> Optional[str]:
    """What is non-finite in one client update (metrics first, then the upload), or None."""
    return nonfinite_metrics(metrics) or nonfinite_upload(upload)


def is_nonfinite_report(report) -> bool:
    return not report.ok and str(report.error).startswith(NONFINITE_PREFIX)


def decide(policy: str, round_idx: int, reports: list, stage: str = "update") -> list:
    """Apply ``on_nonfinite`` to a round's client reports. ``stop``: raise :class:`NonFiniteError` for the first
    (lowest client id) non-finite one. ``skip_client``: return the non-finite reports' events (the runner already
    discarded those updates; the loop records them as failures)."""
    events = [NonFinite(round_idx, r.client_id, stage, r.error[len(NONFINITE_PREFIX):])
              for r in sorted(reports, key=lambda r: r.client_id) if is_nonfinite_report(r)]
    if events and policy == "stop":
        raise NonFiniteError(events[0])
    return events


def check_metrics(round_idx: int, client_id: int, stage: str, metrics: Mapping) -> None:
    """Evaluation and server metrics: a NaN/inf value stops the run whatever the policy (there is no update to
    skip)."""
    what = nonfinite_metrics(metrics)
    if what:
        raise NonFiniteError(NonFinite(round_idx, client_id, stage, what))
