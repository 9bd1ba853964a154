"""Runners: the Ray-free objects that host server and client state. The sequential backend calls them in-process;
the Ray backend wraps the very same classes as actors, so both backends execute identical code."""
from __future__ import annotations

import time
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from raysim import rng as rngmod
from raysim.algorithm import Context, ModelCache, Task
from raysim.config import ConfigError, ExperimentConfig
from raysim.data.federated import ClientData
from raysim.messages import payload_sizes
from raysim.registry import algorithm_class, load_target


class SimulationError(RuntimeError):
    """The run could not go on (e.g. every sampled client failed)."""


@dataclass
class ClientReport:
    client_id: int
    round_idx: int
    stage: str  # "update" or "evaluate"
    ok: bool = True
    metrics: dict = field(default_factory=dict)  # name -> value or (value, weight)
    up: dict = field(default_factory=dict)  # kind -> (floats, bytes)
    down: dict = field(default_factory=dict)
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0  # wall time (diagnostic only; never in the result table)
    nonfinite: str = ""  # what was NaN/inf in the update (raysim.safety); the update was discarded


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("backend.device", "cuda requested but torch.cuda.is_available() is False; use auto or cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class RunSpec:
    """Everything a runner needs to rebuild the algorithm in its own process."""

    cfg: ExperimentConfig
    task: Task
    algorithm_target: str = ""  # "module:Class", resolved on the driver so runtime registrations reach the workers


def _setup_process(cfg: ExperimentConfig) -> torch.device:
    torch.set_num_threads(cfg.backend.torch_threads)
    return resolve_device(cfg.backend.device)


def _make_algorithm(spec: RunSpec):
    cls = load_target(spec.algorithm_target) if spec.algorithm_target else algorithm_class(spec.cfg.algorithm.name)
    return cls.from_config(spec.cfg.algorithm.params, spec.task)


class ClientRunner:
    """Hosts a group of virtual clients: their data and their state stay resident here across rounds."""

    def __init__(self, spec: RunSpec, clients: list[ClientData]):
        self.spec = spec
        self.device = _setup_process(spec.cfg)
        self.algorithm = _make_algorithm(spec)
        self.models = ModelCache(spec.task, self.device)
        self.data = {c.client_id: c.to(self.device) for c in clients}
        self.states: dict[int, Any] = {}
        for cid in sorted(self.data):
            ctx = self._ctx(rngmod.NO_ROUND, cid)
            rngmod.seed_torch_global(spec.cfg.seed, rngmod.NO_ROUND, cid, "init")
            self.states[cid] = self.algorithm.init_client_state(ctx)

    def _ctx(self, round_idx: int, client_id: int) -> Context:
        return Context(round_idx, client_id, self.spec.cfg.seed, self.device, self.spec.task, self.models)

    def client_ids(self) -> list[int]:
        return sorted(self.data)

    def run_updates(self, payload, round_idx: int, client_ids: list[int]) -> tuple[dict, list[ClientReport]]:
        from raysim import safety  # imports SimulationError from this module

        uploads, reports = {}, []
        for cid in client_ids:
            t0 = time.perf_counter()
            down = self.algorithm.downlink(payload, cid)
            rep = ClientReport(cid, round_idx, "update", down=payload_sizes(down))
            try:
                rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, cid, "update")
                res = self.algorithm.client_update(down, self.states[cid], self.data[cid], self._ctx(round_idx, cid))
                rep.nonfinite = safety.check_update(res.metrics, res.upload) or ""
                if rep.nonfinite:  # a diverged update never reaches the server; the client keeps its last state
                    rep.ok, rep.error = False, safety.NONFINITE_PREFIX + rep.nonfinite
                else:
                    self.states[cid] = res.state
                    uploads[cid] = res.upload
                    rep.metrics = dict(res.metrics)
                    rep.up = payload_sizes(res.upload)
            except Exception as e:  # a failing client is a value, not a crashed pool
                rep.ok, rep.error, rep.traceback = False, f"{type(e).__name__}: {e}", tb.format_exc()
            rep.seconds = time.perf_counter() - t0
            reports.append(rep)
        return uploads, reports

    def evaluate(self, payload, round_idx: int, client_ids: list[int]) -> list[ClientReport]:
        reports = []
        for cid in client_ids:
            t0 = time.perf_counter()
            rep = ClientReport(cid, round_idx, "evaluate")
            try:
                rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, cid, "evaluate")
                down = self.algorithm.downlink(payload, cid)
                rep.metrics = dict(self.algorithm.evaluate_client(down, self.states[cid], self.data[cid], self._ctx(round_idx, cid)))
            except Exception as e:
                rep.ok, rep.error, rep.traceback = False, f"{type(e).__name__}: {e}", tb.format_exc()
            rep.seconds = time.perf_counter() - t0
            reports.append(rep)
        return reports

    def get_states(self) -> dict:
        return {cid: _to_cpu(s) for cid, s in self.states.items()}

    def set_states(self, states: dict) -> None:
        for cid, s in states.items():
            if cid in self.data:
                self.states[cid] = _to_device(s, self.device)

    def ready(self) -> bool:
        return True


class ServerRunner:
    """Holds the server state; runs broadcast, aggregation (incl. server-side training) and server evaluation."""

    def __init__(self, spec: RunSpec, global_test=None):
        self.spec = spec
        self.device = _setup_process(spec.cfg)
        self.algorithm = _make_algorithm(spec)
        self.models = ModelCache(spec.task, self.device)
        self.global_test = global_test
        rngmod.seed_torch_global(spec.cfg.seed, rngmod.NO_ROUND, rngmod.SERVER, "init")
        self.state = self.algorithm.init_server_state(self._ctx(rngmod.NO_ROUND))

    def _ctx(self, round_idx: int, failures=None) -> Context:
        return Context(round_idx, rngmod.SERVER, self.spec.cfg.seed, self.device, self.spec.task, self.models, failures or [])

    def broadcast(self, round_idx: int):
        return self.algorithm.broadcast(self.state, self._ctx(round_idx))

    def aggregate(self, round_idx: int, failures: list, *upload_groups: dict, keep: Optional[list] = None) -> dict:
        """``keep``: the client ids whose uploads reach the algorithm (the environment drops late/dropped ones)."""
        uploads = {}
        for group in upload_groups:
            uploads.update(group)
        if keep is not None:
            keep = set(keep)
            uploads = {cid: u for cid, u in uploads.items() if cid in keep}
        uploads = {cid: uploads[cid] for cid in sorted(uploads)}  # order-independent of actors
        rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, rngmod.SERVER, "aggregate")
        self.state, metrics = self.algorithm.aggregate(self.state, uploads, self._ctx(round_idx, failures))
        return dict(metrics)

    def evaluate(self, round_idx: int) -> dict:
        if self.global_test is None:
            return {}
        rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, rngmod.SERVER, "evaluate")
        return dict(self.algorithm.evaluate_server(self.state, self.global_test, self._ctx(round_idx)))

    def get_state(self):
        return _to_cpu(self.state)

    def set_state(self, state) -> None:
        self.state = _to_device(state, self.device)

    def ready(self) -> bool:
        return True


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
