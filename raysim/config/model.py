"""The ``model`` section: one architecture for every client or per-client ones (:class:`ArchSpec`), and which
client gets which."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, choice


@dataclass(frozen=True)
class ArchSpec:
    arch: str = "cnn_mnist"  # a zoo name, a registered name or an import path "package.module:factory"
    params: dict = field(default_factory=dict)
    embedding: Optional[str] = None  # user models: the layer (module path or traced node name) whose output is the
    #                                  embedding; the rest of the forward is the head


@dataclass(frozen=True)
class ModelConfig:
    """One architecture for everyone (``arch``/``params``) or per-client ones (``per_client``).

    ``assign``: ``cycle`` (client i gets per_client[i % len]), ``blocks`` (contiguous, near-equal blocks of client
    ids, FedProto's "mh" setting), ``list`` (per_client has one entry per client) or ``tier`` (client i holds
    per_client[tier of i]: the tier comes from ``tiers`` (client i -> tiers[i % len(tiers)]) when given, else from the
    ``env`` section's device memory tier: the largest model such a device can hold)."""

    arch: str = "cnn_mnist"
    params: dict = field(default_factory=dict)
    per_client: Optional[list[ArchSpec]] = None
    assign: str = "cycle"
    tiers: Optional[list[int]] = None  # assign=tier: device tier per client (cycled), an index into per_client
    embedding: Optional[str] = None  # user models: the layer whose output is the embedding (per_client entries
    #                                  without their own take this one)

    def check(self, path: str) -> None:
        choice(_p(path, "assign"), self.assign, ["cycle", "blocks", "list", "tier"])
        specs = [(_p(path, "params"), self.params)] + [(_p(path, f"per_client[{i}].params"), s.params)
                                                       for i, s in enumerate(self.per_client or [])]
        for where, params in specs:
            v = (params or {}).get("embed_dim") if isinstance(params, dict) else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{where}.embed_dim", f"must be an integer >= 1 (the embedding's size), got {v!r}")
        if self.per_client is not None and len(self.per_client) == 0:
            raise ConfigError(_p(path, "per_client"), "must name at least one architecture")
        if self.assign == "tier":
            if self.per_client is None:
                raise ConfigError(_p(path, "per_client"), "assign=tier needs per_client (one architecture per tier)")
            if self.tiers is not None and not self.tiers:
                raise ConfigError(_p(path, "tiers"), "must list at least one tier (or be left out to take the tiers "
                                                     "from the env section's devices)")
            bad = [t for t in (self.tiers or []) if not 0 <= t < len(self.per_client)]
            if bad:
                raise ConfigError(_p(path, "tiers"), f"tier {bad[0]} is not allowed; choose one of: "
                                                     f"{', '.join(map(str, range(len(self.per_client))))}")
