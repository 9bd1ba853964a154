"""Ray backend: a pool of long-lived client actors, each hosting a fixed group of virtual clients whose data and
state stay resident, plus one server actor holding the server state.

Per round: the server actor builds the payload (returned into the object store once); every actor gets its whole
group of sampled clients in one call and returns two objects, the uploads (passed by reference straight to the
server actor, never through the driver) and small reports (metrics, message sizes, failures) for the driver.
"""
from __future__ import annotations

import math
import os
import shutil

import numpy as np

import ray

from raysim.backends import ray_watchdog
from raysim.backends import ray_serialization

from raysim.backends.base import Backend, run_state_dir
from raysim.config import ConfigError
from raysim.data.federated import ClientSet, LazyClients, client_sizes
from raysim.errors import SimulationError
from raysim.engine.runners import ClientReport, ClientRunner, ServerRunner, server_data


def _gpu_capacity(per_actor: float, gpus: float) -> int:
    if per_actor <= 0:
        return 10**9
    if per_actor <= 1:
        return int(math.floor(gpus + 1e-9)) * int(math.floor(1 / per_actor + 1e-9)) + (
            int(math.floor((gpus % 1) / per_actor + 1e-9)) if gpus % 1 else 0)
    return int(math.floor(gpus / per_actor + 1e-9))


# -- warm actors between runs -----------------------------------------------------------------------------------------
# Starting an actor starts a Python worker process that imports torch, raysim and the method (seconds each, more on a
# loaded machine); a run on Ray starts a server actor and n client actors. Within one Ray session that the caller
# started (ray.init before run_experiment: a notebook, a loop over seeds, the test suite), keep_actors_warm() parks the
# actors of a finished run and hands them to the next run whose actors ask for the same resources: reset() rebuilds
# the runner in the same process (a new algorithm, model cache, store and data, exactly as a fresh actor's
# constructor), so the table is the one fresh actors give. Parked actors keep their CPU/GPU reservations: a run whose
# actors differ ends the parked ones before starting its own, TaskPool ends them, release_warm_actors() ends them.
_WARM = {"on": False, "client": [], "server": []}  # parked: (resource key, actor handle)


def keep_actors_warm(on: bool = True) -> None:
    """Reuse the actors of finished runs in this Ray session (see above); ``False`` also ends the parked ones."""
    _WARM["on"] = bool(on)
    if not on:
        release_warm_actors()


def release_warm_actors() -> int:
    """End every parked actor (their resources return to the cluster); returns how many."""
    parked = _WARM["client"] + _WARM["server"]
    _WARM["client"], _WARM["server"] = [], []
    for _, a in parked:
        try:
            ray.kill(a)
        except Exception:
            pass
    return len(parked)


def _take_warm(kind: str, key, n: int) -> list:
    """Up to n parked actors of ``kind`` with resource key ``key`` (removed from the park); parked actors of
    ``kind`` with other keys are ended (they cannot serve this run), those with ``key`` stay parked."""
    same = [a for k, a in _WARM[kind] if k == key]
    for k, a in _WARM[kind]:
        if k != key:
            try:
                ray.kill(a)
            except Exception:
                pass
    _WARM[kind] = [(key, a) for a in same[n:]]
    return same[:n]


def check_node_resources(cfg, nodes: list[dict]) -> None:
    """Per node: an actor must fit on at least one alive node (a cluster of small nodes cannot host a big actor)."""
    b = cfg.backend
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if not alive:
        return
    if not any(r.get("CPU", 0) + 1e-9 >= b.num_cpus and r.get("GPU", 0) + 1e-9 >= b.num_gpus for r in alive):
        biggest = max(alive, key=lambda r: r.get("CPU", 0))
        raise ConfigError("backend.num_cpus", f"a client actor asks for {b.num_cpus:g} CPU / {b.num_gpus:g} GPU, but no "
                                              f"node of the Ray cluster has that much (largest: {biggest.get('CPU', 0):g} "
                                              f"CPU, {biggest.get('GPU', 0):g} GPU)")


def code_runtime_env(address) -> dict:
    """How raysim's code reaches the workers: on a local cluster the checkout's path (PYTHONPATH); on an existing
    cluster (``backend.address``) also Ray's ``py_modules`` (the packages are uploaded and unpacked on every node)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)}}
    if address:
        import importlib

        env["py_modules"] = [os.path.dirname(importlib.import_module(m).__file__)
                             for m in ("raysim", "algorithms", "envs", "tuning")]
    return env


def actor_runtime_env(spec, address) -> dict | None:
    """The client and server actors' runtime environment when the user's code must reach them (``backend.code``,
    paths from :mod:`raysim.usercode`): Ray ``py_modules`` (or ``working_dir``), uploaded once per content hash
    and unpacked on every node. An actor's ``py_modules`` replace the job's, so raysim's own packages are listed
    again on a ``backend.address`` cluster."""
    code = spec.cfg.backend.code
    if code != "working_dir" and not spec.code:
        return None
    own = code_runtime_env(address).get("py_modules", [])
    if code == "working_dir":
        env = {"working_dir": os.getcwd()}
        if own:
            env["py_modules"] = own
    else:
        env = {"py_modules": own + list(spec.code)}
    return _upload(env)


def _upload(env: dict) -> dict:
    """Local paths -> package URIs in the cluster's storage. An actor's runtime_env takes URIs only (local paths
    are for ``ray.init``), so the driver uploads them with the function ``ray.init`` itself uses for a job's
    runtime_env (content-hashed: an unchanged module is uploaded once per cluster)."""
    import tempfile

    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    scratch = tempfile.mkdtemp(prefix="raysim-code-")
    try:
        env = upload_py_modules_if_needed(dict(env), include_gitignore=True, scratch_dir=scratch)
        return upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _machine_memory() -> float:
    """Bytes of memory this machine has available (0 when unknown)."""
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def check_resources(cfg, cpus: float, gpus: float, where: str, memory: float = 0.0) -> None:
    """Fail fast where Ray would leave actors pending forever, or where the client actors' in-memory state stores
    (backend.state_memory_mb each) cannot fit in ``memory`` bytes (0: unknown, not checked)."""
    b = cfg.backend
    n = min(b.num_actors, cfg.data.num_clients)
    store = n * b.state_memory_mb * 2**20
    if memory > 0 and store > memory:
        raise ConfigError("backend.state_memory_mb",
                          f"{n} client actors x {b.state_memory_mb} MB of in-memory client states = "
                          f"{store / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB {where} has for them; "
                          f"lower backend.state_memory_mb (states beyond it spill to backend.state_dir; 0 spills all, "
                          f"same table)")
    need_gpu_actors = n if b.num_gpus > 0 else 0
    if b.num_gpus > 0 or b.server_num_gpus > 0:
        if gpus <= 0:
            raise ConfigError("backend.num_gpus" if b.num_gpus > 0 else "backend.server_num_gpus",
                              f"asks for GPUs but {where} has none (torch.cuda.is_available() is False and no GPUs are "
                              f"declared to Ray); set backend.num_gpus: 0 and backend.server_num_gpus: 0")
        # pack client actors, then the server, onto whole GPUs
        if need_gpu_actors > _gpu_capacity(b.num_gpus, gpus) or (
                b.num_gpus * need_gpu_actors + b.server_num_gpus > gpus + 1e-9):
            raise ConfigError("backend.num_gpus", f"{n} client actors"
                                                  f"{' (backend.num_actors capped at data.num_clients)' if n < b.num_actors else ''}"
                                                  f" x {b.num_gpus} GPU"
                                                  f"{' + server ' + str(b.server_num_gpus) if b.server_num_gpus else ''}"
                                                  f" do not fit on the {gpus:g} GPU(s) of {where}")
    need_cpu = n * b.num_cpus + b.server_num_cpus
    if need_cpu > cpus + 1e-9:
        capped = f" (backend.num_actors={b.num_actors} capped at data.num_clients)" if n < b.num_actors else ""
        raise ConfigError("backend.num_actors", f"{n} actors{capped} x {b.num_cpus} CPU + server {b.server_num_cpus} CPU = "
                                                f"{need_cpu:g} CPUs, but {where} has {cpus:g}; lower backend.num_actors "
                                                f"or backend.num_cpus (fractions allowed)")


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
_ADDRESS_FIX = ("use the address that 'ray start --head' printed on the head node (the --address=HOST:PORT of its "
                "'ray start' line), or leave backend.address out to start a local cluster")


def _address_error(message: str) -> ConfigError:
    return ConfigError("backend.address", message)


def check_address(address: str, timeout_s: float) -> None:
    """Fail within ``timeout_s`` (one ConfigError naming backend.address) unless ``address`` reaches a running Ray
    cluster: the host resolves, the port accepts a connection, and what listens there answers as Ray's GCS does
    (gRPC over HTTP/2). ``auto`` must find a cluster started on this machine; ``ray://`` (Ray Client) is checked up
    to the connection."""
    import socket

    addr = str(address).strip()
    if addr == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            found = canonicalize_bootstrap_address("auto")
        except Exception:
            found = None
        if not found:
            raise _address_error(f"'auto' found no Ray cluster started on this machine; start one with 'ray start "
                                 f"--head' or {_ADDRESS_FIX}")
        addr = found
    client = addr.startswith("ray://")
    hostport = addr[len("ray://"):] if client else addr
    if "://" in hostport or "/" in hostport:
        raise _address_error(f"{address!r} is not HOST:PORT (or ray://HOST:PORT); {_ADDRESS_FIX}")
    host, sep, port = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _address_error(f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:6379); {_ADDRESS_FIX}")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except socket.gaierror as e:
        raise _address_error(f"unknown host {host!r} in {address!r} ({e.strerror or e}); {_ADDRESS_FIX}") from None
    except (socket.timeout, TimeoutError):
        raise _address_error(f"{host}:{port} did not answer within {timeout_s:g} s (backend.connect_timeout_s); is "
                             f"the head node up and reachable from here? {_ADDRESS_FIX}") from None
    except OSError as e:
        raise _address_error(f"no Ray cluster at {host}:{port} ({e.strerror or e}); {_ADDRESS_FIX}") from None
    if client:
        sock.close()
        return
    try:  # Ray's GCS is a gRPC server: it answers an HTTP/2 client preface with a SETTINGS frame
        sock.settimeout(timeout_s)
        sock.sendall(_HTTP2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        head = b""
    finally:
        sock.close()
    if len(head) < 9 or head[3] != 0x04:
        raise _address_error(f"{host}:{port} accepts connections but is not a Ray cluster's GCS (no answer as one "
                             f"within {timeout_s:g} s, backend.connect_timeout_s); {_ADDRESS_FIX}")
    try:  # a driver joins through a raylet on its own machine: with none here, ray.init could only time out
        from ray._private.services import find_node_ids

        local = find_node_ids()
    except Exception:
        local = None
    if local is not None and not local:
        raise _address_error(f"{host}:{port} answers as a Ray head, but no Ray node runs on this machine, and a driver "
                             f"joins a cluster through a node of its own machine: join it first with 'ray start "
                             f"--address={host}:{port}', or reach it through Ray Client (backend.address: "
                             f"ray://{host}:10001)")


def preflight_resources(cfg) -> None:
    """Before starting anything: for a local cluster Ray would start with, check what this machine has; for an
    existing cluster (backend.address), that it answers."""
    if cfg.backend.address:  # checked even when this process already holds a Ray session
        check_address(cfg.backend.address, cfg.backend.connect_timeout_s)
        return  # resources are checked against the live cluster in RayBackend.start
    if ray.is_initialized():  # this process's session (a notebook, a loop over runs): its cluster's resources
        res = ray.cluster_resources()
        check_resources(cfg, float(res.get("CPU", 0)), float(res.get("GPU", 0)), "the Ray cluster",
                        float(res.get("memory", 0)))
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_resources(cfg, float(os.cpu_count() or 1), float(gpus), "this machine", _machine_memory())


class RayBackend(Backend):
    name = "ray"

    def __init__(self, spec, fed_data):
        self.spec, self.fed_data = spec, fed_data
        self._own_session = False
        self._watchdog = None
        self._state_dir = None
        self.actor_failures: list[dict] = []  # every client actor death seen (round, step, actor, action)

    def start(self) -> None:
        cfg = self.spec.cfg
        b = cfg.backend
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                          runtime_env=code_runtime_env(b.address))
            if b.address:
                check_address(b.address, b.connect_timeout_s)
                try:
                    ray.init(address=b.address, **kwargs)
                except Exception as e:  # reached, but the driver cannot join (e.g. the head announces another address)
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                    raise _address_error(f"reached {b.address} but could not join the Ray cluster there "
                                         f"({type(e).__name__}: {first}); {_ADDRESS_FIX}") from None
            else:
                ray.init(address="local", dashboard_host="127.0.0.1", **kwargs)  # never exposed beyond loopback unless configured
                self._watchdog = ray_watchdog.start()  # the local cluster exits with this driver, even on kill -9
            self._own_session = True
        ray_serialization.register()  # tensors through the object store as raw bytes (bit-identical, ~15x faster)
        res = ray.cluster_resources()
        check_resources(cfg, float(res.get("CPU", 0)), float(res.get("GPU", 0)), "the Ray cluster",
                        float(res.get("memory", 0)))
        check_node_resources(cfg, ray.nodes())

        self.spec, self._state_dir = run_state_dir(self.spec)
        n = min(b.num_actors, cfg.data.num_clients)
        self.assignment = {cid: cid % n for cid in range(len(self.fed_data.clients))}
        on_actors = b.data == "actors" or (b.data == "auto" and bool(b.address))
        # clients as index ranges into shared pools (LazyClients): the pools go to the object store once, each actor
        # gets its client ids (no per-client objects shipped)
        self._lazy = isinstance(self.fed_data.clients, LazyClients) and not on_actors
        self._source_ref = ray.put(self.fed_data.clients.source) if self._lazy else None
        self._on_actors = on_actors
        groups = [self._group(a) for a in range(n)]
        self._spec_ref = ray.put(self.spec)
        self._group_refs = [ray.put(g) for g in groups]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # the server actor holds the server state alone: keep it on the head node (where the GCS lives, the last
        # node to go), else the driver's (soft: elsewhere if it must)
        heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
        here = NodeAffinitySchedulingStrategy(heads[0] if heads else ray.get_runtime_context().get_node_id(), soft=False)
        renv = actor_runtime_env(self.spec, b.address)
        extra = {"runtime_env": renv} if renv else {}
        self.shipped = list(self.spec.code) + ([os.getcwd()] if b.code == "working_dir" else [])
        Server = ray.remote(_ServerActor).options(num_cpus=b.server_num_cpus, num_gpus=b.server_num_gpus,
                                                  max_concurrency=1, scheduling_strategy=here, **extra)
        self._Client = ray.remote(_ClientActor).options(num_cpus=b.num_cpus, num_gpus=b.num_gpus,
                                                        scheduling_strategy="SPREAD" if b.placement == "spread" else "DEFAULT",
                                                        **extra)
        self._warm_keys = None
        if _WARM["on"] and not self._own_session and not b.address:
            self._warm_keys = (("client", b.num_cpus, b.num_gpus, b.placement, repr(renv)),
                               ("server", b.server_num_cpus, b.server_num_gpus, repr(renv)))
        self.server, self.actors = self._start_actors(Server, ray.put(self.fed_data.global_test),
                                                      ray.put(server_data(self.spec, self.fed_data)))
        self._last_commit: list = [None] * n  # per actor: (client ids, token) of the last commit issued
        self._unsent: list = [[] for _ in range(n)]  # per actor: commits not sent yet (they ride on its next step call)
        self._unconfirmed: list = [[] for _ in range(n)]  # per actor: commits issued since its last call that returned
        self.cost = self._cost_model() if b.balance == "cost" and n > 1 else None
        self._warm: set = set()  # (actor, step name) pairs that have run once
        self.balance_log: list[dict] = []  # per balanced step: predicted/measured per-actor loads, moves
        ray.get([a.ready.remote() for a in self.actors] + [self.server.ready.remote()])

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
            ck, sk = self._warm_keys
            warm_clients, warm_server = _take_warm("client", ck, n), _take_warm("server", sk, 1)
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
                clients[k] = self._Client.remote(self._spec_ref, self._group_refs[k], f"actor{k}", self._source_ref)
        return server, clients

    # -- cost-aware placement (backend.balance: cost) ---------------------------------------------------------------
    def _cost_model(self):
        from raysim.models import arch_key
        from raysim.engine.placement import CostModel

        task = self.spec.task
        keys = [arch_key(a) for a in task.archs]
        index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        params = {}
        for cid, k in enumerate(keys):
            if index[k] not in params:
                params[index[k]] = sum(p.numel() for p in task.build_model(cid).parameters())
        samples = dict(enumerate(client_sizes(self.fed_data.clients, "train")))
        return CostModel(samples, {cid: index[k] for cid, k in enumerate(keys)}, params)

    def _rebalance(self, step, client_ids, where: str) -> None:
        """Place a training step's clients by predicted cost; move the clients whose actor changes (their data and
        committed state go actor to actor through the object store; the old actor forgets them only once the new
        one holds them, so a move interrupted by an actor's death loses nothing)."""
        from raysim.engine.placement import moves, plan

        costs = {c: self.cost.predict(step.name, c) for c in client_ids}
        new = plan(costs, self.assignment, len(self.actors))
        todo = moves(self.assignment, new)
        if todo:
            self._flush_commits()  # a moving client leaves with its committed state
            by_src: dict[int, list[int]] = {}
            for c, (a, _) in todo.items():
                by_src.setdefault(a, []).append(c)
            exports = {a: self.actors[a].export_clients.remote(sorted(cs)) for a, cs in by_src.items()}
            by_dst: dict[int, list[int]] = {}
            for c, (a, b) in todo.items():
                by_dst.setdefault(b, []).append(a)
            adopted = {b: self.actors[b].adopt_clients.remote(*[exports[a] for a in sorted(set(srcs))])
                       for b, srcs in by_dst.items()}
            try:
                ray.get(list(adopted.values()))
            except ray.exceptions.RayError:
                # an actor died mid-move: keep the old layout (every source still holds its clients); the step's
                # call on a dead actor is handled by the failure policy as usual. A destination that survived may
                # hold copies it never uses (they are forgotten below).
                for b, ref in adopted.items():
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError:
                        continue
                    gone = sorted(c for c, (_, d) in todo.items() if d == b)
                    if _alive(self.actors[b]):
                        self.actors[b].forget_clients.remote(gone)
                return
            for a, cs in by_src.items():
                self.actors[a].forget_clients.remote(sorted(cs))
            for c, (_, b) in todo.items():
                self.assignment[c] = b
        self._pending_balance = {"where": where, "predicted": costs, "moves": len(todo)}

    # -- actor failures -------------------------------------------------------------------------------------------
    def _replace_actor(self, k: int) -> None:
        """A new actor for group k: same clients, states from the durable store; the last commit is replayed
        (idempotent: it renames the staged files the dead actor may not have committed)."""
        try:
            ray.kill(self.actors[k], no_restart=True)
        except Exception:
            pass
        if self.cost is not None:  # clients may have moved since the start: the group as it is now
            self._group_refs[k] = ray.put(self._group(k))
        self.actors[k] = self._Client.remote(self._spec_ref, self._group_refs[k], f"actor{k}", self._source_ref)
        # the commits the dead actor may not have carried out, in order (else the last one issued); replaying one it
        # did carry out is harmless (a commit renames the staged file when it is still there)
        replay = self._unconfirmed[k] or ([self._last_commit[k]] if self._last_commit[k] is not None else [])
        self._unsent[k], self._unconfirmed[k] = [], []
        for ids, token in replay:
            self.actors[k].commit_and_discard.remote(ids, token)
        ray.get(self.actors[k].ready.remote())

    def _on_actor_death(self, k: int, where: str, error: BaseException, attempt: int) -> str:
        """What to do about client actor k dying during ``where``: 'retry' or 'skip' (or raise for stop)."""
        cfg = self.spec.cfg
        policy = cfg.on_actor_failure
        action = policy if policy != "retry" or attempt < cfg.max_retries else "skip"
        self.actor_failures.append({"where": where, "actor": k, "attempt": attempt + 1, "action": action,
                                    "error": type(error).__name__})
        if action == "stop":
            raise SimulationError(f"client actor {k} died during {where} ({type(error).__name__}); "
                                  f"on_actor_failure: stop")
        self._replace_actor(k)
        return action

    def _call_actors(self, groups, submit, where: str, submitted=None):
        """Submit ``submit(actor, group)`` -> (result_ref, report_ref) for every non-empty group and collect the
        reports; a dead actor is replaced and its call retried (on_actor_failure), or its clients are failed.
        ``submitted(calls)``: called once every first call is submitted, before any report is awaited."""
        calls = {k: submit(self.actors[k], g) for k, g in enumerate(groups) if g}
        if submitted is not None:
            submitted(dict(calls))
        out = {}
        for k in sorted(calls):
            attempt = 0
            while True:
                res_ref, rep_ref = calls[k]
                try:
                    out[k] = (res_ref, ray.get(rep_ref))
                    self._unconfirmed[k] = []  # the actor ran its calls in order: every commit before this one too
                    break
                except ray.exceptions.RayActorError as e:
                    action = self._on_actor_death(k, where, e, attempt)
                    if action == "retry":
                        attempt += 1
                        calls[k] = submit(self.actors[k], groups[k])
                        continue
                    out[k] = (None, None)
                    break
        return out

    def _groups(self, client_ids):
        groups = [[] for _ in self.actors]
        for cid in client_ids:
            groups[self.assignment[cid]].append(cid)
        return groups

    def initial_payload(self, round_idx):
        return self.server.initial_payload.remote(round_idx)  # an ObjectRef: the payload is stored once

    runs_server_step_ahead = True  # client_step(..., then=...) submits the following server step at once

    def client_step(self, step, payload, round_idx, iteration, client_ids, then=None):
        """``then = (server step, failures so far, keep)``: submit that server step right behind the client calls,
        on their upload and report refs (the server actor adds the step's failed reports to the failures), so it
        starts when the last upload exists instead of after a driver round trip; :meth:`server_step` collects it
        (or, when the uploads it was given were lost and replaced, runs the step anew: a task whose arguments
        failed never ran)."""
        where = f"round {round_idx}, step '{step.name}'"
        self._pending_balance = None
        self._ahead = None
        if self.cost is not None and step.mode != "evaluate":
            self._rebalance(step, client_ids, where)
        groups = self._groups(client_ids)

        def submit_server(calls):
            if then is None or not calls:
                return
            nstep, prior, keep = then
            ups = [calls[k][0] for k in sorted(calls)]
            reps = [calls[k][1] for k in sorted(calls)]
            refs = self.server.run_server_step_ahead.options(num_returns=2).remote(
                nstep, round_idx, iteration, prior, len(ups), *ups, *reps, keep=keep)
            self._ahead = ((nstep.name, round_idx, iteration), ups, refs)

        out = self._call_actors(groups, lambda a, g: a.run_client_step.options(num_returns=2).remote(
            step, payload, round_idx, iteration, g, self._take_unsent(a)), where, submit_server)
        upload_refs, reports = [], []
        self._last_client_step = (step, payload, round_idx, iteration, groups)
        self._upload_actor = {}
        for k in sorted(out):
            up, reps = out[k]
            if reps is not None:
                self._upload_actor[up] = k
            if reps is None:  # skipped: the actor's clients failed this step
                reps = [ClientReport(c, round_idx, step.name, ok=False, iteration=iteration,
                                     error="ActorDied: its client actor died (on_actor_failure)") for c in groups[k]]
            else:
                upload_refs.append(up)
            reports += reps
        if self._pending_balance is not None:
            self._log_balance(reports, step.name)
        return upload_refs, sorted(reports, key=lambda r: r.client_id)

    def _log_balance(self, reports, step_name: str) -> None:
        from raysim.engine.placement import ideal

        n = len(self.actors)
        measured, pred = [0.0] * n, [0.0] * n
        seconds = {}
        for r in reports:
            k = self.assignment[r.client_id]
            if r.ok and r.seconds > 0:
                if (k, step_name) in self._warm:  # an actor's first call of a step also builds models: not observed
                    self.cost.observe(step_name, r.client_id, r.seconds)
                seconds[r.client_id] = r.seconds
            measured[k] += r.seconds
        self._warm |= {(self.assignment[r.client_id], step_name) for r in reports}
        for c, w in self._pending_balance["predicted"].items():
            pred[self.assignment[c]] += w
        self.balance_log.append({"where": self._pending_balance["where"], "moves": self._pending_balance["moves"],
                                 "predicted_loads": pred, "measured_loads": measured,
                                 "ideal_s": ideal(seconds, n) if seconds else 0.0})

    def commit(self, client_ids, token=None):
        # carried by the actor's next step call (run before the step, in order; no task of its own), or sent by
        # _flush_commits before any other call that reads client states; remembered per actor so that a replacement
        # replays it
        for k, group in enumerate(self._groups(client_ids)):
            self._last_commit[k] = (group, token)
            self._unsent[k].append((group, token))
            self._unconfirmed[k].append((group, token))

    def _take_unsent(self, actor) -> list:
        k = self.actors.index(actor)
        pending, self._unsent[k] = self._unsent[k], []
        return pending

    def _flush_commits(self) -> None:
        """Send every commit not yet carried by a step call (before checkpoints, moves, statistics)."""
        for k, pending in enumerate(self._unsent):
            for group, token in pending:
                self.actors[k].commit_and_discard.remote(group, token)
            pending.clear()

    def server_step(self, step, round_idx, iteration, uploads, failures, keep=None):
        ahead, self._ahead = getattr(self, "_ahead", None), None
        if ahead is not None and ahead[0] == (step.name, round_idx, iteration):
            _, ups, (payload_ref, info_ref) = ahead
            if ups == list(uploads or []):
                try:
                    has_payload, metrics = ray.get(info_ref)
                    return (payload_ref if has_payload else None), metrics
                except ray.exceptions.RayError as e:
                    if not _alive(self.server):
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
            has_payload, metrics = ray.get(info_ref)
        except ray.exceptions.RayError as e:
            if not _alive(self.server):
                raise SimulationError(f"the server actor died in round {round_idx}, step '{step.name}' "
                                      f"({type(e).__name__}); the server state lives only there, so the run stops "
                                      f"(resume from its last checkpoint with --resume)") from None
            uploads = self._redo_lost_uploads(list(uploads or []), e, f"round {round_idx}, step '{step.name}'")
            return self.server_step(step, round_idx, iteration, uploads, failures, keep)
        return (payload_ref if has_payload else None), metrics

    def _redo_lost_uploads(self, uploads: list, error, where: str) -> list:
        """The server could not read some uploads: they lived in the object store of a node (or actor) that is
        gone. Recreate the dead client actors and run their share of the last client step again (their states are
        still the committed ones from before it), then hand the fresh uploads to the server step."""
        step, payload, round_idx, iteration, groups = self._last_client_step
        redo = sorted({k for ref, k in self._upload_actor.items() if ref in uploads and not _alive(self.actors[k])})
        if not redo:
            raise error
        for k in redo:
            old = next(ref for ref, a in self._upload_actor.items() if a == k)
            self._on_actor_death(k, where + " (its uploads were lost)", error, 0)
            up, rep = self.actors[k].run_client_step.options(num_returns=2).remote(step, payload, round_idx, iteration,
                                                                                   groups[k])
            ray.get(rep)  # same reports as before (the retried clients reproduce exactly)
            uploads[uploads.index(old)] = up
            del self._upload_actor[old]
            self._upload_actor[up] = k
        return uploads

    def save_checkpoint(self, directory):
        self._flush_commits()
        files = [f"clients-{k}.pt" for k in range(len(self.actors))]
        server_ref = self.server.save.remote(os.path.join(directory, "server.pt"))
        self._call_actors([[0]] * len(self.actors), lambda a, g: (None, a.save_shard.remote(
            os.path.join(directory, files[self.actors.index(a)]))), "a checkpoint")
        ray.get(server_ref)
        return {"server": "server.pt", "clients": files}

    def load_checkpoint(self, directory, manifest):
        self._flush_commits()
        paths = [os.path.join(directory, f) for f in manifest["clients"]]
        ray.get([self.server.load.remote(os.path.join(directory, manifest["server"]))] +
                [a.load_shards.remote(paths) for a in self.actors])

    def store_stats(self):
        self._flush_commits()
        return ray.get([a.store_stats.remote() for a in self.actors])

    def actor_nodes(self) -> list[str]:
        """The node id each client actor runs on."""
        return ray.get([a.node_id.remote() for a in self.actors])

    def server_node(self) -> str:
        return ray.get(self.server.node_id.remote())

    def shutdown(self) -> None:
        actors = list(getattr(self, "actors", []))
        if getattr(self, "server", None) is not None:
            actors.append(self.server)
        closed = [a.close.remote() for a in actors]
        if closed:
            try:
                ray.wait(closed, num_returns=len(closed), timeout=30)
            except Exception:
                pass
        keys = getattr(self, "_warm_keys", None)
        for a, ref in zip(actors, closed):
            if keys is not None and _WARM["on"] and ray.is_initialized():
                try:
                    ray.get(ref, timeout=0)  # closed cleanly: park it for the next run (keep_actors_warm)
                    _WARM["server" if a is self.server else "client"].append(
                        (keys[1] if a is self.server else keys[0], a))
                    continue
                except Exception:
                    pass
            ray.kill(a)
        if self._state_dir:
            shutil.rmtree(self._state_dir, ignore_errors=True)
        if self._own_session:
            ray.shutdown()
            ray_watchdog.stop(self._watchdog)


class _ClientActor(ClientRunner):
    def __init__(self, spec, clients, name="clients", source=None):
        ray_serialization.register()
        if source is not None:  # client ids into the shared pools
            clients = ClientSet(source, clients)
        elif len(clients) and isinstance(clients[0], int):  # client ids: build their data here, from the config
            from raysim.data.federated import build_federated_data
            from raysim.engine.runners import enter_run

            enter_run(spec)  # the user's registered loaders, the driver's working directory

            fed = build_federated_data(spec.cfg.data, spec.cfg.seed)
            clients = (fed.clients.view(clients) if isinstance(fed.clients, LazyClients)
                       else [fed.clients[i] for i in clients])
        super().__init__(spec, clients, name)

    def reset(self, spec, clients, name="clients", source=None) -> bool:
        """Host another run's clients in this process (keep_actors_warm): as a new actor would."""
        self.__init__(spec, clients, name, source)
        return True

    def close(self) -> None:
        if self.store is not None:
            super().close()
        self.data, self.store = {}, None  # a parked actor holds no client data or states
        self._forget_decoded(list(self._decoded))
        self.models = self.algorithm = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def module_files(self, names) -> dict:
        """Where this actor imported the named modules from (diagnostics: was the user's code shipped?)."""
        import sys

        return {n: getattr(sys.modules.get(n), "__file__", None) for n in names}

    def commit_and_discard(self, client_ids, token=None):
        self.commit(client_ids, token)
        self.discard()

    def run_client_step(self, step, payload, round_idx, iteration, client_ids, pre=()):
        """``pre``: the driver's commits not sent yet (carried by this call, carried out first, in order)."""
        for group, token in pre:
            self.commit_and_discard(group, token)
        return super().run_client_step(step, payload, round_idx, iteration, client_ids)


class _ServerActor(ServerRunner):
    def __init__(self, *args, **kwargs):
        ray_serialization.register()
        super().__init__(*args, **kwargs)

    def reset(self, *args, **kwargs) -> bool:
        """Serve another run (keep_actors_warm): as a new actor would."""
        self.__init__(*args, **kwargs)
        return True

    def close(self) -> None:
        super().close()
        self.state, self.global_test, self.server_data = None, None, None
        self.models = self.algorithm = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run_server_step_ref(self, step, round_idx, iteration, failures, *upload_groups, keep=None):
        payload, metrics = self.run_server_step(step, round_idx, iteration, failures, *upload_groups, keep=keep)
        return payload, (payload is not None, metrics)

    def run_server_step_ahead(self, step, round_idx, iteration, prior_failures, n, *refs, keep=None):
        """The server step submitted right behind a client step: ``refs`` = n upload groups, then the n report
        lists of the same calls; the failures are the driver's list so far plus the failed reports, exactly as the
        driver computes them."""
        failed = {(r.client_id, r.error) for reps in refs[n:] for r in reps if not r.ok}
        failures = sorted(set(map(tuple, prior_failures)) | failed)
        return self.run_server_step_ref(step, round_idx, iteration, failures, *refs[:n], keep=keep)


def _alive(actor) -> bool:
    try:
        ray.get(actor.ready.remote(), timeout=60)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:  # busy, not dead
        return True
