"""Execution backends behind one small interface. Only the ``raysim.backends.ray_*`` modules import ray (ray_backend:
the backend; ray_actors: the actors and the warm pool; ray_preflight: resource, address and runtime-env checks;
ray_tasks: plain Ray tasks for tuning's parallel trials; ray_watchdog, ray_serialization)."""
from __future__ import annotations

from raysim.errors import ConfigError

from raysim.backends.base import Backend
from raysim.backends.sequential import SequentialBackend


def preflight(s) -> None:
    """Checks that must pass before a run starts (e.g. the GPUs a config asks for exist); ``s``: the run's
    raysim.engine.settings.BackendSettings. The sequential backend ignores resource requests."""
    check_device(s)
    if s.backend.name == "ray":
        from raysim.backends.ray_preflight import preflight_resources

        preflight_resources(s)


def check_device(s) -> None:
    """``backend.device: cuda`` where no process of the run could see a GPU: one ConfigError before anything starts.
    In-process (sequential): this process needs CUDA. On Ray, Ray shows a process only the GPUs it reserved, so the
    client actors (every pool) and the server actor must ask for GPUs."""
    b = s.backend
    if b.device != "cuda":
        return
    if b.name != "ray":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("backend.device", "cuda requested but torch.cuda.is_available() is False here; use "
                                                "auto or cpu")
        return
    from raysim.backends.ray_preflight import actor_shapes

    for key, _, _, gpus in actor_shapes(s):
        if gpus <= 0:
            field = "backend.num_gpus" if key == "backend.num_actors" else key + ".num_gpus"
            raise ConfigError(field, "backend.device is cuda, but these client actors ask for no GPU (Ray shows a "
                                     "process only the GPUs it reserves): give them a GPU amount (a fraction such as "
                                     "0.25 or a whole number), or use backend.device: auto")
    if b.server_num_gpus <= 0:
        raise ConfigError("backend.server_num_gpus", "backend.device is cuda, but the server actor asks for no GPU (Ray "
                                                     "shows a process only the GPUs it reserves): give it a share "
                                                     "(e.g. 0.1), or use backend.device: auto")


__all__ = ["Backend", "SequentialBackend", "check_device", "preflight"]
