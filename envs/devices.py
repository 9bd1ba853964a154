"""Per-device properties, drawn once per run: compute speed, memory tier, link latency and bandwidths, and (for the
diurnal pattern) a time-zone phase. Client ``i`` is device ``i``.

Each quantity of each client has its own stream keyed by (seed, client, "env-device-<quantity>"), so changing one
distribution (or the number of clients) never changes another quantity's draws."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from raysim import rng as rngmod
from raysim.errors import ConfigError
from envs.config import EnvConfig, parse_dist
from envs.traces import load_availability, load_devices


@dataclass
class Devices:
    speed: np.ndarray  # relative compute speed (1 = the device sample_s is measured on)
    tier: np.ndarray  # memory tier, 0 = smallest
    latency_s: np.ndarray
    down_mbps: np.ndarray
    up_mbps: np.ndarray
    phase: np.ndarray  # in [0, 1): fraction of the diurnal period
    trace_id: Optional[list[str]] = None  # the trace device each client plays
    intervals: Optional[list[Optional[np.ndarray]]] = None  # availability intervals per client (None: always)

    @property
    def num_clients(self) -> int:
        return len(self.speed)


def _draw(spec, path: str, seed: int, n: int, name: str, **kw) -> np.ndarray:
    d = parse_dist(spec, path, **kw)
    return np.array([d.draw(rngmod.numpy_rng(seed, rngmod.NO_ROUND, c, f"env-device-{name}")) for c in range(n)])


def _mapping(cfg: EnvConfig, seed: int, n: int, rows: int) -> np.ndarray:
    if cfg.trace.mapping == "modulo":
        return np.arange(n) % rows
    perm = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "env-trace-map").permutation(rows)
    return perm[np.arange(n) % rows]


def build_devices(cfg: EnvConfig, seed: int, num_clients: int, path: str = "env") -> Devices:
    n = num_clients
    dv, nw = cfg.devices, cfg.network
    dev = Devices(
        speed=_draw(dv.speed, f"{path}.devices.speed", seed, n, "speed"),
        tier=_draw(dv.tier, f"{path}.devices.tier", seed, n, "tier", allow_low=True, integer=True).astype(np.int64),
        latency_s=_draw(nw.latency_s, f"{path}.network.latency_s", seed, n, "latency", allow_low=True),
        down_mbps=_draw(nw.down_mbps, f"{path}.network.down_mbps", seed, n, "down"),
        up_mbps=_draw(nw.up_mbps, f"{path}.network.up_mbps", seed, n, "up"),
        phase=(np.array([rngmod.numpy_rng(seed, rngmod.NO_ROUND, c, "env-device-phase").random() for c in range(n)])
               if cfg.participation.availability.phase == "random" else np.zeros(n)),
    )
    ids = None
    if cfg.trace.devices is not None:
        df = load_devices(cfg.trace.devices, f"{path}.trace.devices")
        rows = _mapping(cfg, seed, n, len(df))
        ids = [str(df["device_id"].iloc[r]) for r in rows]
        for col, attr in (("speed", "speed"), ("tier", "tier"), ("latency_s", "latency_s"), ("down_mbps", "down_mbps"),
                          ("up_mbps", "up_mbps")):
            if col in df.columns:
                setattr(dev, attr, df[col].to_numpy()[rows].astype(getattr(dev, attr).dtype))
    if cfg.trace.availability is not None:
        where = f"{path}.trace.availability"
        table = load_availability(cfg.trace.availability, where)
        if ids is None:  # an availability-only trace: clients play its devices
            known = sorted(table)
            ids = [known[r] for r in _mapping(cfg, seed, n, len(known))]
        elif not set(ids) & set(table):
            raise ConfigError(where, "shares no device_id with env.trace.devices")
        dev.intervals = [table.get(i) for i in ids]
    dev.trace_id = ids
    return dev


def tier_archs(per_client: list, tiers: np.ndarray, path: str = "model.per_client") -> list:
    """``model.assign: tier``: a tier-j device gets per_client[j], the largest model its memory holds."""
    top = int(tiers.max()) if len(tiers) else 0
    if top >= len(per_client):
        raise ConfigError(path, f"assign=tier needs one architecture per memory tier (0..{top}); got {len(per_client)}")
    return [per_client[int(t)] for t in tiers]
