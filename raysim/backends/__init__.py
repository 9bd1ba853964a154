"""Execution backends behind one small interface. Only the ``raysim.backends.ray_*`` modules import ray (ray_backend:
the backend; ray_actors: the actors and the warm pool; ray_preflight: resource, address and runtime-env checks;
ray_tasks: plain Ray tasks for tuning's parallel trials; ray_watchdog, ray_serialization)."""
from __future__ import annotations

from raysim.backends.base import Backend
from raysim.backends.sequential import SequentialBackend


def make_backend(name: str, spec, fed_data) -> Backend:
    if name == "sequential":
        return SequentialBackend(spec, fed_data)
    if name == "ray":
        from raysim.backends.ray_backend import RayBackend

        return RayBackend(spec, fed_data)
    raise ValueError(name)


def preflight(cfg) -> None:
    """Checks that must pass before a run starts (e.g. the GPUs a config asks for exist)."""
    if cfg.backend.name == "ray":
        from raysim.backends.ray_preflight import preflight_resources

        preflight_resources(cfg)
    elif cfg.backend.num_gpus or cfg.backend.server_num_gpus:
        pass  # sequential ignores resource requests


__all__ = ["Backend", "SequentialBackend", "make_backend", "preflight"]
