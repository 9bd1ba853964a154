"""What a client or server runner reads (:class:`RunnerSettings`), built once from the config when a run is prepared
(:func:`raysim.engine.settings.runner_settings`): the config itself stays on the driver."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerSettings:
    """What a client or server runner reads: the seed of every random stream, where and how it computes, and the
    memory its caches and state store may hold."""

    seed: int
    device: str  # backend.device: auto | cpu | cuda[:i]
    numerics: str  # backend.numerics: portable | native
    torch_threads: int
    vectorize: bool  # backend.vectorize: the vectorised executor and group forms before the per-client loop
    decoded_cache_mb: float  # decoded client data kept between steps
    state_memory_mb: float  # client states in memory before the store spills to disk
    max_group: int = 0  # backend.max_group: clients per batched group of the vectorised executor (0: no fixed limit)
