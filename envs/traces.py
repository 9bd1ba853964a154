"""Trace files: CSV or Parquet tables of measured (or synthetic) devices.

Devices trace, one row per device::

    device_id, speed, down_mbps, up_mbps, latency_s, tier       (device_id required; the others optional)

A column present in the trace replaces the corresponding distribution of ``env.devices`` / ``env.network``.

Availability trace, one row per interval during which a device is online (simulated seconds, [start, end))::

    device_id, start_s, end_s

A device listed in the devices trace but absent from the availability trace is always available. With
``participation.availability.period_s`` set, the trace repeats with that period (e.g. 86400 for a daily pattern).

A bare name (``example``) resolves to ``envs/traces/<name>_devices.csv`` / ``<name>_availability.csv`` shipped with
the package.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from raysim.errors import ConfigError

DEVICE_COLUMNS = ("speed", "down_mbps", "up_mbps", "latency_s", "tier")
AVAILABILITY_COLUMNS = ("device_id", "start_s", "end_s")


def shipped_traces() -> list[str]:
    names = set()
    for f in resources.files("envs").joinpath("traces").iterdir():
        for suffix in ("_devices.csv", "_availability.csv"):
            if f.name.endswith(suffix):
                names.add(f.name[: -len(suffix)])
    return sorted(names)


def resolve(name: str, kind: str, path: str) -> Path:
    p = Path(name).expanduser()
    if p.suffix.lower() in (".csv", ".parquet", ".pq"):
        if not p.is_file():
            raise ConfigError(path, f"trace file not found: {p}")
        return p
    shipped = shipped_traces()
    if name not in shipped:
        raise ConfigError(path, f"{name!r} is neither a .csv/.parquet file nor a shipped trace; shipped: "
                                f"{', '.join(shipped) or 'none'}")
    f = resources.files("envs").joinpath("traces", f"{name}_{kind}.csv")
    if not f.is_file():
        raise ConfigError(path, f"the shipped trace {name!r} has no {kind} table")
    return Path(str(f))


def _read(p: Path, path: str) -> pd.DataFrame:
    try:
        return pd.read_parquet(p) if p.suffix.lower() in (".parquet", ".pq") else pd.read_csv(p)
    except Exception as e:  # unreadable file: one clear config error
        raise ConfigError(path, f"cannot read trace {p}: {type(e).__name__}: {e}") from None


def _numeric(df: pd.DataFrame, col: str, path: str, p: Path) -> np.ndarray:
    v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(v))
    if len(bad):
        raise ConfigError(path, f"{p}: column {col!r} row {int(bad[0])} is not a finite number: {df[col].iloc[bad[0]]!r}")
    return v


def load_devices(name: str, path: str = "env.trace.devices") -> pd.DataFrame:
    """The devices table, validated: unique device_id, known columns, positive speeds and bandwidths."""
    p = resolve(name, "devices", path)
    df = _read(p, path)
    if "device_id" not in df.columns:
        raise ConfigError(path, f"{p}: missing column 'device_id'; columns: device_id, {', '.join(DEVICE_COLUMNS)}")
    unknown = [c for c in df.columns if c != "device_id" and c not in DEVICE_COLUMNS]
    if unknown:
        raise ConfigError(path, f"{p}: unknown column {unknown[0]!r}; allowed: device_id, {', '.join(DEVICE_COLUMNS)}")
    if len(df) == 0:
        raise ConfigError(path, f"{p}: the trace has no devices")
    if df["device_id"].duplicated().any():
        raise ConfigError(path, f"{p}: device_id {df['device_id'][df['device_id'].duplicated()].iloc[0]!r} repeats")
    out = pd.DataFrame({"device_id": df["device_id"].astype(str)})
    for col in DEVICE_COLUMNS:
        if col in df.columns:
            v = _numeric(df, col, path, p)
            if (col == "latency_s" and (v < 0).any()) or (col not in ("latency_s", "tier") and (v <= 0).any()):
                raise ConfigError(path, f"{p}: column {col!r} must be {'>= 0' if col == 'latency_s' else '> 0'}")
            if col == "tier" and ((v < 0).any() or not np.all(v == np.round(v))):
                raise ConfigError(path, f"{p}: column 'tier' must hold whole numbers >= 0")
            out[col] = v
    return out


def load_availability(name: str, path: str = "env.trace.availability") -> dict[str, np.ndarray]:
    """device_id -> array of [start_s, end_s) intervals, sorted by start."""
    p = resolve(name, "availability", path)
    df = _read(p, path)
    missing = [c for c in AVAILABILITY_COLUMNS if c not in df.columns]
    if missing:
        raise ConfigError(path, f"{p}: missing column {missing[0]!r}; columns: {', '.join(AVAILABILITY_COLUMNS)}")
    start, end = _numeric(df, "start_s", path, p), _numeric(df, "end_s", path, p)
    if (end < start).any():
        raise ConfigError(path, f"{p}: row {int(np.flatnonzero(end < start)[0])} ends before it starts")
    if (start < 0).any():
        raise ConfigError(path, f"{p}: start_s must be >= 0")
    ids = df["device_id"].astype(str).to_numpy()
    out = {}
    for dev in np.unique(ids):
        m = ids == dev
        iv = np.stack([start[m], end[m]], axis=1)
        out[str(dev)] = iv[np.argsort(iv[:, 0], kind="stable")]
    return out


def online(intervals: np.ndarray, t: float, period_s: float | None) -> bool:
    """Whether simulated time ``t`` falls in one of the [start, end) intervals (``t mod period`` if periodic)."""
    if period_s:
        t = t % period_s
    return bool(np.any((intervals[:, 0] <= t) & (t < intervals[:, 1])))
