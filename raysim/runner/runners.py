"""Runners: the Ray-free objects that host server and client state and execute schedule steps. The sequential
backend calls them in-process; the Ray backend wraps the very same classes as actors, so both backends execute
identical code.

A :class:`ClientRunner` hosts a fixed group of virtual clients: their data (compact, on CPU; moved to the device per
step) and a :class:`~raysim.runner.store.StateStore` of their states (created lazily, spilled to disk beyond
``backend.state_memory_mb``). ``run_client_step`` runs one step of the schedule for some of its clients, one after
another, each inside a failure guard; new states stay *pending* until the driver calls ``commit`` (the step's reports
have reached it); with ``backend.vectorize`` a step may run batched instead (:mod:`raysim.runner.executors`: a
method's group form, or the vectorised executor). A :class:`ServerRunner` holds the server state and the server-held data the
method declared, and runs server steps. What a client step reports, and the step's names:
:mod:`raysim.runner.step_reports`.
"""
from __future__ import annotations

import math
import traceback as tb
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from raysim import numerics
from raysim.config import registry
from raysim import rng as rngmod
from raysim.algorithm import Context, ModelCache, ServerContext, ServerUpdate, Task, upload_merger
from raysim.config import DataConfig
from raysim.runner.settings import RunnerSettings
from raysim.data.federated import ClientData, ClientSet, LazyClients
from raysim.runner import fallbacks, faults, safety
from raysim.runner.executors import StepRun, executor_chain
from raysim.runner.step_reports import ClientReport, host_values, step_purpose as _purpose  # noqa: F401 (ClientReport re-exported)
from raysim.messages import from_plain, payload_sizes, to_plain
from raysim.config.registry import load_target
from raysim.steps import ClientStep, ServerStep
from raysim.runner.store import StateStore
from raysim.io.files import atomic_save, load_file
from raysim.errors import ConfigError, DamagedFileError, SimulationError


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("backend.device", "cuda requested but torch.cuda.is_available() is False; use auto or cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class RunSpec:
    """Everything a runner needs to rebuild the algorithm in its own process: its settings (never the whole config:
    raysim.engine.settings), the task, the resolved algorithm class ("module:Class", so runtime registrations reach
    the workers) and its already validated, typed hyperparameters (configs are validated once, on the driver)."""

    runner: RunnerSettings
    data: DataConfig  # read only by client actors that build their clients' data themselves (backend.data)
    task: Task
    algorithm_target: str
    params: Any
    state_dir: Optional[str] = None  # the run's store directory (set by the backend; None: private temporary dirs)
    durable: bool = False  # client stores write every staged/committed state to state_dir (actor-failure retries)
    registry: dict = field(default_factory=dict)  # the driver's user registrations (raysim.config.registry.snapshot)
    code: tuple = ()  # user module files / package directories shipped to the actors (raysim.config.usercode)
    cwd: Optional[str] = None  # the driver's working directory (relative data paths resolve against it)
    server_data: tuple = ()  # the server-held data sets the method declared (Algorithm.server_data; validated)


def _setup_process(s: RunnerSettings) -> torch.device:
    torch.set_num_threads(s.torch_threads)
    device = resolve_device(s.device)
    numerics.enter(s.numerics, device)
    return device


def make_algorithm(spec: RunSpec):
    return load_target(spec.algorithm_target)(spec.params, spec.task)


def enter_run(spec: RunSpec) -> None:
    """Make a runner's process see what the driver saw: the user registrations, and the driver's working directory
    when it exists here (relative data paths; on another node of a cluster it usually does not)."""
    import os
    import sys

    if spec.code:  # the user code shipped to this actor (Ray py_modules) comes first: every node runs the driver's
        # copy, even where Ray also put the driver's working directory on the path (a one-machine cluster)
        shipped = [p for p in sys.path if "py_modules_files" in p]
        sys.path[:] = shipped + [p for p in sys.path if p not in shipped]
    registry.install(spec.registry)
    if spec.cwd and os.path.isdir(spec.cwd) and os.getcwd() != spec.cwd:
        os.chdir(spec.cwd)


def _data_nbytes(d: ClientData) -> int:
    return sum(t.numel() * t.element_size() for t in (d.x_train, d.y_train, d.x_test, d.y_test, d.x_val, d.y_val))


class ClientRunner:
    """Hosts a group of virtual clients: their data stays resident, their states live in the store."""

    def __init__(self, spec: RunSpec, clients: list[ClientData], name: str = "clients"):
        enter_run(spec)
        self.spec = spec
        self.device = _setup_process(spec.runner)
        self.algorithm = make_algorithm(spec)
        self.models = ModelCache(spec.task, self.device)
        if isinstance(clients, LazyClients):  # index ranges into shared pools; a client is built when used
            self.data = clients.view()
        elif isinstance(clients, ClientSet):
            self.data = clients
        else:  # compact, on CPU; decoded onto the device per step
            self.data = {c.client_id: c.compact() for c in clients}
        # decoded (float) data of clients, up to backend.decoded_cache_mb (a multi-exchange round uses each client
        # several times; decoding is exact, so a cached copy is the copy decoding would give). A client is admitted
        # while there is room and stays until it moves away: rounds visit clients in the same order, and under
        # least-recently-used eviction a population just over the budget would never hit
        self._decoded: dict[int, ClientData] = {}
        self._decoded_bytes = 0
        self._decoded_budget = int(spec.runner.decoded_cache_mb * 2**20)
        self.executors = executor_chain(spec.runner)  # how a step runs (raysim.runner.executors)
        self.fallback_log = fallbacks.FallbackLog()  # the fallbacks its executors took this run
        mem = spec.runner.state_memory_mb * 2**20
        directory = Path(spec.state_dir) / "clients" if spec.state_dir else None
        self.store = StateStore(mem, directory, name, durable=spec.durable, owned=self.data)

    def _ctx(self, round_idx: int, client_id: int, step: str = "", iteration: int = 0) -> Context:
        return Context(round_idx, client_id, self.spec.runner.seed, self.device, self.spec.task, self.models,
                       step=step, iteration=iteration)

    # -- what executors see (raysim.runner.executors.StepRun) ---------------------------------------------------------
    def context(self, round_idx: int, client_id: int, step: str = "", iteration: int = 0) -> Context:
        """A client's context for a step (its random streams, device, models)."""
        return self._ctx(round_idx, client_id, step, iteration)

    def client_data(self, cid: int) -> ClientData:
        """A hosted client's data on the runner's device."""
        return self._data(cid)

    def has_test_data(self, cid: int) -> bool:
        return self.data[cid].y_test.numel() > 0

    def finish_update(self, rep: ClientReport, cid: int, res, token: str, uploads: dict) -> None:
        self._finish_update(rep, cid, res, token, uploads)

    def fail(self, rep: ClientReport, cid: int, e: BaseException, uploads: Optional[dict] = None) -> None:
        self._fail(rep, cid, e, uploads)

    def client_ids(self) -> list[int]:
        return sorted(self.data)

    def state(self, cid: int, keep: bool = True):
        """The client's committed state, created on first use (a pure function of (seed, client)). ``keep=False``
        (evaluating a client that never trained): the state is built transiently, not stored."""
        s = self.store.get(cid)
        if s is None:
            rngmod.seed_torch_global(self.spec.runner.seed, rngmod.NO_ROUND, cid, "init")
            s = self.algorithm.init_client_state(self._ctx(rngmod.NO_ROUND, cid, "init"))
            if keep:
                self.store.put_initial(cid, s)
        return s

    def _data(self, cid: int) -> ClientData:
        c = self.data[cid]
        if not c.is_compact:
            return c.to(self.device)
        hit = self._decoded.get(cid)
        if hit is not None:
            return hit
        d = c.to(self.device)
        size = _data_nbytes(d)
        if self._decoded_bytes + size <= self._decoded_budget:
            self._decoded[cid] = d
            self._decoded_bytes += size
        return d

    def _forget_decoded(self, client_ids) -> None:
        for cid in client_ids:
            old = self._decoded.pop(cid, None)
            if old is not None:
                self._decoded_bytes -= _data_nbytes(old)

    def run_client_step(self, step: ClientStep, payload, round_idx: int, iteration: int, client_ids: list[int],
                        merge: Optional[ServerStep] = None) -> tuple[dict, list[ClientReport]]:
        """Run ``step`` for ``client_ids`` (hosted here) in order; returns (uploads by client, reports). ``merge``:
        the server step these uploads feed, when the driver asks for a partial aggregate (``backend.
        partial_aggregate``): the uploads leave as one merged upload under the smallest of their client ids (the
        reports, and so the accounted messages, are per client as ever)."""
        uploads, reports = self._run_client_step(step, payload, round_idx, iteration, client_ids)
        merger = upload_merger(self.algorithm, merge) if merge is not None else None
        merged = _merged(merger, uploads)
        if step.mode == "evaluate":
            _read_metrics(reports)
        elif self._settle(reports, uploads, merged):  # updates were discarded: merge what is left
            merged = _merged(merger, uploads)
        return ({min(uploads): merged} if merged is not None else uploads), reports

    def _settle(self, reports: list, uploads: dict, merged: Optional[dict]) -> bool:
        """The step's divergence check, batched: every client's metrics that are still tensors and the float64 sum of
        each tensor of what leaves this runner (the merged upload, or each client's) read in one host read; a client
        whose loss or metric is NaN/inf, or whose upload is (looked at one by one only when what leaves is), fails
        as diverged: its staged state and upload are dropped (:mod:`raysim.runner.safety`). True when some were."""
        leaving = [merged] if merged is not None else [uploads[c] for c in sorted(uploads)]
        sums = safety.upload_sums(leaving)  # (rows of a vectorised group's stacks: one sum per stack)
        finite = _read_metrics(reports, sums)
        bad = []
        for rep in reports:
            what = safety.nonfinite_metrics(rep.metrics) if rep.ok else None
            if rep.ok and not what and not finite and rep.client_id in uploads:
                what = safety.nonfinite_upload(uploads[rep.client_id])
            if what:
                bad.append((rep, what))
        for rep, what in bad:  # a diverged update never reaches the server; the client keeps its last state
            rep.ok, rep.nonfinite, rep.error = False, what, safety.NONFINITE_PREFIX + what
            rep.metrics, rep.up = {}, {}
            self.store.discard([rep.client_id])
            uploads.pop(rep.client_id, None)
        return bool(bad)

    def _run_client_step(self, step: ClientStep, payload, round_idx: int, iteration: int,
                         client_ids: list[int]) -> tuple[dict, list[ClientReport]]:
        with fallbacks.collecting(self.fallback_log):
            for executor in self.executors:  # the first that takes the step runs it (the loop takes every step)
                run = StepRun(self, step, payload, round_idx, iteration, client_ids)
                if executor.accepts(run) and executor.run(run):
                    return run.result()
        raise AssertionError("the executor chain ends with the per-client loop")

    def _fail(self, rep: ClientReport, cid: int, e: BaseException, uploads: Optional[dict] = None) -> None:
        """A client's step failed: the report says why, its staged state and its upload are dropped. A damaged state
        file is not the client's failure, nor is a fault of the machine (a full disk under the store, out of memory:
        :mod:`raysim.runner.faults`): the run stops, naming it."""
        if isinstance(e, DamagedFileError):
            raise e
        faults.raise_if_machine(e)
        rep.ok, rep.error, rep.traceback = False, f"{type(e).__name__}: {e}", tb.format_exc()
        self.store.discard([cid])
        if uploads is not None:
            uploads.pop(cid, None)

    def _finish_update(self, rep: ClientReport, cid: int, res, token: str, uploads: dict) -> None:
        """A client update's outcome: its state staged (committed later), its upload kept, its metrics (tensors
        still on the device) reported. Whether it diverged is checked for the whole step at its end (``_settle``:
        a diverged update is dropped there, before anything leaves the runner)."""
        self.store.stage(cid, res.state, token)
        uploads[cid] = res.upload
        rep.metrics = dict(res.metrics)
        rep.up = payload_sizes(res.upload)

    def commit(self, client_ids: Optional[list[int]] = None, token: Optional[str] = None) -> None:
        """The step's results reached the driver: its new states become the committed ones."""
        with faults.machine_faults():  # a full disk under the store stops the run (raysim.runner.faults)
            self.store.commit(client_ids, token)

    def discard(self, client_ids: Optional[list[int]] = None) -> None:
        self.store.discard(client_ids)

    # -- moving clients (cost-aware placement, Ray backend) -----------------------------------------------------------
    def export_clients(self, client_ids: list[int]) -> dict:
        """Data and committed state of clients about to move to another runner; they stay here until
        :meth:`forget_clients` (so a move that fails half-way loses nothing)."""
        return {cid: (self.data[cid], self.store.get(cid)) for cid in client_ids}

    def adopt_clients(self, *exports: dict) -> list[int]:
        ids = []
        for ex in exports:
            for cid, (data, state) in ex.items():
                self._forget_decoded([cid])
                self.data[cid] = data
                self.store.adopt(cid, state)
                ids.append(cid)
        return sorted(ids)

    def forget_clients(self, client_ids: list[int]) -> None:
        self._forget_decoded(client_ids)
        for cid in client_ids:
            self.data.pop(cid, None)
        self.store.forget(client_ids)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save_shard(self, path: str) -> list[int]:
        with faults.machine_faults(faults.CHECKPOINTS):
            return self.store.save_shard(Path(path))

    def load_shards(self, paths: list[str]) -> list[int]:
        mine = set(self.data)
        loaded = []
        for p in paths:
            loaded += self.store.load_shard(Path(p), keep=mine)
        return sorted(loaded)

    def store_stats(self) -> dict:
        return {"in_memory_bytes": self.store.memory_in_use(), "spills": self.store.spills, "loads": self.store.loads,
                "clients": len(self.store.client_ids())}

    def fallbacks_taken(self) -> list[dict]:
        """The fallbacks this runner's executors took this run (raysim.runner.fallbacks), each once."""
        return self.fallback_log.taken()

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        self.store.close()


def _merged(merger, uploads: dict) -> Optional[dict]:
    """The partial aggregate of a step's uploads (None: no merge asked, none defined, or fewer than two uploads)."""
    if merger is None or len(uploads) < 2:
        return None
    return merger({cid: uploads[cid] for cid in sorted(uploads)})


def _read_metrics(reports: list, extra: Optional[list] = None) -> bool:
    """Replace every 0-dim tensor among the reports' metric values (also inside ``(value, weight)`` pairs) by its
    Python float, reading them and the ``extra`` 0-dim tensors in one host read per device
    (:func:`raysim.runner.step_reports.host_values`); True when every ``extra`` value is finite."""
    slots, tensors = [], []
    for rep in reports:
        for k, v in rep.metrics.items():
            if torch.is_tensor(v) and v.dim() == 0:
                slots.append((rep.metrics, k, None))
                tensors.append(v)
            elif isinstance(v, tuple) and v and torch.is_tensor(v[0]) and v[0].dim() == 0:
                slots.append((rep.metrics, k, v))
                tensors.append(v[0])
    values = host_values(tensors + list(extra or []))
    for (metrics, k, pair), value in zip(slots, values):
        metrics[k] = value if pair is None else (value, *pair[1:])
    return all(math.isfinite(v) for v in values[len(tensors):])


def server_data(spec: RunSpec, fed_data) -> dict:
    """The server-held data sets the run's method declared (``spec.server_data``), by name: what a backend ships to
    the server runner (nothing else of the data reaches it but the test set, for evaluation steps)."""
    return {name: getattr(fed_data, name) for name in spec.server_data}


class ServerRunner:
    """Holds the server state; runs server steps."""

    def __init__(self, spec: RunSpec, global_test=None, server_data: Optional[dict] = None):
        enter_run(spec)
        self.spec = spec
        self.device = _setup_process(spec.runner)
        self.algorithm = make_algorithm(spec)
        self.models = ModelCache(spec.task, self.device)
        self.global_test = global_test  # read only by evaluation steps (passed as their argument)
        # the declared server-held data (RunSpec.server_data): what train/setup server steps may read (ctx.server_data)
        self.server_data = dict(server_data or {})
        rngmod.seed_torch_global(spec.runner.seed, rngmod.NO_ROUND, rngmod.SERVER, "init")
        self.state = self.algorithm.init_server_state(self._ctx(rngmod.NO_ROUND))
        # server.mode: async with FedBuff: the server state of each older version a client in flight was dispatched
        # with (version -> state), one per version however many clients share it, dropped when none is left
        self.versions: dict[int, Any] = {}

    def _ctx(self, round_idx: int, failures=None, step: str = "", iteration: int = 0) -> ServerContext:
        return ServerContext(round_idx, rngmod.SERVER, self.spec.runner.seed, self.device, self.spec.task, self.models,
                             step=step, iteration=iteration, failures=list(failures or []),
                             server_data=dict(self.server_data))

    def initial_payload(self, round_idx: int):
        return self.algorithm.initial_payload(self.state, self._ctx(round_idx, step="broadcast"))

    def run_server_step(self, step: ServerStep, round_idx: int, iteration: int, failures: list, *upload_groups,
                        keep: Optional[list] = None):
        """Returns (payload or None, metrics). ``keep``: the client ids whose uploads reach the algorithm (the
        environment drops late/dropped ones: the step sees the delivered uploads only); uploads are sorted by client
        id, whatever the actor layout."""
        fn = getattr(self.algorithm, step.method)
        ctx = self._ctx(round_idx, failures, step.name, iteration)
        info = getattr(step, "asynchronous", None)  # server.mode: async (raysim/engine/async_loop.py)
        ctx.asynchronous = self._async_bases(info) if info is not None and "dispatch" in info else info
        rngmod.seed_torch_global(self.spec.runner.seed, round_idx, rngmod.SERVER, _purpose(step, iteration))
        if step.mode == "evaluate":
            if self.global_test is None:
                return None, {}
            return None, dict(fn(self.state, self.global_test, ctx))
        uploads = {}
        for group in upload_groups:
            uploads.update(group or {})
        if keep is not None:
            keep_set = set(keep)
            uploads = {cid: u for cid, u in uploads.items() if cid in keep_set}
        uploads = {cid: uploads[cid] for cid in sorted(uploads)}
        out = fn(self.state, uploads, ctx)
        if not isinstance(out, ServerUpdate):
            raise TypeError(f"{type(self.algorithm).__name__}.{step.method} must return a ServerUpdate, got "
                            f"{type(out).__name__}")
        if info is not None and "live" in info:
            self._keep_versions(int(info["version"]), info["live"])
        self.state = out.state
        return out.payload, dict(out.metrics)

    # -- FedBuff's dispatch versions (server.mode: async) -------------------------------------------------------------
    def _async_bases(self, info: dict) -> dict:
        """``ctx.asynchronous`` with ``bases``: the state of each stale update's dispatch version (the current state
        is the current version's, so fresh updates need none)."""
        now = int(info["version"])
        missing = sorted({v for v in info["dispatch"].values() if v != now and v not in self.versions})
        if missing:
            raise SimulationError(f"async: no server state kept for versions {missing} (held: {sorted(self.versions)})")
        bases = {c: self.versions[v] for c, v in sorted(info["dispatch"].items()) if v != now}
        return {**{k: v for k, v in info.items() if k != "live"}, "bases": bases}

    def _keep_versions(self, now: int, live) -> None:
        """Before the state moves past version ``now``: keep a copy of it when a client in flight was dispatched with
        it, and drop the versions no client in flight refers to any more (``live``: the driver's count)."""
        live = set(int(v) for v in live)
        if now in live:
            self.versions[now] = _map_tensors(self.state, lambda t: t.detach().clone())
        for v in [v for v in self.versions if v not in live]:
            del self.versions[v]

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        shard = {"state": _to_cpu(self.state)}
        if self.versions:  # server.mode: async (FedBuff): the dispatch versions still in flight
            shard["versions"] = {int(v): _to_cpu(st) for v, st in sorted(self.versions.items())}
        atomic_save(shard, Path(path))

    def load(self, path: str) -> None:
        shard = load_file(Path(path))
        self.state = _to_device(shard["state"], self.device)
        self.versions = {int(v): _to_device(st, self.device) for v, st in (shard.get("versions") or {}).items()}

    def save_messages(self, path: str, payloads: dict, uploads: dict) -> None:
        """server.mode: async checkpoints: the payloads of the versions untrained clients will train from
        (version -> payload) and the uploads of the trained clients not yet aggregated (batch -> (its upload groups,
        the client ids to keep)), as one state file. Written here, where uploads are read anyway: never gathered on
        the driver."""
        kept = {}
        for b, (groups, keep) in sorted(uploads.items()):
            merged = {}
            for group in groups or []:
                merged.update(group or {})
            kept[int(b)] = {int(c): to_plain(_to_cpu(merged[c])) for c in sorted(keep) if c in merged}
        atomic_save({"payloads": {int(v): to_plain(_to_cpu(p)) for v, p in sorted(payloads.items())},
                     "uploads": kept}, Path(path))

    def load_messages(self, path: str) -> dict:
        """What :meth:`save_messages` wrote: {"payloads": {version: payload}, "uploads": {batch: {client id:
        upload}}}."""
        data = load_file(Path(path))
        return {"payloads": {int(v): from_plain(p) for v, p in data["payloads"].items()},
                "uploads": {int(b): {int(c): from_plain(u) for c, u in g.items()} for b, g in data["uploads"].items()}}

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing to release (the client runner's counterpart closes its state store)."""


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _to_cpu(obj):
    return _map_tensors(obj, lambda t: t.detach().to("cpu"))


def _to_device(obj, device):
    return _map_tensors(obj, lambda t: t.to(device))
