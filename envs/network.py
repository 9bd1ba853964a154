"""Communication time from the engine's accounted message bytes: one message costs ``latency + bits / bandwidth``;
nothing sent costs nothing (no round trip), so a method that sends prototypes pays far less than one that sends
weights."""
from __future__ import annotations

import math


def transfer_s(num_bytes: float, mbps: float, latency_s: float) -> float:
    if num_bytes <= 0:
        return 0.0
    return latency_s + num_bytes * 8.0 / (mbps * 1e6)


def message_bytes(sizes: dict) -> float:
    """Total bytes of a ClientReport's ``up``/``down`` accounting (kind -> (floats, bytes))."""
    return float(sum(b for _, b in sizes.values()))


def jittered(mbps: float, sigma: float, z: float) -> float:
    """A per-round bandwidth: the device's bandwidth times a lognormal factor exp(sigma * z)."""
    return mbps * math.exp(sigma * z) if sigma else mbps
