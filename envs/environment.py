"""The environment as the round loop sees it: ``select`` before the client updates, ``outcome`` after.

    selected = env.select(round_idx, clients_per_round)      # availability, over-selection
    uploads, reports = backend.client_updates(payload, round_idx, selected)
    out = env.outcome(round_idx, reports)                      # times, dropped/late, keep, round duration
    backend.aggregate(round_idx, uploads, failures + out.failures(), keep=out.keep)

Everything runs on the driver from the clients' accounted message bytes, the data sizes and the seeded draws, so
the sequential and the Ray backend see identical environments. Dropped and late clients still trained (their
device did the work and keeps its local state); only their uploads are lost, so the algorithm never sees them
(they reach ``aggregate`` as failures).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from envs.clock import resolve_round
from envs.config import EnvConfig, parse_env
from envs.devices import Devices, build_devices, tier_archs
from envs.network import jittered, message_bytes, transfer_s
from envs.participation import is_available, round_draws, select, uniform

log = logging.getLogger("envs")


@dataclass(frozen=True)
class _Bytes:
    down: dict
    up: dict
    ok: bool = True


_NO_BYTES = _Bytes({}, {})


@dataclass
class RoundOutcome:
    round_idx: int
    start_s: float  # simulated time at the round's start
    target: int  # K: uploads the server waits for
    available: int
    selected: list[int]
    keep: list[int]  # the uploads that reach aggregation, sorted by client id
    dropped: list[int]
    late: list[int]
    round_s: float
    compute_s: dict[int, float] = field(default_factory=dict)
    comm_s: dict[int, float] = field(default_factory=dict)
    finish_s: dict[int, float] = field(default_factory=dict)  # upload arrival, or the moment of dropping out
    straggler: dict[int, bool] = field(default_factory=dict)

    @property
    def sim_time(self) -> float:
        return self.start_s + self.round_s

    def failures(self) -> list[tuple[int, str]]:
        """(client_id, reason) for the algorithm's ``ctx.failures``."""
        return sorted([(c, "env: dropped out during the round") for c in self.dropped]
                      + [(c, "env: missed the round (deadline or the first K had finished)") for c in self.late])

    def rows(self):
        """(round, client_id, scope, metric, value) rows for the result table."""
        r = self.round_idx
        dropped, late = set(self.dropped), set(self.late)
        for c in self.selected:
            yield r, c, "client", "sim_compute_s", self.compute_s[c]
            yield r, c, "client", "sim_comm_s", self.comm_s[c]
            yield r, c, "client", "sim_finish_s", self.finish_s[c]
            yield r, c, "client", "dropped", float(c in dropped)
            yield r, c, "client", "late", float(c in late)
            yield r, c, "client", "straggler", float(self.straggler[c])
        for name, v in (("sim_round_s", self.round_s), ("sim_time", self.sim_time), ("available", self.available),
                        ("selected", len(self.selected)), ("target", self.target), ("kept", len(self.keep)),
                        ("dropped", len(self.dropped)), ("late", len(self.late))):
            yield r, -1, "env", name, float(v)


class Environment:
    """Simulated devices, network, participation and clock for one run (lives on the driver)."""

    def __init__(self, cfg: EnvConfig, seed: int, train_sizes: list[int], local_epochs: int = 1):
        self.cfg, self.seed = cfg, int(seed)
        self.num_clients = len(train_sizes)
        self.train_sizes = np.asarray(train_sizes, dtype=float)
        self.local_epochs = int(local_epochs)
        self.devices: Devices = build_devices(cfg, self.seed, self.num_clients)
        self.size_factor = np.ones(self.num_clients)
        self.sim_time = 0.0
        self._pending: dict[int, tuple] = {}

    # -- construction from an experiment config (called by raysim through the registry) ------------------------
    @classmethod
    def from_experiment(cls, cfg, fed_data) -> Optional["Environment"]:
        from raysim.data.federated import client_sizes

        env_cfg = parse_env(cfg.env)
        if env_cfg is None:
            return None
        return cls(env_cfg, cfg.seed, client_sizes(fed_data.clients, "train"), cfg.train.local_epochs)

    @property
    def tiers(self) -> np.ndarray:
        return self.devices.tier

    def archs(self, model_cfg) -> list:
        """``model.assign: tier``: each client's architecture from its device's memory tier."""
        return tier_archs(list(model_cfg.per_client), self.devices.tier)

    def bind(self, task) -> None:
        """Learn the clients' model sizes (compute cost scales with params / ref_params when ref_params is set)."""
        ref = self.cfg.devices.ref_params
        if ref is None:
            return
        from raysim.models import arch_key, num_parameters

        counts: dict[str, int] = {}
        for c in range(self.num_clients):
            key = arch_key(task.archs[c])
            if key not in counts:
                counts[key] = num_parameters(task.build_model(c))
            self.size_factor[c] = counts[key] / ref

    # -- the round ---------------------------------------------------------------------------------------------
    def available(self, round_idx: int) -> list[int]:
        a = self.cfg.participation.availability
        if a.mode == "always":
            return list(range(self.num_clients))
        return [c for c in range(self.num_clients)
                if is_available(a, self.devices, c, self.sim_time, uniform(self.seed, round_idx, c, "env-round/u_available"))]

    def select(self, round_idx: int, target: Optional[int] = None) -> list[int]:
        """The clients to run this round: ceil(over_selection * K) of the available ones (K = target, or all
        available clients when target is None)."""
        avail = self.available(round_idx)
        k = len(avail) if target is None else int(target)
        chosen = select(self.seed, round_idx, avail, k, self.cfg.participation)
        self._pending[round_idx] = (k, len(avail), chosen)
        return chosen

    def client_times(self, round_idx: int, client_id: int, report) -> tuple[float, float, float, bool, object]:
        """(compute_s, down_s, up_s, straggler, draws) for one client's report."""
        c, d, dv, nw, p = client_id, self.devices, self.cfg.devices, self.cfg.network, self.cfg.participation
        draws = round_draws(self.seed, round_idx, c)
        straggler = draws.u_straggler < p.straggler_p
        compute = (self.local_epochs * self.train_sizes[c] * dv.sample_s * self.size_factor[c] / d.speed[c]
                   * (math.exp(dv.jitter * draws.z_compute) if dv.jitter else 1.0)
                   * (p.straggler_slowdown if straggler else 1.0))
        down = transfer_s(message_bytes(report.down), jittered(d.down_mbps[c], nw.jitter, draws.z_down), d.latency_s[c])
        up = transfer_s(message_bytes(report.up) if report.ok else 0.0, jittered(d.up_mbps[c], nw.jitter, draws.z_up),
                        d.latency_s[c])
        return float(compute), down, up, straggler, draws

    # -- the asynchronous server (server.mode: async; raysim/engine/async_loop.py) --------------------------------
    def async_available(self, key: int, client_id: int, t: float) -> bool:
        """Whether ``client_id`` is online at simulated time ``t`` for dispatch number ``key`` (the availability
        pattern of synchronous rounds, drawn per dispatch instead of per round)."""
        a = self.cfg.participation.availability
        if a.mode == "always":
            return True
        return is_available(a, self.devices, client_id, t, uniform(self.seed, key, client_id, "env-async/u_available"))

    def async_event(self, key: int, client_id: int, report=None) -> tuple[float, float, float, bool, bool]:
        """(compute_s, comm_s, seconds from dispatch to the event, dropped, straggler) of dispatch number ``key``:
        the upload's arrival, or the moment the client drops out (a uniform point of its work, as in rounds). The
        draws are keyed by (seed, key, client), so the time is known before training; ``report=None`` counts no
        bytes (a lower bound of the time, used to decide when a client's training must have run)."""
        if report is None:
            report = _NO_BYTES
        compute, down, up, straggler, draws = self.client_times(key, client_id, report)
        total = down + compute + up
        if not report.ok:
            return compute, down + up, down + compute, False, straggler
        if draws.u_dropout < self.cfg.participation.dropout:
            return compute, down + up, draws.u_drop_point * total, True, straggler
        return compute, down + up, total, False, straggler

    def outcome(self, round_idx: int, reports: list) -> RoundOutcome:
        """Simulate the round from the clients' reports; advance the simulated clock."""
        p = self.cfg.participation
        k, n_avail, _ = self._pending.pop(round_idx, (len(reports), len(reports), None))
        out = RoundOutcome(round_idx, self.sim_time, k, n_avail, sorted(r.client_id for r in reports), [], [], [], 0.0)
        finish, gone = {}, {}
        for r in sorted(reports, key=lambda r: r.client_id):
            c = r.client_id
            compute, down, up, straggler, draws = self.client_times(round_idx, c, r)
            total = down + compute + up
            out.compute_s[c], out.comm_s[c], out.straggler[c] = compute, down + up, straggler
            if not r.ok:  # a real failure (the engine records and reports it): no upload to wait for
                gone[c] = out.finish_s[c] = down + compute
            elif draws.u_dropout < p.dropout:
                gone[c] = out.finish_s[c] = draws.u_drop_point * total
                out.dropped.append(c)
            else:
                finish[c] = out.finish_s[c] = total
        round_s, out.keep, out.late = resolve_round(finish, gone, k, p.deadline_s)
        if not reports:
            round_s = p.idle_s
        out.round_s = round_s + self.cfg.server_s
        self.sim_time = out.sim_time
        if reports and not out.keep:
            log.warning("round %d: none of the %d selected clients delivered an upload (%d dropped, %d late); the "
                        "server state stays as it was", round_idx, len(reports), len(out.dropped), len(out.late))
        return out

    def summary(self) -> dict:
        """Per-client device properties and the final simulated time, for the run metadata."""
        d = self.devices
        out = {"preset": self.cfg.preset, "sim_time": self.sim_time,
               "devices": {name: [float(v) for v in getattr(d, name)]
                           for name in ("speed", "tier", "latency_s", "down_mbps", "up_mbps")}}
        if d.trace_id is not None:
            out["devices"]["trace_id"] = list(d.trace_id)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"sim_time": self.sim_time}

    def load_state_dict(self, state: dict) -> None:
        self.sim_time = float(state["sim_time"])
