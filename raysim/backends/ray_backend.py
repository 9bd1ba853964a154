"""Ray backend: a pool of long-lived client actors, each hosting a fixed group of virtual clients whose data and
state stay resident, plus one server actor holding the server state.

Per round: the server actor builds the payload (returned into the object store once); every actor gets its whole
group of sampled clients in one call and returns two objects, the uploads (passed by reference straight to the
server actor, never through the driver) and small reports (metrics, message sizes, failures) for the driver.
"""
from __future__ import annotations

import math
import os

import ray

from raysim import ray_watchdog
from raysim.backends.base import Backend
from raysim.config import ConfigError
from raysim.runtime import ClientRunner, ServerRunner


def _gpu_capacity(per_actor: float, gpus: float) -> int:
    if per_actor <= 0:
        return 10**9
    if per_actor <= 1:
        return int(math.floor(gpus + 1e-9)) * int(math.floor(1 / per_actor + 1e-9)) + (
            int(math.floor((gpus % 1) / per_actor + 1e-9)) if gpus % 1 else 0)
    return int(math.floor(gpus / per_actor + 1e-9))


def check_resources(cfg, cpus: float, gpus: float, where: str) -> None:
    """Fail fast where Ray would leave actors pending forever."""
    b = cfg.backend
    n = min(b.num_actors, cfg.data.num_clients)
    need_gpu_actors = n if b.num_gpus > 0 else 0
    if b.num_gpus > 0 or b.server_num_gpus > 0:
        if gpus <= 0:
            raise ConfigError("backend.num_gpus" if b.num_gpus > 0 else "backend.server_num_gpus",
                              f"asks for GPUs but {where} has none (torch.cuda.is_available() is False and no GPUs are "
                              f"declared to Ray); set backend.num_gpus: 0 and backend.server_num_gpus: 0")
        # pack client actors, then the server, onto whole GPUs
        if need_gpu_actors > _gpu_capacity(b.num_gpus, gpus) or (
                b.num_gpus * need_gpu_actors + b.server_num_gpus > gpus + 1e-9):
            raise ConfigError("backend.num_gpus", f"{n} client actors x {b.num_gpus} GPU"
                                                  f"{' + server ' + str(b.server_num_gpus) if b.server_num_gpus else ''}"
                                                  f" do not fit on the {gpus:g} GPU(s) of {where}")
    need_cpu = n * b.num_cpus + b.server_num_cpus
    if need_cpu > cpus + 1e-9:
        raise ConfigError("backend.num_actors", f"{n} actors x {b.num_cpus} CPU + server {b.server_num_cpus} CPU = "
                                                f"{need_cpu:g} CPUs, but {where} has {cpus:g}; lower backend.num_actors "
                                                f"or backend.num_cpus (fractions allowed)")


def preflight_resources(cfg) -> None:
    """Before starting anything: for a local cluster Ray would start with, check what this machine has."""
    if ray.is_initialized() or cfg.backend.address:
        return  # checked against the live cluster in RayBackend.start
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_resources(cfg, float(os.cpu_count() or 1), float(gpus), "this machine")


class RayBackend(Backend):
    name = "ray"

    def __init__(self, spec, fed_data):
        self.spec, self.fed_data = spec, fed_data
        self._own_session = False
        self._watchdog = None

    def start(self) -> None:
        cfg = self.spec.cfg
        b = cfg.backend
        if not ray.is_initialized():
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {"PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)}
            kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                          runtime_env={"env_vars": env})
            if b.address:
                ray.init(address=b.address, **kwargs)
            else:
                ray.init(**kwargs)
                self._watchdog = ray_watchdog.start()  # the local cluster exits with this driver, even on kill -9
            self._own_session = True
        res = ray.cluster_resources()
        check_resources(cfg, float(res.get("CPU", 0)), float(res.get("GPU", 0)), "the Ray cluster")

        n = min(b.num_actors, cfg.data.num_clients)
        self.assignment = {c.client_id: c.client_id % n for c in self.fed_data.clients}
        groups = [[c.compact() for c in self.fed_data.clients if self.assignment[c.client_id] == a] for a in range(n)]
        spec_ref = ray.put(self.spec)
        Server = ray.remote(_ServerActor).options(num_cpus=b.server_num_cpus, num_gpus=b.server_num_gpus,
                                                  max_concurrency=1)
        Client = ray.remote(_ClientActor).options(num_cpus=b.num_cpus, num_gpus=b.num_gpus)
        self.server = Server.remote(spec_ref, ray.put(self.fed_data.global_test))
        self.actors = [Client.remote(spec_ref, ray.put(g), f"actor{k}") for k, g in enumerate(groups)]
        ray.get([a.ready.remote() for a in self.actors] + [self.server.ready.remote()])

    def _groups(self, client_ids):
        groups = [[] for _ in self.actors]
        for cid in client_ids:
            groups[self.assignment[cid]].append(cid)
        return groups

    def initial_payload(self, round_idx):
        return self.server.initial_payload.remote(round_idx)  # an ObjectRef: the payload is stored once

    def client_step(self, step, payload, round_idx, iteration, client_ids):
        upload_refs, report_refs = [], []
        for actor, group in zip(self.actors, self._groups(client_ids)):
            if group:
                up, rep = actor.run_client_step.options(num_returns=2).remote(step, payload, round_idx, iteration, group)
                upload_refs.append(up)
                report_refs.append(rep)
        reports = [r for group in ray.get(report_refs) for r in group]
        return upload_refs, sorted(reports, key=lambda r: r.client_id)

    def commit(self, client_ids):
        # fire and forget: an actor runs its calls in submission order, so the commit lands before its next step
        for actor, group in zip(self.actors, self._groups(client_ids)):
            actor.commit_and_discard.remote(group)

    def server_step(self, step, round_idx, iteration, uploads, failures, keep=None):
        payload_ref, info_ref = self.server.run_server_step_ref.options(num_returns=2).remote(
            step, round_idx, iteration, failures, *(uploads or []), keep=keep)
        has_payload, metrics = ray.get(info_ref)
        return (payload_ref if has_payload else None), metrics

    def save_checkpoint(self, directory):
        files = [f"clients-{k}.pt" for k in range(len(self.actors))]
        ray.get([self.server.save.remote(os.path.join(directory, "server.pt"))] +
                [a.save_shard.remote(os.path.join(directory, f)) for a, f in zip(self.actors, files)])
        return {"server": "server.pt", "clients": files}

    def load_checkpoint(self, directory, manifest):
        paths = [os.path.join(directory, f) for f in manifest["clients"]]
        ray.get([self.server.load.remote(os.path.join(directory, manifest["server"]))] +
                [a.load_shards.remote(paths) for a in self.actors])

    def store_stats(self):
        return ray.get([a.store_stats.remote() for a in self.actors])

    def shutdown(self) -> None:
        actors = list(getattr(self, "actors", []))
        if getattr(self, "server", None) is not None:
            actors.append(self.server)
        if actors:
            try:
                ray.get([a.close.remote() for a in actors], timeout=30)
            except Exception:
                pass
        for a in actors:
            ray.kill(a)
        if self._own_session:
            ray.shutdown()
            ray_watchdog.stop(self._watchdog)


class _ClientActor(ClientRunner):
    def commit_and_discard(self, client_ids):
        self.commit(client_ids)
        self.discard()


class _ServerActor(ServerRunner):
    def run_server_step_ref(self, step, round_idx, iteration, failures, *upload_groups, keep=None):
        payload, metrics = self.run_server_step(step, round_idx, iteration, failures, *upload_groups, keep=keep)
        return payload, (payload is not None, metrics)


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
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", runtime_env={"env_vars": env})
            self._own_session = True
        res = ray.cluster_resources()
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        if num_gpus > 0 and gpus < num_gpus:
            self.shutdown()
            raise ConfigError(f"{where}.num_gpus", f"asks for {num_gpus:g} GPU per task but the Ray cluster has {gpus:g}")
        if num_cpus > cpus:
            self.shutdown()
            raise ConfigError(f"{where}.num_cpus", f"asks for {num_cpus:g} CPUs per task but the Ray cluster has {cpus:g}")
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.slots = int(cpus // num_cpus) if num_cpus > 0 else 10**6
        if num_gpus > 0:
            self.slots = min(self.slots, _gpu_capacity(num_gpus, gpus))

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
        except Exception as e:  # worker died, cancelled ...
            return key, None, e

    def shutdown(self) -> None:
        for ref in list(self.pending):
            ray.cancel(ref, force=True)
        self.pending.clear()
        if self._own_session:
            ray.shutdown()
            self._own_session = False
