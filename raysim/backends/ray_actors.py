"""The Ray actors that host the runners (:class:`~raysim.runner.runners.ClientRunner`,
:class:`~raysim.runner.runners.ServerRunner`) and the pool of warm actors kept between the runs of one Ray session."""
from __future__ import annotations

import ray

from raysim import numerics
from raysim.backends import ray_serialization
from raysim.data.federated import ClientSet, LazyClients
from raysim.runner.step_reports import StepReports
from raysim.runner.runners import ClientRunner, ServerRunner
from raysim.messages import payload_to, tensor_bytes


# -- warm actors between runs -----------------------------------------------------------------------------------------
# Starting an actor starts a Python worker process that imports torch, raysim and the method (seconds each, more on a
# loaded machine); a run on Ray starts a server actor and n client actors. Within one Ray session that the caller
# started (ray.init before run_experiment: a notebook, a loop over seeds, the test suite), keep_actors_warm() parks the
# actors of a finished run and hands them to the next run whose actors ask for the same resources: reset() rebuilds
# the runner in the same process (a new algorithm, model cache, store and data, exactly as a fresh actor's
# constructor), so the table is the one fresh actors give. Parked actors keep their CPU/GPU reservations: a run whose
# actors differ ends the parked ones before starting its own, TaskPool ends them, release_warm_actors() ends them.
WARM = {"on": False, "client": [], "server": []}  # parked: (resource key, actor handle)


def keep_actors_warm(on: bool = True) -> None:
    """Reuse the actors of finished runs in this Ray session (see above); ``False`` also ends the parked ones."""
    WARM["on"] = bool(on)
    if not on:
        release_warm_actors()


def release_warm_actors() -> int:
    """End every parked actor (their resources return to the cluster); returns how many."""
    parked = WARM["client"] + WARM["server"]
    WARM["client"], WARM["server"] = [], []
    for _, a in parked:
        try:
            ray.kill(a)
        except Exception:
            pass
    return len(parked)


def take_warm(kind: str, key, n: int) -> list:
    """Up to n parked actors of ``kind`` with resource key ``key`` (removed from the park); parked actors of
    ``kind`` with other keys are ended (they cannot serve this run), those with ``key`` stay parked."""
    same = [a for k, a in WARM[kind] if k == key]
    for k, a in WARM[kind]:
        if k != key:
            try:
                ray.kill(a)
            except Exception:
                pass
    WARM[kind] = [(key, a) for a in same[n:]]
    return same[:n]


class ClientActor(ClientRunner):
    def __init__(self, spec, clients, name="clients", source=None, gpu_memory_mb: float = 0.0):
        numerics.enter(spec.runner.numerics)  # before anything computes here (the data may be built below)
        ray_serialization.register()
        if source is not None:  # client ids into the shared pools
            clients = ClientSet(source, clients)
        elif len(clients) and isinstance(clients[0], int):  # client ids: build their data here, from the config
            from raysim.data.federated import build_federated_data
            from raysim.runner.runners import enter_run

            enter_run(spec)  # the user's registered loaders, the driver's working directory

            fed = build_federated_data(spec.data, spec.runner.seed)
            clients = (fed.clients.view(clients) if isinstance(fed.clients, LazyClients)
                       else [fed.clients[i] for i in clients])
        super().__init__(spec, clients, name)
        self.gpu_memory_mb = float(gpu_memory_mb)
        if self.gpu_memory_mb and self.device.type == "cuda":  # backend.model_resources[].gpu_memory_mb: a cap, so
            # that one actor cannot take the memory of the others sharing its GPU
            import torch

            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.gpu_memory_mb * 2**20 / total), self.device)

    def reset(self, spec, clients, name="clients", source=None, gpu_memory_mb: float = 0.0) -> bool:
        """Host another run's clients in this process (keep_actors_warm): as a new actor would."""
        self.__init__(spec, clients, name, source, gpu_memory_mb)
        return True

    def hosting(self) -> dict:
        """What this actor hosts and holds: its client ids, its Ray resources and its GPU memory cap."""
        return {"clients": self.client_ids(), "resources": dict(ray.get_runtime_context().get_assigned_resources()),
                "gpu_memory_mb": self.gpu_memory_mb}

    def close(self) -> None:
        if self.store is not None:
            super().close()
        self.data, self.store = {}, None  # a parked actor holds no client data or states
        self._forget_decoded(list(self._decoded))
        self.models = self.algorithm = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def numerics(self) -> dict:
        """This process's kernel choice (raysim/numerics.py) and its node."""
        return dict(numerics.describe(), node=ray.get_runtime_context().get_node_id(), role="clients")

    def commit_and_discard(self, client_ids, token=None):
        self.commit(client_ids, token)
        self.discard()

    def run_client_step(self, step, payload, round_idx, iteration, client_ids, pre=(), merge=None):
        """``pre``: the driver's commits not sent yet (carried by this call, carried out first, in order). The
        reports carry the bytes of the returned uploads (``StepReports.upload_bytes``)."""
        for group, token in pre:
            self.commit_and_discard(group, token)
        uploads, reports = super().run_client_step(step, payload, round_idx, iteration, client_ids, merge)
        uploads = payload_to(uploads, "cpu")  # uploads leave the actor from the host (one copy per merged upload)
        reports = StepReports(reports)
        reports.upload_bytes = tensor_bytes(uploads)
        return uploads, reports


class ServerActor(ServerRunner):
    def __init__(self, spec, *args, **kwargs):
        numerics.enter(spec.runner.numerics)
        ray_serialization.register()
        super().__init__(spec, *args, **kwargs)

    def reset(self, *args, **kwargs) -> bool:
        """Serve another run (keep_actors_warm): as a new actor would."""
        self.__init__(*args, **kwargs)
        return True

    def numerics(self) -> dict:
        """This process's kernel choice (raysim/numerics.py) and its node."""
        return dict(numerics.describe(), node=ray.get_runtime_context().get_node_id(), role="server")

    def close(self) -> None:
        super().close()
        self.state, self.global_test, self.server_data = None, None, None
        self.models = self.algorithm = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def initial_payload_ref(self, round_idx):
        payload = self.initial_payload(round_idx)
        return payload, tensor_bytes(payload)

    def run_server_step_ref(self, step, round_idx, iteration, failures, *upload_groups, keep=None):
        """(payload, (whether there is one, metrics, its bytes))."""
        payload, metrics = self.run_server_step(step, round_idx, iteration, failures, *upload_groups, keep=keep)
        return payload, (payload is not None, metrics, tensor_bytes(payload) if payload is not None else 0)

    def save_messages_refs(self, path, versions, batches, *objs):
        """``save_messages`` with the handles resolved by Ray: ``objs`` = the payloads of ``versions``, then the
        upload groups of each (batch, keep, number of groups) in ``batches``."""
        payloads = dict(zip(versions, objs[:len(versions)]))
        uploads, i = {}, len(versions)
        for b, keep, n in batches:
            uploads[b] = (list(objs[i:i + n]), keep)
            i += n
        self.save_messages(path, payloads, uploads)

    def hold_messages(self, path):
        """Load a ``save_messages`` file and hold it for ``held_message`` calls (the object store keeps what they
        return); ``None`` lets it go. Returns (versions, batches)."""
        self._held = self.load_messages(path) if path is not None else None
        return (sorted(self._held["payloads"]), sorted(self._held["uploads"])) if self._held else ([], [])

    def held_message(self, kind, key):
        obj = self._held[kind][key]
        return obj, tensor_bytes(obj)

    def run_server_step_ahead(self, step, round_idx, iteration, prior_failures, n, *refs, keep=None):
        """The server step submitted right behind a client step: ``refs`` = n upload groups, then the n report
        lists of the same calls; the failures are the driver's list so far plus the failed reports, exactly as the
        driver computes them."""
        failed = {(r.client_id, r.error) for reps in refs[n:] for r in reps if not r.ok}
        failures = sorted(set(map(tuple, prior_failures)) | failed)
        return self.run_server_step_ref(step, round_idx, iteration, failures, *refs[:n], keep=keep)


def alive(actor) -> bool:
    try:
        ray.get(actor.ready.remote(), timeout=60)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:  # busy, not dead
        return True
