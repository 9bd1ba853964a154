"""Plain functions as Ray tasks with fixed resources: what ``tuning`` runs its parallel trials on (one trial per
task, the sequential backend inside), so that only ``raysim/backends/`` imports Ray."""
from __future__ import annotations

import os

import ray

from raysim.backends.ray_actors import release_warm_actors
from raysim.backends.ray_preflight import gpu_capacity
from raysim.errors import ConfigError


def current_node() -> str:
    """The id of the Ray node this code runs on (a trial records where it ran)."""
    return ray.get_runtime_context().get_node_id()


class LostTask(RuntimeError):
    """A task that did not fail by itself: its worker or node died (the work can be run again)."""


class TaskPool:
    """Plain functions as Ray tasks, each with fixed resources (used by ``tuning`` for parallel trials: one trial per
    task, the sequential backend inside). ``wait`` returns ``(key, result, error)`` for the next finished task."""

    def __init__(self, num_cpus: float, num_gpus: float, address=None, where: str = "trial_resources"):
        self._own_session = False
        self._fns: dict = {}
        self.pending: dict = {}
        if not ray.is_initialized():
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {"PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)}
            ray.init(address=address or "local", include_dashboard=False, logging_level="ERROR", runtime_env={"env_vars": env})
            self._own_session = True
        res = ray.cluster_resources()
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        if num_gpus > 0 and gpus < num_gpus:
            self.shutdown()
            raise ConfigError(f"{where}.num_gpus", f"asks for {num_gpus:g} GPU per task but the Ray cluster has {gpus:g}")
        if num_cpus > cpus:
            self.shutdown()
            raise ConfigError(f"{where}.num_cpus", f"asks for {num_cpus:g} CPUs per task but the Ray cluster has {cpus:g}")
        release_warm_actors()  # parked run actors would hold the CPUs the tasks need (kept when the request is refused)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.slots = int(cpus // num_cpus) if num_cpus > 0 else 10**6
        if num_gpus > 0:
            self.slots = min(self.slots, gpu_capacity(num_gpus, gpus))

    def submit(self, key, fn, *args) -> None:
        if fn not in self._fns:
            self._fns[fn] = ray.remote(fn).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=0)
        self.pending[self._fns[fn].remote(*args)] = key

    def wait(self):
        done, _ = ray.wait(list(self.pending), num_returns=1)
        key = self.pending.pop(done[0])
        try:
            return key, ray.get(done[0]), None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
            return key, None, cause
        except Exception as e:  # worker or node died, object lost, cancelled ...
            lost = LostTask(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            lost.__cause__ = e
            return key, None, lost

    def shutdown(self) -> None:
        for ref in list(self.pending):
            ray.cancel(ref, force=True)
        self.pending.clear()
        if self._own_session:
            ray.shutdown()
            self._own_session = False
