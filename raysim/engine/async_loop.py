"""The asynchronous server (``server.mode: async``): an event-driven loop on the environment's simulated clock.

``server.concurrency`` clients are in flight at once. A client is *dispatched* at simulated time t with the current
server version's payload; the environment (``env.async_event``) says when its upload arrives (its speed x its work
+ its link, jitter and stragglers) or when it drops out, from draws keyed by (seed, dispatch number, client). On
each arrival the server applies the update by the rule (raysim/asyncrules.py): FedBuff aggregates every
``buffer_size`` arrivals, FedAsync applies each one with weight ``alpha * s(tau)``; each application is a server
version (rows at ``round`` = version index, like a synchronous round). A freed slot is given at once to another
client (uniform among the online clients that are neither in flight nor waiting in the buffer).

**Determinism.** Events are ordered by (simulated time, client id), never by wall-clock arrival. Training does not
happen at dispatch: a dispatched client waits, *untrained*, until the earliest time its event could happen (its
event time with no bytes counted, a lower bound) is not after the earliest known event; then every untrained client
is trained at once, one backend ``client_step`` per dispatch version and at most ``MAX_BATCH`` clients (the batch:
one call per actor). A client's
training depends only on its dispatch payload, its state (it cannot be dispatched twice at once) and its random
streams, keyed by the batch's index (``round_idx`` of the client step; deterministic, since the batching decisions
are made on simulated times only). So the table is the same on every backend, actor count and spill setting.

Backends are used through their two primitives only: each batch's new states are committed at once (a client's
local state is its own from then on), its uploads stay behind their handle until every client of the batch has
arrived or dropped out; an aggregation passes the handles of its buffered clients' batches with ``keep`` = their
ids (a buffered client is never re-dispatched before the aggregation, so one upload per client).

**Checkpoints** are taken at the end of a version, through the synchronous machinery (the Checkpointer asks
``run.async_server`` for :meth:`AsyncServer.state_dict` and the ``async.pt`` messages shard); there is no random
state to save (every draw is keyed by seed, dispatch number or batch index), so a resumed run continues with the
same table. **FedBuff** sends the server runner the buffered clients' dispatch versions and the versions still in
flight, for methods that rebase their uploads (``Asynchronous.async_rebase``): the runner keeps one state per such
version. ``env.server_s`` is each aggregation's simulated time.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from raysim import rng as rngmod
from raysim.algorithm import Asynchronous
from raysim.asyncrules import mixing_weight, staleness_weight
from raysim.runner import safety
from raysim.engine.run_record import RoundLog, Run
from raysim.runner.step_reports import ClientReport, step_token
from raysim.errors import DamagedFileError, SimulationError
from raysim.steps import ClientStep, ServerStep, flatten
from raysim.io.resume_points import damaged_hint

WAKE = -1  # a pseudo client id: retry dispatching when no client was online (sorts before real ids at equal times)
MAX_STALL_S = 30 * 86400.0  # simulated seconds an async server waits for an update before it stops (a stall)
EXACT_PICK_MAX = 4096  # populations up to this size pick among the idle clients exactly; larger ones by rejection
# clients per client step: an aggregation reads the whole upload groups of its updates' batches (the backends return
# one handle per actor and step), so a batch of 1,000 would make every FedAsync version deserialise 1,000 uploads;
# batches of at most this many keep that read small (benchmarks/ASYNC.md: 16 brought a FedAsync version at
# 100,000 clients from 409 ms to 13 ms) for one extra backend call per 16 clients trained
MAX_BATCH = 16
MESSAGES_SHARD = "async.pt"  # a checkpoint's payloads and uploads of the clients in flight (ServerRunner.save_messages)


@dataclass(frozen=True, eq=False)
class AsyncServerStep(ServerStep):
    """The async server step: ``ServerRunner.run_server_step`` hands ``asynchronous`` to the method as
    ``ctx.asynchronous`` (rule, mixing weight, per-client staleness and weights, version)."""

    asynchronous: Optional[dict] = None


@dataclass
class Flight:
    cid: int
    seq: int  # dispatch number: keys the environment's draws (and the pick)
    t0: float  # simulated dispatch time
    version: int  # server version of the payload it trains from
    lb: float  # lower bound of its event time (no bytes counted)
    batch: int = -1  # the client step it trained in (-1: not yet)
    report: object = None
    event_t: float = math.nan
    compute_s: float = 0.0
    comm_s: float = 0.0
    dropped: bool = False
    straggler: bool = False


def _plain(v):
    """A value as plain Python (checkpoint files hold tensors and plain containers only: no numpy scalars)."""
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    return v.item() if hasattr(v, "item") and type(v) not in (int, float, bool) else v  # numpy.float64 is a float


def _flight_state(f: Flight) -> dict:
    d = {k: _plain(v) for k, v in dataclasses.asdict(f).items() if k != "report"}
    d["report"] = None
    if f.report is not None:
        r = dataclasses.asdict(f.report)
        r = {k: _plain(v) if not isinstance(v, dict) else v for k, v in r.items()}
        r["metrics"] = {k: _plain(v) for k, v in r["metrics"].items()}
        r["up"] = {k: tuple(int(x) for x in v) for k, v in r["up"].items()}
        r["down"] = {k: tuple(int(x) for x in v) for k, v in r["down"].items()}
        d["report"] = r
    return d


def _flight(d: dict) -> Flight:
    d = dict(d)
    if d["report"] is not None:
        d["report"] = ClientReport(**d["report"])
    return Flight(**d)


class AsyncServer:
    def __init__(self, run: Run, evaluate: Callable):
        self.run, self.cfg, self.backend, self.env = run, run.cfg, run.backend, run.env
        self.evaluate = evaluate
        s = self.cfg.server
        self.rule, self.k = s.rule, (s.buffer_size if s.rule == "fedbuff" else 1)
        self.step = next(st for st, _ in flatten(run.algorithm.schedule()) if isinstance(st, ClientStep))
        # FedBuff applies deltas against the dispatch versions where the method's uploads are trained copies of the
        # server state (it overrides Asynchronous.async_rebase); only then does the server keep older versions' states
        self.rebases = self.rule == "fedbuff" and type(run.algorithm).async_rebase is not Asynchronous.async_rebase
        self.n = self.cfg.data.num_clients
        self.version, self.seq, self.batch = 0, 0, 0
        self.flights: dict[int, Flight] = {}  # dispatched, not yet resolved
        self.busy: set[int] = set()  # in flight or waiting in the buffer
        self.untrained: list = []  # heap (lower bound, client id)
        self.events: list = []  # heap (event time, client id)
        self.batches: dict[int, list] = {}  # batch -> [upload handle, clients not yet resolved]
        self.payloads: dict[int, object] = {}  # version -> payload handle (while someone may still train from it)
        self.buffer: list[Flight] = []
        self.wake_pending = False
        self.pending_dispatch = False  # a version was just applied; its freed slots are not refilled yet
        self.t_last = 0.0  # simulated time of the last version (its aggregation done: env.server_s after it began)
        self.t_progress = 0.0  # simulated time of the last update that reached the buffer (a stall is bounded)
        self.server_s = float(getattr(getattr(self.env, "cfg", None), "server_s", 0.0) or 0.0)
        self._reset_interval()
        self.stats = {"updates": 0, "applied": 0, "dropped": 0, "discarded": 0, "failed": 0, "batches": 0,
                      "engine_s": 0.0, "client_step_s": 0.0, "server_step_s": 0.0, "eval_s": 0.0,
                      "train_s": 0.0, "callbacks_s": 0.0}

    def _reset_interval(self) -> None:
        self.log = RoundLog()
        self.resolved: dict[int, dict] = {}  # client -> its rows in this version's interval
        self.failures: list = []

    # -- dispatch ---------------------------------------------------------------------------------------------------
    def _pick(self, now: float) -> tuple[int, Optional[int]]:
        """A client for a free slot: uniform among the idle clients that are online at ``now`` (seeded by the
        dispatch number, which every attempt consumes)."""
        seq = self.seq
        self.seq += 1
        r = rngmod.numpy_rng(self.cfg.seed, seq, rngmod.SERVER, "async-dispatch")
        if self.n <= EXACT_PICK_MAX:
            idle = [c for c in range(self.n) if c not in self.busy]
            for i in r.permutation(len(idle)):
                c = idle[int(i)]
                if self.env.async_available(seq, c, now):
                    return seq, c
            return seq, None
        for _ in range(256):
            c = int(r.integers(self.n))
            if c not in self.busy and self.env.async_available(seq, c, now):
                return seq, c
        return seq, None

    def dispatch(self, now: float) -> None:
        self._check_stall(now)
        now = max(now, self.t_last)  # a slot freed while the server aggregates waits for the new version
        while len(self.flights) < self.cfg.server.concurrency:
            seq, c = self._pick(now)
            if c is None:
                # idle clients, none online: the free slots retry after the environment's idle time (at least 1 s,
                # so the clock moves); no idle client at all: the next arrival or aggregation frees one
                if not self.wake_pending and len(self.busy) < self.n:
                    self.wake_pending = True
                    idle_s = getattr(getattr(getattr(self.env, "cfg", None), "participation", None), "idle_s", 60.0)
                    heapq.heappush(self.events, (now + max(float(idle_s), 1.0), WAKE))
                return
            _, _, dt, _, _ = self.env.async_event(seq, c, None)
            f = Flight(c, seq, now, self.version, now + dt)
            self.flights[c] = f
            self.busy.add(c)
            heapq.heappush(self.untrained, (f.lb, c))

    # -- training in batches ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Train every untrained client: one client step per dispatch version (at most MAX_BATCH clients each), in
        version order."""
        by_version: dict[int, list[int]] = {}
        for _, c in self.untrained:
            by_version.setdefault(self.flights[c].version, []).append(c)
        self.untrained = []
        chunks = [(v, ids[i:i + MAX_BATCH]) for v in sorted(by_version) for ids in [sorted(by_version[v])]
                  for i in range(0, len(ids), MAX_BATCH)]
        for v, ids in chunks:
            b = self.batch
            self.batch += 1
            t0 = time.perf_counter()
            uploads, reports = self.backend.client_step(self.step, self.payloads[v], b, 0, ids)
            self.backend.commit([r.client_id for r in reports if r.ok], step_token(b, self.step, 0))
            self.stats["client_step_s"] += time.perf_counter() - t0
            self.stats["batches"] += 1
            safety.decide(self.cfg.on_nonfinite, b, reports, self.step.name)  # raises under stop
            failed = self.run.log_failures(reports)
            if failed and self.cfg.on_client_failure == "stop":
                r = failed[0]
                raise SimulationError(f"batch {b}, step '{self.step.name}': client {r.client_id} failed: {r.error}\n"
                                      f"{r.traceback}")
            self.batches[b] = [uploads, len(ids)]
            for r in reports:
                f = self.flights[r.client_id]
                f.batch, f.report = b, r
                self.stats["train_s"] += r.seconds
                f.compute_s, f.comm_s, dt, f.dropped, f.straggler = self.env.async_event(f.seq, f.cid, r)
                f.event_t = f.t0 + dt
                heapq.heappush(self.events, (f.event_t, f.cid))
        live = {f.version for f in self.flights.values() if f.batch < 0}
        self.payloads = {v: p for v, p in self.payloads.items() if v in live or v == self.version}

    def _release(self, f: Flight) -> None:
        entry = self.batches[f.batch]
        entry[1] -= 1
        if entry[1] == 0:
            del self.batches[f.batch]  # every client of the batch resolved: its uploads may go

    # -- events -----------------------------------------------------------------------------------------------------
    def resolve(self, f: Flight, now: float) -> None:
        """An arrival (into the buffer, or discarded as too stale), a drop-out or a failure."""
        self._check_stall(now)
        r = f.report
        self.log.add(self.step.name, [r])
        row = self.resolved.setdefault(f.cid, {"sim_compute_s": 0.0, "sim_comm_s": 0.0, "dropped": 0.0,
                                               "discarded": 0.0, "straggler": 0.0})
        row["sim_compute_s"] += f.compute_s
        row["sim_comm_s"] += f.comm_s
        row["sim_finish_s"] = f.event_t
        row["straggler"] += float(f.straggler)
        tau = self.version - f.version
        max_tau = self.cfg.server.max_staleness
        self.stats["updates"] += 1
        if not r.ok:
            self.stats["failed"] += 1
            self.failures.append((f.cid, r.error))
        elif f.dropped:
            row["dropped"] += 1.0
            self.stats["dropped"] += 1
            self.failures.append((f.cid, "env: dropped out before its upload arrived"))
        elif max_tau is not None and tau > max_tau:
            row["discarded"] += 1.0
            self.stats["discarded"] += 1
            self.failures.append((f.cid, f"async: discarded, {tau} versions stale (server.max_staleness={max_tau})"))
        else:
            row["staleness"] = float(tau)
            self.buffer.append(f)
            self.t_progress = max(self.t_progress, now)
            return  # stays busy (and its batch's uploads alive) until the aggregation
        row["wasted_s"] = row.get("wasted_s", 0.0) + f.compute_s
        self.busy.discard(f.cid)
        self._release(f)

    def _check_stall(self, now: float) -> None:
        """An async server that has waited :data:`MAX_STALL_S` of simulated time without one update reaching its
        buffer (every client dropping out, never online, failing or too stale) stops with one line instead of
        simulating forever (issue 50)."""
        if now - self.t_progress > MAX_STALL_S:
            raise SimulationError(f"async: no client update arrived in {MAX_STALL_S / 86400:g} simulated days (since "
                                  f"t={self.t_progress:,.0f} s, version {self.version}); every dispatched client "
                                  f"dropped out, was offline, failed or came too stale: check env.participation "
                                  f"(dropout, availability) and server.max_staleness")

    def aggregate(self, now: float) -> None:
        s = self.cfg.server
        buf = sorted(self.buffer, key=lambda f: f.cid)
        ids = [f.cid for f in buf]
        taus = {f.cid: self.version - f.version for f in buf}
        kw = dict(fn=s.staleness.fn, a=s.staleness.a, b=s.staleness.b)
        weights = {c: staleness_weight(t, **kw) for c, t in taus.items()}
        mix = mixing_weight(self.rule, [weights[c] for c in ids], alpha=s.alpha, server_lr=s.server_lr)
        info = {"rule": self.rule, "mix": mix, "staleness": taus, "weights": weights, "version": self.version}
        if self.rebases:  # deltas against the dispatch versions: the server keeps one state per older version
            info["dispatch"] = {f.cid: f.version for f in buf}  # still referenced by a client in flight
            info["live"] = sorted({f.version for f in self.flights.values()})
        step = AsyncServerStep("async_aggregate", "async_aggregate", asynchronous=info)
        handles = []
        for b in sorted({f.batch for f in buf}):
            handles += list(self.batches[b][0] or [])
        now = float(max(now, self.t_last) + self.server_s)  # env.server_s: the server's time per aggregation
        t0 = time.perf_counter()
        payload, metrics = self.backend.server_step(step, self.version, 0, handles, sorted(self.failures), keep=ids)
        self.stats["server_step_s"] += time.perf_counter() - t0
        i = self.version
        safety.check_metrics(i, -1, step.name, metrics)
        self.run.recorder.server(i, metrics)
        self._record(i, now, buf, taus, mix)
        for f in buf:
            self.busy.discard(f.cid)
            self._release(f)
        self.stats["applied"] += len(buf)
        self.buffer = []
        self.version += 1
        self.t_last = now
        if payload is not None:
            self.run.payload = payload
        self.payloads[self.version] = self.run.payload
        self.env.sim_time = now

    def _record(self, i: int, now: float, buf: list, taus: dict, mix: float) -> None:
        t = self.run.table
        self.run.recorder.round(i, self.log)  # traffic and training metrics of the clients resolved since i - 1
        for c in sorted(self.resolved):
            for name, v in sorted(self.resolved[c].items()):
                t.add(i, c, "client", name, float(v))
        st = [taus[f.cid] for f in buf]
        rows = self.resolved.values()
        for name, v in (("sim_round_s", now - self.t_last), ("sim_time", now), ("updates", len(buf)),
                        ("staleness_mean", sum(st) / len(st)), ("staleness_max", max(st)), ("mix", mix),
                        ("dropped", sum(r["dropped"] for r in rows)), ("discarded", sum(r["discarded"] for r in rows)),
                        ("wasted_s", sum(r.get("wasted_s", 0.0) for r in rows)), ("in_flight", len(self.flights))):
            t.add(i, -1, "env", name, float(v))
        self._reset_interval()

    # -- checkpoints (the Checkpointer calls these at the end of a version, through run.async_server) ---------------
    def state_dict(self) -> dict:
        """The event loop's state at the end of a version, in plain values: the clients in flight (dispatch
        number and version, simulated times, their reports once trained), the buffer, both event heaps as they
        are, the counters and statistics. The server state, the per-version states FedBuff keeps (server shard),
        the client states (client shards), the payloads and uploads of the clients in flight (:meth:`save_messages`)
        and the environment's state travel beside it."""
        if self.log.order or self.resolved or self.failures:
            raise SimulationError("async: a checkpoint in the middle of a version's interval (internal error)")
        return {"version": self.version, "seq": self.seq, "batch": self.batch, "t_last": float(self.t_last),
                "t_progress": float(self.t_progress), "wake_pending": self.wake_pending,
                "pending_dispatch": self.pending_dispatch,
                "flights": [_flight_state(f) for _, f in sorted(self.flights.items())],
                "buffer": [_flight_state(f) for f in self.buffer],
                "untrained": [(float(t), int(c)) for t, c in self.untrained],
                "events": [(float(t), int(c)) for t, c in self.events],
                "batches": {int(b): int(e[1]) for b, e in sorted(self.batches.items())},
                "payload_versions": sorted(self.payloads), "stats": {k: _plain(v) for k, v in self.stats.items()}}

    def save_messages(self, directory: str) -> dict:
        """The checkpoint's messages shard (the backend's server runner writes it): the payloads of the versions
        untrained clients will train from (and the current one), and the uploads of the trained clients that may
        still be applied (neither failed nor dropping out)."""
        keep: dict[int, list] = {}
        for f in [*self.flights.values(), *self.buffer]:
            if f.batch >= 0 and f.report is not None and f.report.ok and not f.dropped:
                keep.setdefault(f.batch, []).append(f.cid)
        self.backend.save_messages(os.path.join(directory, MESSAGES_SHARD), dict(self.payloads),
                                   {b: (self.batches[b][0], sorted(ids)) for b, ids in sorted(keep.items())})
        return {"async": MESSAGES_SHARD}

    def restore(self, state: dict, messages: str) -> None:
        """Continue from a checkpoint (``state_dict`` and the messages shard at ``messages``)."""
        try:
            self._restore(state, messages)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            meta = Path(messages).with_name("meta.pt")
            raise DamagedFileError(meta, f"its async server state does not fit this run ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})",
                                   damaged_hint(meta.parent)) from None

    def _restore(self, state: dict, messages: str) -> None:
        self.version, self.seq, self.batch = int(state["version"]), int(state["seq"]), int(state["batch"])
        self.t_last = float(state["t_last"])
        self.t_progress = max(self.t_last, float(state.get("t_progress", 0.0)))
        self.wake_pending, self.pending_dispatch = bool(state["wake_pending"]), bool(state["pending_dispatch"])
        self.flights = {int(d["cid"]): _flight(d) for d in state["flights"]}
        self.buffer = [_flight(d) for d in state["buffer"]]
        self.busy = set(self.flights) | {f.cid for f in self.buffer}
        self.untrained = [(float(t), int(c)) for t, c in state["untrained"]]
        self.events = [(float(t), int(c)) for t, c in state["events"]]
        known = set(self.flights) | {WAKE}
        if any(c not in self.flights for _, c in self.untrained) or any(c not in known for _, c in self.events):
            raise ValueError("an event of a client that is not in flight")
        self.stats.update({k: type(self.stats[k])(v) for k, v in state["stats"].items() if k in self.stats})
        payloads, uploads = self.backend.load_messages(messages)
        if sorted(payloads) != [int(v) for v in state["payload_versions"]] or self.version not in payloads:
            raise ValueError(f"payloads of versions {sorted(payloads)}, expected {state['payload_versions']}")
        self.payloads = dict(payloads)
        self.batches = {int(b): [uploads.get(int(b)), int(n)] for b, n in state["batches"].items()}
        if any(f.batch >= 0 and f.batch not in self.batches for f in [*self.flights.values(), *self.buffer]):
            raise ValueError("a trained client of a batch the checkpoint does not hold")

    # -- the loop ---------------------------------------------------------------------------------------------------
    def run_loop(self, callbacks: list) -> None:
        run, cfg = self.run, self.cfg
        t_start = time.perf_counter()
        if run.async_resume is not None:  # continue from a checkpoint taken at the end of a version
            self.restore(*run.async_resume)
            run.payload = self.payloads[self.version]
            if self.pending_dispatch:
                self.dispatch(self.t_last)
                self.pending_dispatch = False
        else:
            run.payload = self.backend.initial_payload(0)
            self.payloads[0] = run.payload
            self.dispatch(0.0)
        t_version = time.perf_counter()
        while self.version < cfg.rounds:
            next_t = self.events[0][0] if self.events else math.inf
            if self.untrained and self.untrained[0][0] <= next_t:
                self.flush()
                continue
            if not self.events:
                raise SimulationError("async: no client in flight and none to dispatch (internal error)")
            now, cid = heapq.heappop(self.events)
            if cid == WAKE:
                self.wake_pending = False
                self.dispatch(now)
                continue
            self.resolve(self.flights.pop(cid), now)
            if len(self.buffer) >= self.k:
                i = self.version
                self.aggregate(now)
                self.pending_dispatch = True
                step_s: dict = {}
                evaluated = (i + 1) % cfg.eval.every == 0 or i == cfg.rounds - 1
                t0 = time.perf_counter()
                if evaluated:
                    self.evaluate(run, i, step_s)
                run.round_idx = i
                run.timing["round_s"].append(time.perf_counter() - t_version)
                run.recorder.timing(i, run.timing["round_s"][-1], step_s)
                self.stats["eval_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                stop = False
                for cb in callbacks:
                    stop = bool(cb.on_round_end(run, i, evaluated)) or stop
                self.stats["callbacks_s"] += time.perf_counter() - t0
                t_version = time.perf_counter()
                if stop:
                    run.stopped_early = True
                    break
            self.dispatch(now)
            self.pending_dispatch = False
        total = time.perf_counter() - t_start
        st = self.stats
        st["wall_s"] = total
        st["engine_s"] = total - st["client_step_s"] - st["server_step_s"] - st["eval_s"] - st["callbacks_s"]
        st["in_flight_at_end"] = len(self.flights)
        st["trained_in_flight_at_end"] = sum(1 for f in self.flights.values() if f.batch >= 0)
        st["buffered_at_end"] = len(self.buffer)
        st["sim_time"] = self.t_last
        run.timing["async"] = dict(st)


def run_async(run: Run, callbacks: list, evaluate: Callable) -> None:
    """The async counterpart of ``loop.run_loop`` (called by it with its evaluation function)."""
    server = AsyncServer(run, evaluate)
    run.async_server = server  # checkpoints carry its state (callbacks.Checkpointer)
    server.run_loop(callbacks)
    s = server.stats
    run.async_summary = {"rule": run.cfg.server.rule, "versions": server.version, "updates_resolved": s["updates"],
                         "applied": s["applied"], "dropped": s["dropped"], "discarded": s["discarded"],
                         "failed": s["failed"], "in_flight_at_end": s["in_flight_at_end"],
                         "buffered_at_end": s["buffered_at_end"], "sim_time": float(s["sim_time"]), "batches": s["batches"]}
