"""What a run records and holds: the result rows of a round (traffic per client, kind and step, the clients'
metrics, failures, participants), wall times, server metrics and evaluations (:class:`Recorder`); the driver's state of
one run handed to every callback (:class:`Run`); the finished run (:class:`RunResult`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from raysim import rng as rngmod
from raysim.io.tables import ROUND_TIME, STEP_TIME, ResultTable
from raysim.io.results import final as results_final
from raysim.runner.runners import ClientReport
from raysim.engine.backend import BackendReport
from raysim.engine.prepare import Prepared, resume_hash


COMM_METRICS = ("up_floats", "up_bytes", "down_floats", "down_bytes")
SETUP_ROUND = rngmod.NO_ROUND  # the setup phase's rows carry round -1


@dataclass
class RunResult:
    run_id: str
    out_dir: Optional[Path]
    table: pd.DataFrame
    metadata: dict
    timing: dict = field(default_factory=dict)

    def final(self, metric: str = "test_acc") -> tuple[float, float]:
        """(mean, sample std over clients) of ``metric`` at the last evaluated round: ``results.final`` of this run;
        (nan, nan) when the run has no such client metric."""
        if not ((self.table["scope"] == "client") & (self.table["metric"] == metric)).any():
            return math.nan, math.nan
        row = results_final(self.table, metric).iloc[0]
        return float(row["mean"]), float(row["std"])


def _value_weight(v):
    if isinstance(v, (tuple, list)):
        return float(v[0]), float(v[1])
    return float(v), 1.0


class RoundLog:
    """What a round's client steps moved and reported, per client, written as rows when the round ends."""

    def __init__(self):
        self.clients: dict[int, dict] = {}
        self.order: list[int] = []
        self.steps: list[str] = []

    def add(self, step: str, reports: list[ClientReport]) -> None:
        if step not in self.steps:
            self.steps.append(step)
        for r in reports:
            c = self.clients.get(r.client_id)
            if c is None:
                c = self.clients[r.client_id] = {"down": {}, "up": {}, "step": {}, "failed": False, "metrics": {}}
                self.order.append(r.client_id)
            per_step = c["step"].setdefault(step, {"down": [0, 0], "up": [0, 0]})
            for direction, sizes in (("down", r.down), ("up", r.up if r.ok else {})):
                for kind, (f, b) in sizes.items():
                    acc = c[direction].setdefault(kind, [0, 0])
                    acc[0] += f
                    acc[1] += b
                    per_step[direction][0] += f
                    per_step[direction][1] += b
            if not r.ok:
                c["failed"] = True
                continue
            for name, v in r.metrics.items():
                c["metrics"].setdefault(name, []).append(_value_weight(v))


class Recorder:
    def __init__(self, table: ResultTable):
        self.t = table

    def round(self, round_idx: int, log: RoundLog) -> None:
        totals = dict.fromkeys(COMM_METRICS, 0.0)
        step_totals = {s: dict.fromkeys(COMM_METRICS, 0.0) for s in log.steps}
        for cid in sorted(log.order):
            c = log.clients[cid]
            for direction in ("down", "up"):
                sizes = c[direction]
                f = sum(v[0] for v in sizes.values())
                b = sum(v[1] for v in sizes.values())
                self.t.add(round_idx, cid, "client", f"{direction}_floats", f)
                self.t.add(round_idx, cid, "client", f"{direction}_bytes", b)
                totals[f"{direction}_floats"] += f
                totals[f"{direction}_bytes"] += b
                for kind, (kf, kb) in sorted(sizes.items()):
                    self.t.add(round_idx, cid, "client", f"{direction}_floats:{kind}", kf)
                    self.t.add(round_idx, cid, "client", f"{direction}_bytes:{kind}", kb)
            for step, d in c["step"].items():
                for direction in ("down", "up"):
                    f, b = d[direction]
                    self.t.add(round_idx, cid, "client", f"{direction}_floats@{step}", f)
                    self.t.add(round_idx, cid, "client", f"{direction}_bytes@{step}", b)
                    step_totals[step][f"{direction}_floats"] += f
                    step_totals[step][f"{direction}_bytes"] += b
            if c["failed"]:
                self.t.add(round_idx, cid, "client", "failed", 1.0)
                continue
            for name, vws in sorted(c["metrics"].items()):
                if len(vws) == 1:
                    val, w = vws[0]
                else:  # a metric reported by several steps / iterations of the round: their mean
                    val, w = float(np.mean([v for v, _ in vws])), float(np.mean([w for _, w in vws]))
                self.t.add(round_idx, cid, "client", name, val, w)
        for name in COMM_METRICS:
            self.t.add(round_idx, -1, "total", name, totals[name])
        for step in log.steps:
            for name in COMM_METRICS:
                self.t.add(round_idx, -1, "total", f"{name}@{step}", step_totals[step][name])
        self.t.add(round_idx, -1, "total", "participants", sum(not c["failed"] for c in log.clients.values()))
        self.t.add(round_idx, -1, "total", "failures", sum(c["failed"] for c in log.clients.values()))

    def timing(self, round_idx: int, round_s: float, step_s: dict) -> None:
        """Wall-time rows (scope total; they differ run to run: results.without_timing drops them)."""
        self.t.add(round_idx, -1, "total", ROUND_TIME, round_s)
        for name, s in step_s.items():
            self.t.add(round_idx, -1, "total", STEP_TIME + name, s)

    def server(self, round_idx: int, metrics: dict) -> None:
        for name, v in sorted(metrics.items()):
            val, w = _value_weight(v)
            self.t.add(round_idx, -1, "server", name, val, w)

    def evaluation(self, round_idx: int, reports: list[ClientReport]) -> None:
        per_metric: dict[str, list[tuple[float, float]]] = {}
        for r in reports:
            if not r.ok:
                self.t.add(round_idx, r.client_id, "client", "eval_failed", 1.0)
                continue
            for name, v in sorted(r.metrics.items()):
                val, w = _value_weight(v)
                self.t.add(round_idx, r.client_id, "client", name, val, w)
                per_metric.setdefault(name, []).append((val, w))
        for name, vw in sorted(per_metric.items()):
            vals = np.array([v for v, _ in vw])
            ws = np.array([w for _, w in vw])
            self.t.add(round_idx, -1, "mean", name, float(vals.mean()), len(vals))
            sd = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan  # sample std over clients, as results.*
            self.t.add(round_idx, -1, "std", name, sd, len(vals))
            if ws.sum() > 0:
                self.t.add(round_idx, -1, "wmean", name, float((vals * ws).sum() / ws.sum()), float(ws.sum()))


def failure_summary(failures: list[dict]) -> dict:
    """The run's skipped client failures in numbers (the metadata's ``client_failures``; the table has the
    per-round count as ``total``/``failures``): how many, in how many rounds, which clients, the first error."""
    first = failures[0] if failures else None
    return {"count": len(failures), "rounds": len({f["round"] for f in failures}),
            "clients": sorted({f["client_id"] for f in failures}),
            "first": None if first is None else {k: first[k] for k in ("round", "client_id", "stage", "error")}}


class Run:
    """The driver's state of one run, handed to every callback."""

    def __init__(self, prep: Prepared, backend, run_id: str):
        self.prep, self.cfg, self.backend, self.run_id = prep, prep.cfg, backend, run_id
        self.algorithm = prep.algorithm
        self.env = prep.env
        self.table = ResultTable(run_id)
        self.recorder = Recorder(self.table)
        self.failures: list[dict] = []
        self.timing = {"setup_s": 0.0, "round_s": [], "client_compute_s": [], "env_s": [], "setup_phase_s": 0.0}
        self.round_idx = -1  # the last finished round
        self.start_round = 0
        self.setup_done = prep.algorithm.setup_schedule() is None
        self.payload = {}  # the current payload; a setup schedule starts with an empty one
        self.dir: Optional[Path] = None  # the directory being written (RunDirectory)
        self.final_dir: Optional[Path] = None
        self.stopped_early = False
        self.resume_from: Optional[dict] = None  # checkpoint meta when resuming
        # server.mode: async: the event loop (raysim/engine/async_loop.py), whose state checkpoints carry, and when
        # resuming, (its state, the path of its messages shard) from the checkpoint
        self.async_server = None
        self.async_resume: Optional[tuple] = None
        self.async_summary: Optional[dict] = None  # the event loop's figures at the end, for the metadata
        self.backend_report: Optional[BackendReport] = None  # how the backend ran it (once the rounds are done)

    def log_failures(self, reports: list[ClientReport]) -> list[ClientReport]:
        failed = [r for r in reports if not r.ok]
        for r in failed:
            self.failures.append({"round": r.round_idx, "client_id": r.client_id, "stage": r.stage, "error": r.error,
                                  "traceback": r.traceback})
        return failed

    def checkpoint_extra(self) -> dict:
        extra = {"rows": [tuple(r) for r in self.table.rows],  # plain tuples: the checkpoint format
                 "failures": list(self.failures), "resume_hash": resume_hash(self.cfg),
                 "env": self.env.state_dict() if self.env is not None else None, "setup_done": self.setup_done}
        if self.async_server is not None:
            extra["async"] = self.async_server.state_dict()
        return extra


