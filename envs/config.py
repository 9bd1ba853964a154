"""The ``env`` section of an experiment config: frozen dataclasses validated like the rest of raysim's config.

Every quantity of a device can be a number (the same for every device) or a distribution spec::

    {dist: constant, value: 1.0}
    {dist: uniform, low: 0.5, high: 2.0}
    {dist: lognormal, median: 1.0, sigma: 0.7}     # median * exp(sigma * N(0, 1))
    {dist: normal, mean: 1.0, std: 0.2, min: 0.1}  # clipped below at min
    {dist: choice, values: [0, 1, 2], probs: [0.3, 0.5, 0.2]}

A named ``preset`` supplies defaults that the other keys override (a deep merge), so
``env: {preset: mobile-heterogeneous, participation: {dropout: 0.2}}`` changes only the dropout rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from raysim.config import choice, from_dict
from raysim.errors import ConfigError

DISTS = {
    "constant": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("median", "sigma"),
    "normal": ("mean", "std", "min"),
    "choice": ("values", "probs"),
}
_OPTIONAL = {"normal": {"min"}, "choice": {"probs"}}


@dataclass(frozen=True)
class Dist:
    """A validated per-device distribution; ``draw(rng)`` returns one value."""

    kind: str
    args: dict

    def draw(self, rng: np.random.Generator) -> float:
        a = self.args
        if self.kind == "constant":
            return float(a["value"])
        if self.kind == "uniform":
            return float(rng.uniform(a["low"], a["high"]))
        if self.kind == "lognormal":
            return float(a["median"] * math.exp(a["sigma"] * rng.standard_normal()))
        if self.kind == "normal":
            return float(max(a["mean"] + a["std"] * rng.standard_normal(), a.get("min", -math.inf)))
        values, probs = a["values"], a.get("probs")
        return float(values[int(rng.choice(len(values), p=probs))])

    def support_min(self) -> float:
        a = self.args
        if self.kind == "constant":
            return float(a["value"])
        if self.kind == "uniform":
            return float(a["low"])
        if self.kind == "lognormal":
            return math.nextafter(0.0, 1.0)  # strictly positive (median > 0 is checked)
        if self.kind == "normal":
            return float(a.get("min", -math.inf))
        return float(min(a["values"]))


def parse_dist(spec: Any, path: str, *, low: float = 0.0, allow_low: bool = False, integer: bool = False) -> Dist:
    """A number or ``{dist: ..., ...}`` -> :class:`Dist`; every value it can draw must be > low (>= low if allowed)."""
    bound = f"{'>=' if allow_low else '>'} {low:g}"
    if isinstance(spec, bool):
        raise ConfigError(path, f"expected a number or a distribution {{dist: {'|'.join(DISTS)}, ...}}, got {spec!r}")
    if isinstance(spec, (int, float)):
        spec = {"dist": "constant", "value": spec}
    if not isinstance(spec, dict):
        raise ConfigError(path, f"expected a number or a distribution {{dist: {'|'.join(DISTS)}, ...}}, got {spec!r}")
    kind = spec.get("dist")
    if kind is None:
        raise ConfigError(f"{path}.dist", f"is required; choose one of: {', '.join(DISTS)}")
    choice(f"{path}.dist", kind, DISTS)
    allowed = set(DISTS[kind])
    args = {k: v for k, v in spec.items() if k != "dist"}
    for k in args:
        if k not in allowed:
            raise ConfigError(f"{path}.{k}", f"unknown parameter for dist {kind}; allowed: {', '.join(DISTS[kind])}")
    for k in allowed - _OPTIONAL.get(kind, set()):
        if k not in args:
            raise ConfigError(f"{path}.{k}", f"is required for dist {kind}")
    args = _choice_args(args, path) if kind == "choice" else _numeric_args(kind, args, path)
    d = Dist(kind, args)
    m = d.support_min()
    if (m < low) or (m == low and not allow_low):
        hint = " (normal needs min)" if kind == "normal" else ""
        raise ConfigError(path, f"every drawn value must be {bound}; this distribution can give {m:g}{hint}")
    if integer:
        if kind != "constant" and kind != "choice":
            raise ConfigError(f"{path}.dist", f"{kind!r} is not allowed for an integer quantity; choose one of: constant, choice")
        vals = [args["value"]] if kind == "constant" else args["values"]
        for v in vals:
            if not float(v).is_integer():
                raise ConfigError(path, f"expected whole numbers, got {v!r}")
    return d


def _choice_args(args: dict, path: str) -> dict:
    """A ``choice`` distribution's values (numbers) and optional probabilities (normalised to sum 1)."""
    values = args["values"]
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"{path}.values", f"expected a non-empty list of numbers, got {values!r}")
    vals = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{path}.values[{i}]", f"expected a number, got {v!r}")
        vals.append(float(v))
    out = {"values": vals}
    if "probs" in args:
        probs = args["probs"]
        if (not isinstance(probs, (list, tuple)) or len(probs) != len(vals)
                or any(isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0 for p in probs)
                or not math.isclose(sum(probs), 1.0, abs_tol=1e-6)):
            raise ConfigError(f"{path}.probs", f"expected {len(vals)} non-negative numbers summing to 1, got {probs!r}")
        out["probs"] = [float(p) / float(sum(probs)) for p in probs]
    return out


def _numeric_args(kind: str, args: dict, path: str) -> dict:
    """A numeric distribution's parameters as finite floats, checked (uniform's high >= low, lognormal's median > 0
    and sigma >= 0, normal's std >= 0)."""

    def num(k):
        v = args[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{path}.{k}", f"expected a finite number, got {v!r}")
        return float(v)

    args = {k: num(k) for k in args}
    if kind == "uniform" and args["high"] < args["low"]:
        raise ConfigError(f"{path}.high", f"must be >= low ({args['low']:g}), got {args['high']:g}")
    if kind == "lognormal" and args["median"] <= 0:
        raise ConfigError(f"{path}.median", f"must be > 0, got {args['median']:g}")
    if kind in ("lognormal",) and args["sigma"] < 0:
        raise ConfigError(f"{path}.sigma", f"must be >= 0, got {args['sigma']:g}")
    if kind == "normal" and args["std"] < 0:
        raise ConfigError(f"{path}.std", f"must be >= 0, got {args['std']:g}")
    return args


def _prob(path: str, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ConfigError(path, f"must be a probability in [0, 1], got {p}")


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass(frozen=True)
class DevicesConfig:
    """Compute: a client's local training takes ``local_epochs * n_train * sample_s / speed`` seconds (times
    ``params / ref_params`` when ``ref_params`` is set, so bigger models cost more), times a per-round lognormal
    jitter and the straggler slowdown. ``tier`` is the memory tier (0 = smallest), which decides the largest model a
    device can hold (``model.assign: tier``)."""

    speed: Any = 1.0
    sample_s: float = 0.005
    ref_params: Optional[int] = None
    jitter: float = 0.0
    tier: Any = 0

    def check(self, path: str) -> None:
        parse_dist(self.speed, _p(path, "speed"))
        parse_dist(self.tier, _p(path, "tier"), allow_low=True, integer=True)
        if self.sample_s < 0:
            raise ConfigError(_p(path, "sample_s"), f"must be >= 0, got {self.sample_s}")
        if self.ref_params is not None and self.ref_params <= 0:
            raise ConfigError(_p(path, "ref_params"), f"must be > 0, got {self.ref_params}")
        if self.jitter < 0:
            raise ConfigError(_p(path, "jitter"), f"must be >= 0 (a lognormal sigma), got {self.jitter}")


@dataclass(frozen=True)
class NetworkConfig:
    """Communication: ``latency_s + bytes * 8 / (mbps * 1e6)`` each way, from the engine's accounted message
    bytes; ``jitter`` is a per-round lognormal sigma on both bandwidths."""

    latency_s: Any = 0.05
    down_mbps: Any = 20.0
    up_mbps: Any = 5.0
    jitter: float = 0.0

    def check(self, path: str) -> None:
        parse_dist(self.latency_s, _p(path, "latency_s"), allow_low=True)
        parse_dist(self.down_mbps, _p(path, "down_mbps"))
        parse_dist(self.up_mbps, _p(path, "up_mbps"))
        if self.jitter < 0:
            raise ConfigError(_p(path, "jitter"), f"must be >= 0 (a lognormal sigma), got {self.jitter}")


AVAILABILITY_MODES = ("always", "bernoulli", "diurnal", "trace")


@dataclass(frozen=True)
class AvailabilityConfig:
    """``always``; ``bernoulli`` (available with probability p each round); ``diurnal`` (probability oscillating
    between low and high with period ``period_s`` of simulated time, one phase per device: time zones);
    ``trace`` (on/off intervals from ``env.trace.availability``, repeated every ``period_s`` if set)."""

    mode: str = "always"
    p: float = 1.0
    low: float = 0.2
    high: float = 0.9
    period_s: Optional[float] = None
    phase: str = "random"  # random: one phase per device | zero: everyone in the same time zone

    def check(self, path: str) -> None:
        choice(_p(path, "mode"), self.mode, AVAILABILITY_MODES)
        choice(_p(path, "phase"), self.phase, ["random", "zero"])
        _prob(_p(path, "p"), self.p)
        _prob(_p(path, "low"), self.low)
        _prob(_p(path, "high"), self.high)
        if self.high < self.low:
            raise ConfigError(_p(path, "high"), f"must be >= low ({self.low}), got {self.high}")
        if self.period_s is not None and self.period_s <= 0:
            raise ConfigError(_p(path, "period_s"), f"must be > 0, got {self.period_s}")


@dataclass(frozen=True)
class ParticipationConfig:
    """Who takes part: availability, a per-round dropout probability (the client vanishes at a uniform point of
    its round; its upload never arrives), stragglers (compute slowed by ``straggler_slowdown`` with probability
    ``straggler_p``), and a round deadline with over-selection (select ``ceil(over_selection * K)`` available
    clients, keep the first K to finish before ``deadline_s``; FedScale, Lai et al. ICML 2022). A client that is
selected but drops out or misses the round still counts its compute and communication time."""

    availability: AvailabilityConfig = field(default_factory=AvailabilityConfig)
    dropout: float = 0.0
    straggler_p: float = 0.0
    straggler_slowdown: float = 1.0
    deadline_s: Optional[float] = None
    over_selection: float = 1.0
    idle_s: float = 60.0  # a round in which no client is available lasts this long (the server waits, retries)

    def check(self, path: str) -> None:
        _prob(_p(path, "dropout"), self.dropout)
        if self.idle_s < 0:
            raise ConfigError(_p(path, "idle_s"), f"must be >= 0, got {self.idle_s}")
        _prob(_p(path, "straggler_p"), self.straggler_p)
        if self.straggler_slowdown < 1:
            raise ConfigError(_p(path, "straggler_slowdown"), f"must be >= 1, got {self.straggler_slowdown}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError(_p(path, "deadline_s"), f"must be > 0 seconds (or null for no deadline), got {self.deadline_s}")
        if self.over_selection < 1:
            raise ConfigError(_p(path, "over_selection"), f"must be >= 1 (1.3 selects 30% more clients), got {self.over_selection}")


@dataclass(frozen=True)
class TraceConfig:
    """CSV or Parquet traces (see envs/traces.py for the columns); a bare name such as ``example`` means the trace
    shipped in envs/traces/. ``mapping``: client -> trace device, ``random`` (a seeded permutation) or ``modulo``."""

    devices: Optional[str] = None
    availability: Optional[str] = None
    mapping: str = "random"

    def check(self, path: str) -> None:
        choice(_p(path, "mapping"), self.mapping, ["random", "modulo"])


@dataclass(frozen=True)
class EnvConfig:
    preset: Optional[str] = None
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    server_s: float = 0.0  # simulated server time per round (aggregation), added to every round

    def check(self, path: str) -> None:
        if self.server_s < 0:
            raise ConfigError(_p(path, "server_s"), f"must be >= 0, got {self.server_s}")
        if self.participation.availability.mode == "trace" and self.trace.availability is None:
            raise ConfigError(_p(path, "trace.availability"), "is required when participation.availability.mode is trace")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and "dist" not in v:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_env(raw: Optional[dict], path: str = "env") -> Optional[EnvConfig]:
    """The raw ``env`` mapping of an experiment config -> :class:`EnvConfig` (preset applied), or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping (or null for no simulated environment), got {raw!r}")
    from envs.presets import PRESETS

    preset = raw.get("preset")
    if preset is not None:
        choice(f"{path}.preset", preset, PRESETS)
        raw = _deep_merge(PRESETS[preset], raw)
    return from_dict(EnvConfig, raw, path)
