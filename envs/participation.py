"""Participation: who is online at a round's start, whom the server selects, and the per-round random events
(dropout, stragglers, jitter). Every draw is keyed by (seed, round, client, "env-round/<event>"), so a client's
events do not depend on which other clients exist, were selected, or on the other events' parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from raysim import rng as rngmod
from envs.config import AvailabilityConfig, ParticipationConfig
from envs.devices import Devices
from envs.traces import online

DAY_S = 86400.0


_NORMAL = NormalDist()
_LAYOUT = ("u_available", "u_dropout", "u_drop_point", "u_straggler", "z_compute", "z_down", "z_up")


@dataclass(frozen=True)
class RoundDraws:
    """The fixed layout of one client's per-round draws."""

    u_available: float
    u_dropout: float
    u_drop_point: float
    u_straggler: float
    z_compute: float
    z_down: float
    z_up: float


def uniform(seed: int, round_idx: int, client_id: int, purpose: str) -> float:
    """One U(0, 1) draw, a pure function of its key: the top 53 bits of ``raysim.rng.derive_seed``. Cheaper than a
    numpy Generator per draw (~1 us vs ~20 us), which matters when thousands of clients are checked every round."""
    return ((rngmod.derive_seed(seed, round_idx, client_id, purpose) >> 10) + 0.5) / 2.0**53


def round_draws(seed: int, round_idx: int, client_id: int) -> RoundDraws:
    vals = []
    for name in _LAYOUT:
        u = uniform(seed, round_idx, client_id, f"env-round/{name}")
        vals.append(_NORMAL.inv_cdf(u) if name[0] == "z" else u)
    return RoundDraws(*vals)


def availability_prob(cfg: AvailabilityConfig, phase: float, t: float) -> float:
    """Probability of being online at simulated time t (bernoulli, diurnal); 1 for always (trace is handled apart)."""
    if cfg.mode == "bernoulli":
        return cfg.p
    if cfg.mode == "diurnal":
        period = cfg.period_s or DAY_S
        return cfg.low + (cfg.high - cfg.low) * 0.5 * (1.0 + math.sin(2.0 * math.pi * (t / period + phase)))
    return 1.0


def is_available(cfg: AvailabilityConfig, devices: Devices, client_id: int, t: float, u: float) -> bool:
    """``u``: the client's U(0, 1) availability draw for the round."""
    if cfg.mode == "always":
        return True
    if cfg.mode == "trace":
        iv = devices.intervals[client_id] if devices.intervals is not None else None
        return True if iv is None else online(iv, t, cfg.period_s)
    return u < availability_prob(cfg, float(devices.phase[client_id]), t)


def num_to_select(target: int, available: int, over_selection: float) -> int:
    """ceil(over_selection * K) with K the target, capped by the number of available clients."""
    return min(available, int(math.ceil(over_selection * target - 1e-9)))


def select(seed: int, round_idx: int, available: list[int], target: int, cfg: ParticipationConfig) -> list[int]:
    m = num_to_select(target, len(available), cfg.over_selection)
    if m >= len(available):
        return sorted(available)
    r = rngmod.numpy_rng(seed, round_idx, rngmod.SERVER, "env-select")
    return sorted(np.asarray(available)[r.choice(len(available), size=m, replace=False)].tolist())
