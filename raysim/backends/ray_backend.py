"""Ray backend: a pool of long-lived client actors, each hosting a fixed group of virtual clients whose data and
state stay resident, plus one server actor holding the server state.

Per round: the server actor builds the payload (returned into the object store once); every actor gets its whole
group of sampled clients in one call and returns two objects, the uploads (passed by reference straight to the
server actor, never through the driver) and small reports (metrics, message sizes, failures) for the driver.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

import ray

from raysim.backends import ray_serialization, ray_watchdog
from raysim.backends.base import NO_FOLLOW, Backend, BackendReport, run_state_dir
from raysim.backends.ray_balance import CostBalancing
from raysim.backends.ray_recovery import ActorRecovery, ClientStepCall
from raysim.backends.ray_actors import WARM, ClientActor, ServerActor, alive, release_warm_actors, take_warm
from raysim.backends.ray_preflight import (ADDRESS_FIX, actor_runtime_env, address_error, check_address,
                                          check_node_numerics, check_node_resources, check_resources, code_runtime_env,
                                          remove_unpacked, session_dir, shipped_uris)
from raysim.data.federated import LazyClients
from raysim.engine.placement import actor_pools, cost_model
from raysim.runner.runners import ClientReport, server_data
from raysim.errors import SimulationError
from raysim.messages import tensor_bytes
from raysim.runner import fallbacks


class Commit(NamedTuple):
    """A commit issued to a client actor (``ClientActor.commit_and_discard``'s arguments)."""

    client_ids: list
    token: Optional[str]


@dataclass(frozen=True)
class WarmKeys:
    """What a parked actor must match to be reused for this run (keep_actors_warm)."""

    client: tuple
    server: tuple


@dataclass(frozen=True)
class ServerStepAhead:
    """A server step submitted right behind a client step's calls (:meth:`RayBackend.client_step`), on the uploads it
    was given, with the refs of its results, for :meth:`RayBackend.server_step` to collect."""

    name: str
    round_idx: int
    iteration: int
    uploads: list
    payload_ref: object
    info_ref: object

    def answers(self, step, round_idx: int, iteration: int) -> bool:
        return (self.name, self.round_idx, self.iteration) == (step.name, round_idx, iteration)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, spec, fed_data, settings):
        self.spec, self.fed_data, self.settings = spec, fed_data, settings  # settings: engine.settings.BackendSettings
        b = settings.backend
        self._own_session = False
        self._watchdog = None
        self._state_dir = None
        # what travels through the object store, per round: payload bytes read by the actors' calls (one read per
        # actor and step) and upload bytes the actors returned, by step mode (train / evaluate); tensor bytes
        self.object_store: dict[int, dict] = {}
        self._payload_bytes: dict = {}  # payload ObjectRef -> its tensor bytes (the latest few)
        # the layout (start: _layout): actor pools, which actor hosts each client, what each actor is built with
        self.pools: list = []
        self.assignment: dict[int, int] = {}
        self._pool_of: dict = {}  # actor index -> its pool
        self.client_runners = 0
        self._lazy = False  # clients as index ranges into shared pools (LazyClients), shipped once
        self._on_actors = False  # client data built on the actors
        self._source_ref = None
        self._spec_ref = None
        self._group_refs: list = []  # per actor: what it is built with (its client ids or their data)
        # the actors (start: _launch)
        self.shipped: list[str] = []  # the code shipped to the actors
        self._code_uris: list = []  # removed at the end
        self._Clients: list = []  # per pool: the client actor class with its resources
        self._warm_keys: Optional[WarmKeys] = None
        self.server = None
        self.actors: list = []
        self._last_commit: list[Optional[Commit]] = []  # per actor: the last commit issued
        self._unsent: list[list[Commit]] = []  # per actor: commits not sent yet (they ride on its next step call)
        self._unconfirmed: list[list[Commit]] = []  # per actor: commits issued since its last call that returned
        self.numerics_report: list[dict] = []  # every computing process's kernel choice (numerics_processes)
        # its parts: the on_actor_failure policy, cost-aware placement (backend.balance: cost, with a pool of two
        # actors or more; start), the server step submitted ahead of the driver's call (client_step)
        self.recovery = ActorRecovery(self, settings.on_actor_failure, settings.max_retries, b.step_timeout_s)
        self.balancing: Optional[CostBalancing] = None
        self._ahead: Optional[ServerStepAhead] = None

    def start(self) -> None:
        self._connect()
        self._layout()
        self._launch()

    def _connect(self) -> None:
        """Join (or start) the Ray session; check its resources, its nodes and their kernels before any actor."""
        s = self.settings
        b = s.backend
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                          runtime_env=code_runtime_env(b.address))
            if b.address:
                check_address(b.address, b.connect_timeout_s)
                try:
                    ray.init(address=b.address, **kwargs)
                except Exception as e:  # reached, but the driver cannot join (e.g. the head announces another address)
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                    raise address_error(f"reached {b.address} but could not join the Ray cluster there "
                                         f"({type(e).__name__}: {first}); {ADDRESS_FIX}") from None
            else:
                ray.init(address="local", dashboard_host="127.0.0.1", **kwargs)  # never exposed beyond loopback unless configured
                self._watchdog = ray_watchdog.start()  # the local cluster exits with this driver, even on kill -9
            self._own_session = True
        ray_serialization.register()  # tensors through the object store as raw bytes (bit-identical, ~15x faster)
        res = ray.cluster_resources()
        check_resources(s, float(res.get("CPU", 0)), float(res.get("GPU", 0)), "the Ray cluster",
                        float(res.get("memory", 0)))
        check_node_resources(s, ray.nodes())
        check_node_numerics(s, ray.nodes())

    def _layout(self) -> None:
        """The state directory, the actor pools and the first client layout, and what each actor is built with."""
        b = self.settings.backend
        self.spec, self._state_dir = run_state_dir(self.spec, self.settings)
        # actor pools: one per backend.model_resources entry (its architecture's clients), the default one for the rest
        self.pools, self.assignment = actor_pools(b, [a.arch for a in self.spec.task.archs])
        self._pool_of = {k: p for p in self.pools for k in p.actors}
        n = self.client_runners = len(self._pool_of)
        on_actors = b.data == "actors" or (b.data == "auto" and bool(b.address))
        # clients as index ranges into shared pools (LazyClients): the pools go to the object store once, each actor
        # gets its client ids (no per-client objects shipped)
        self._lazy = isinstance(self.fed_data.clients, LazyClients) and not on_actors
        self._source_ref = ray.put(self.fed_data.clients.source) if self._lazy else None
        self._on_actors = on_actors
        groups = [self._group(a) for a in range(n)]
        self._spec_ref = ray.put(self.spec)
        self._group_refs = [ray.put(g) for g in groups]

    def _launch(self) -> None:
        """The server actor (on the head node) and the client actors of every pool (warm ones reused when they fit),
        then the per-actor bookkeeping."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        b = self.settings.backend
        n = len(self._pool_of)

        # the server actor holds the server state alone: keep it on the head node (where the GCS lives, the last
        # node to go), else the driver's (soft: elsewhere if it must)
        heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
        here = NodeAffinitySchedulingStrategy(heads[0] if heads else ray.get_runtime_context().get_node_id(), soft=False)
        renv = actor_runtime_env(self.spec, b)
        extra = {"runtime_env": renv} if renv else {}
        self.shipped = list(self.spec.code) + ([os.getcwd()] if b.code == "working_dir" else [])
        self._code_uris = shipped_uris(renv, len(self.spec.code), b.code == "working_dir")  # removed at the end
        Server = ray.remote(ServerActor).options(num_cpus=b.server_num_cpus, num_gpus=b.server_num_gpus,
                                                  max_concurrency=1, scheduling_strategy=here, **extra)
        self._Clients = [ray.remote(ClientActor).options(
            num_cpus=p.num_cpus, num_gpus=p.num_gpus, scheduling_strategy="SPREAD" if b.placement == "spread" else
            "DEFAULT", **extra) for p in self.pools]
        if WARM["on"] and not self._own_session and not b.address and not b.model_resources:
            self._warm_keys = WarmKeys(("client", b.num_cpus, b.num_gpus, b.placement, repr(renv), b.numerics),
                                       ("server", b.server_num_cpus, b.server_num_gpus, repr(renv), b.numerics))
        self.server, self.actors = self._start_actors(Server, ray.put(self.fed_data.global_test),
                                                      ray.put(server_data(self.spec, self.fed_data)))
        self._last_commit = [None] * n
        self._unsent = [[] for _ in range(n)]
        self._unconfirmed = [[] for _ in range(n)]
        if b.balance == "cost" and any(len(p.actors) > 1 for p in self.pools):
            self.balancing = CostBalancing(self, cost_model(self.spec.task, self.fed_data), self.pools)
        ray.get([a.ready.remote() for a in self.actors] + [self.server.ready.remote()])
        # every computing process's kernel choice, in the run metadata (numerics_processes)
        self.numerics_report = ray.get([a.numerics.remote() for a in [self.server, *self.actors]])

    def _new_client_actor(self, k: int):
        pool = self._pool_of[k]
        return self._Clients[self.pools.index(pool)].remote(self._spec_ref, self._group_refs[k], f"actor{k}",
                                                            self._source_ref, pool.gpu_memory_mb)

    def _group(self, k: int):
        """What actor k is built with: its client ids (lazy clients, or data built on the actors) or their data."""
        ids = [cid for cid, a in self.assignment.items() if a == k]
        if self._lazy:
            return np.asarray(ids, dtype=np.int64)
        if self._on_actors:
            return ids
        return [self.fed_data.clients[cid].compact() for cid in ids]

    def _start_actors(self, Server, global_test_ref, server_data_ref):
        """The server actor and the client actors: parked ones with the same resources reset for this run
        (keep_actors_warm), new ones for the rest; parked actors that do not fit this run are ended first, so that
        their reservations do not hold up the new ones."""
        n = len(self._group_refs)
        warm_server, warm_clients = [], []
        if self._warm_keys is not None:
            keys = self._warm_keys
            warm_clients, warm_server = take_warm("client", keys.client, n), take_warm("server", keys.server, 1)
        else:
            release_warm_actors()
        server, reset = None, []
        for a in warm_server:
            reset.append(("server", a, a.reset.remote(self._spec_ref, global_test_ref, server_data_ref)))
        clients: list = [None] * n
        for k, a in enumerate(warm_clients):
            reset.append((k, a, a.reset.remote(self._spec_ref, self._group_refs[k], f"actor{k}", self._source_ref)))
        for k_or_server, a, ref in reset:  # a parked actor that died meanwhile is replaced by a new one
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                continue
            if k_or_server == "server":
                server = a
            else:
                clients[k_or_server] = a
        if server is None or any(c is None for c in clients):
            release_warm_actors()  # same-resource actors left parked could hold up the new ones
        if server is None:
            server = Server.remote(self._spec_ref, global_test_ref, server_data_ref)
        for k in range(n):
            if clients[k] is None:
                clients[k] = self._new_client_actor(k)
        return server, clients

    def replace_actor(self, k: int) -> None:
        """A new actor for group k (ActorRecovery): same clients, states from the durable store; the commits the
        dead actor may not have carried out are replayed (idempotent: a commit renames the staged files the dead
        actor may not have committed)."""
        try:
            ray.kill(self.actors[k], no_restart=True)
        except Exception:
            pass
        if self.balancing is not None:  # clients may have moved since the start: the group as it is now
            self._group_refs[k] = ray.put(self._group(k))
        self.actors[k] = self._new_client_actor(k)
        # the commits the dead actor may not have carried out, in order (else the last one issued); replaying one it
        # did carry out is harmless (a commit renames the staged file when it is still there)
        replay = self._unconfirmed[k] or ([self._last_commit[k]] if self._last_commit[k] is not None else [])
        self._unsent[k], self._unconfirmed[k] = [], []
        for commit in replay:
            self.actors[k].commit_and_discard.remote(commit.client_ids, commit.token)
        ray.get(self.actors[k].ready.remote())

    def confirmed(self, k: int) -> None:
        """Actor k's call returned: it ran its calls in order, so every commit sent before it too."""
        self._unconfirmed[k] = []

    def _groups(self, client_ids):
        groups = [[] for _ in self.actors]
        for cid in client_ids:
            groups[self.assignment[cid]].append(cid)
        return groups

    def initial_payload(self, round_idx):
        # an ObjectRef: the payload is stored once
        ref, nbytes = self.server.initial_payload_ref.options(num_returns=2).remote(round_idx)
        self._note_payload(ref, ray.get(nbytes))
        return ref

    def _note_payload(self, ref, nbytes: int) -> None:
        self._payload_bytes[ref] = int(nbytes)
        while len(self._payload_bytes) > 4:
            self._payload_bytes.pop(next(iter(self._payload_bytes)))

    def _count_traffic(self, step, round_idx: int, payload, reports_by_actor: list) -> None:
        row = self.object_store.setdefault(round_idx, {"train_down": 0, "train_up": 0, "evaluate_down": 0,
                                                       "evaluate_up": 0})
        mode = "evaluate" if step.mode == "evaluate" else "train"
        nbytes = (self._payload_bytes.get(payload, 0) if isinstance(payload, ray.ObjectRef)
                  else tensor_bytes(payload))  # the setup's first payload is passed inline
        row[f"{mode}_down"] += nbytes * len(reports_by_actor)
        row[f"{mode}_up"] += sum(int(getattr(r, "upload_bytes", 0)) for r in reports_by_actor)

    def client_step(self, step, payload, round_idx, iteration, client_ids, follow=NO_FOLLOW):
        """``follow.server`` (the server step that comes next, with its failures so far and keep): submitted right
        behind the client calls, on their upload and report refs (the server actor adds the step's failed reports
        to the failures), so it starts when the last upload exists instead of after a driver round trip;
        :meth:`server_step` collects it (or, when the uploads it was given were lost and replaced, runs the step
        anew: a task whose arguments failed never ran)."""
        where = f"round {round_idx}, step '{step.name}'"
        nxt, merge = follow.server, follow.merge
        self._ahead = None
        placement = None
        if self.balancing is not None and step.mode != "evaluate":
            placement = self.balancing.place(step, client_ids, where)
        groups = self._groups(client_ids)

        def submit_server(calls):
            if nxt is None or not calls:
                return
            ups = [calls[k][0] for k in sorted(calls)]
            reps = [calls[k][1] for k in sorted(calls)]
            payload_ref, info_ref = self.server.run_server_step_ahead.options(num_returns=2).remote(
                nxt.step, round_idx, iteration, nxt.failures, len(ups), *ups, *reps, keep=nxt.keep)
            self._ahead = ServerStepAhead(nxt.step.name, round_idx, iteration, ups, payload_ref, info_ref)

        out = self.recovery.call_actors(groups, lambda a, g: a.run_client_step.options(num_returns=2).remote(
            step, payload, round_idx, iteration, g, self._take_unsent(a), merge), where, submit_server)
        upload_refs, reports = [], []
        self._count_traffic(step, round_idx, payload, [reps for _, reps in out.values() if reps is not None])
        upload_actor = {}
        for k in sorted(out):
            up, reps = out[k]
            if reps is not None:
                upload_actor[up] = k
            if reps is None:  # skipped: the actor's clients failed this step
                reps = [ClientReport(c, round_idx, step.name, ok=False, iteration=iteration,
                                     error="ActorDied: its client actor died (on_actor_failure)") for c in groups[k]]
            else:
                upload_refs.append(up)
            reports += reps
        self.recovery.remember(ClientStepCall(step, payload, round_idx, iteration, groups, merge), upload_actor)
        if placement is not None:
            self.balancing.record(placement, reports, step.name)
        return upload_refs, sorted(reports, key=lambda r: r.client_id)

    def commit(self, client_ids, token=None):
        # carried by the actor's next step call (run before the step, in order; no task of its own), or sent by
        # flush_commits before any other call that reads client states; remembered per actor so that a replacement
        # replays it
        for k, group in enumerate(self._groups(client_ids)):
            self._last_commit[k] = Commit(group, token)
            self._unsent[k].append(Commit(group, token))
            self._unconfirmed[k].append(Commit(group, token))

    def _take_unsent(self, actor) -> list:
        k = self.actors.index(actor)
        pending, self._unsent[k] = self._unsent[k], []
        return pending

    def flush_commits(self) -> None:
        """Send every commit not yet carried by a step call (before checkpoints, moves, statistics)."""
        for k, pending in enumerate(self._unsent):
            for commit in pending:
                self.actors[k].commit_and_discard.remote(commit.client_ids, commit.token)
            pending.clear()

    def server_step(self, step, round_idx, iteration, uploads, failures, keep=None):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.answers(step, round_idx, iteration):
            payload_ref, info_ref = ahead.payload_ref, ahead.info_ref
            if ahead.uploads == list(uploads or []):
                try:
                    has_payload, metrics, nbytes = ray.get(info_ref)
                    if has_payload:
                        self._note_payload(payload_ref, nbytes)
                    return (payload_ref if has_payload else None), metrics
                except ray.exceptions.RayError as e:
                    if not alive(self.server):
                        raise SimulationError(f"the server actor died in round {round_idx}, step '{step.name}' "
                                              f"({type(e).__name__}); the server state lives only there, so the run "
                                              f"stops (resume from its last checkpoint with --resume)") from None
                    # its uploads are gone (or the step raised): the server state is unchanged; as below
            else:  # a client actor was replaced: the call ahead depended on its lost results, so it never ran
                try:
                    ray.get(info_ref)
                except ray.exceptions.RayError:
                    pass
                else:
                    raise SimulationError(f"round {round_idx}, step '{step.name}': the server step submitted ahead "
                                          f"ran on uploads that were replaced (internal error)")
        payload_ref, info_ref = self.server.run_server_step_ref.options(num_returns=2).remote(
            step, round_idx, iteration, failures, *(uploads or []), keep=keep)
        try:
            has_payload, metrics, nbytes = ray.get(info_ref)
        except ray.exceptions.RayError as e:
            if not alive(self.server):
                raise SimulationError(f"the server actor died in round {round_idx}, step '{step.name}' "
                                      f"({type(e).__name__}); the server state lives only there, so the run stops "
                                      f"(resume from its last checkpoint with --resume)") from None
            uploads = self.recovery.redo_lost_uploads(list(uploads or []), e, f"round {round_idx}, step '{step.name}'")
            return self.server_step(step, round_idx, iteration, uploads, failures, keep)
        if has_payload:
            self._note_payload(payload_ref, nbytes)
        return (payload_ref if has_payload else None), metrics

    def save_checkpoint(self, directory):
        self.flush_commits()
        files = [f"clients-{k}.pt" for k in range(len(self.actors))]
        server_ref = self.server.save.remote(os.path.join(directory, "server.pt"))
        self.recovery.call_actors([[0]] * len(self.actors), lambda a, g: (None, a.save_shard.remote(
            os.path.join(directory, files[self.actors.index(a)]))), "a checkpoint")
        ray.get(server_ref)
        return {"server": "server.pt", "clients": files}

    def load_checkpoint(self, directory, manifest):
        self.flush_commits()
        paths = [os.path.join(directory, f) for f in manifest["clients"]]
        ray.get([self.server.load.remote(os.path.join(directory, manifest["server"]))] +
                [a.load_shards.remote(paths) for a in self.actors])

    def save_messages(self, path, payloads, uploads):
        # handles go to the server actor as top-level arguments (Ray resolves those only), with their layout
        versions = sorted(payloads)
        batches = [(b, sorted(keep), len(list(groups or []))) for b, (groups, keep) in sorted(uploads.items())]
        refs = [payloads[v] for v in versions] + [g for b, _ in sorted(uploads.items()) for g in (uploads[b][0] or [])]
        ray.get(self.server.save_messages_refs.remote(path, versions, batches, *refs))

    def load_messages(self, path):
        versions, batches = ray.get(self.server.hold_messages.remote(path))
        payloads = {}
        for v in versions:
            ref, nbytes = self.server.held_message.options(num_returns=2).remote("payloads", v)
            self._note_payload(ref, ray.get(nbytes))
            payloads[v] = ref
        uploads = {b: [self.server.held_message.options(num_returns=2).remote("uploads", b)[0]] for b in batches}
        ray.get(self.server.hold_messages.remote(None))  # the actor lets go of the file's contents
        return payloads, uploads

    def report(self):
        self.flush_commits()
        store = ray.get([a.store_stats.remote() for a in self.actors])
        taken = ray.get([a.fallbacks_taken.remote() for a in self.actors])
        return BackendReport(processes=list(self.numerics_report), runner_failures=list(self.recovery.failures),
                             transport_bytes=dict(self.object_store), store=store,
                             placement=list(self.balancing.log) if self.balancing is not None else [],
                             fallbacks=fallbacks.merged(taken))

    def actor_nodes(self) -> list[str]:
        """The node id each client actor runs on."""
        return ray.get([a.node_id.remote() for a in self.actors])

    def server_node(self) -> str:
        return ray.get(self.server.node_id.remote())

    def shutdown(self) -> None:
        actors = list(self.actors)
        if self.server is not None:
            actors.append(self.server)
        closed = [a.close.remote() for a in actors]
        if closed:
            try:
                ray.wait(closed, num_returns=len(closed), timeout=30)
            except Exception:
                pass
        keys = self._warm_keys
        for a, ref in zip(actors, closed):
            if keys is not None and WARM["on"] and ray.is_initialized():
                try:
                    ray.get(ref, timeout=0)  # closed cleanly: park it for the next run (keep_actors_warm)
                    WARM["server" if a is self.server else "client"].append(
                        (keys.server if a is self.server else keys.client, a))
                    continue
                except Exception:
                    pass
            ray.kill(a)
        if self._state_dir:
            shutil.rmtree(self._state_dir, ignore_errors=True)
        if self._own_session:
            session = session_dir() if not self.settings.backend.address else None
            ray.shutdown()
            ray_watchdog.stop(self._watchdog)
            # Ray leaves its unpacked copy of the user's shipped code in the session directory of a local cluster it
            # started: removed here (a shared or remote session keeps it: other runs may use the same package)
            remove_unpacked(session, self._code_uris)
