"""The ``server`` section: synchronous rounds, or asynchronous updates on the simulated clock with their staleness
weights (:class:`StalenessConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, choice, positive


@dataclass(frozen=True)
class StalenessConfig:
    """s(tau), the weight of an update that is tau server versions old (Xie et al. 2019): constant (1), polynomial
    ((1 + tau)^-a) or hinge (1 up to b versions, then 1 / (a (tau - b) + 1))."""

    fn: str = "constant"
    a: float = 0.5
    b: int = 4

    def check(self, path: str) -> None:
        choice(_p(path, "fn"), self.fn, ["constant", "polynomial", "hinge"])
        if self.a < 0:
            raise ConfigError(_p(path, "a"), f"the staleness exponent must be >= 0, got {self.a}")
        positive(_p(path, "b"), self.b, allow_zero=True)


@dataclass(frozen=True)
class ServerConfig:
    """``mode: sync`` (rounds: the default) or ``async``: an event-driven server on the environment's simulated
    clock (raysim/engine/async_loop.py). ``concurrency`` clients train at once; each is dispatched with the current
    server state and its update arrives when the environment says; ``rule: fedbuff`` aggregates every
    ``buffer_size`` arrivals, each a delta against the version its client was dispatched with, and applies their
    weighted mean scaled by ``server_lr``, ``rule: fedasync`` applies each arrival
    with weight ``alpha * s(tau)``. Each applied aggregation is a server version; ``rounds`` counts versions.
    ``max_staleness``: updates older than this many versions are discarded (wasted work; None: none)."""

    mode: str = "sync"
    rule: str = "fedbuff"
    concurrency: int = 10
    buffer_size: int = 5
    server_lr: float = 1.0
    alpha: float = 0.6
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    max_staleness: Optional[int] = None

    def check(self, path: str) -> None:
        choice(_p(path, "mode"), self.mode, ["sync", "async"])
        choice(_p(path, "rule"), self.rule, ["fedbuff", "fedasync"])
        positive(_p(path, "concurrency"), self.concurrency)
        positive(_p(path, "buffer_size"), self.buffer_size)
        positive(_p(path, "server_lr"), self.server_lr)
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(_p(path, "alpha"), f"must be in (0, 1], got {self.alpha}")
        positive(_p(path, "max_staleness"), self.max_staleness, allow_zero=True)
        if self.mode == "async" and self.rule == "fedbuff" and self.buffer_size > self.concurrency:
            raise ConfigError(_p(path, "buffer_size"), f"{self.buffer_size} exceeds server.concurrency="
                                                       f"{self.concurrency} (the buffer could never fill)")
