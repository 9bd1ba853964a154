"""What a Ray run checks before it starts anything: the resources the actors ask for against the cluster's (CPUs,
GPUs, memory for the client-state store, per node), the cluster address (reachable, a Ray head, joinable), and the
runtime environment that ships raysim's code (and the user's) to the workers."""
from __future__ import annotations

import math
import os
import shutil

import ray

from raysim.errors import ConfigError


def gpu_capacity(per_actor: float, gpus: float) -> int:
    if per_actor <= 0:
        return 10**9
    if per_actor <= 1:
        return int(math.floor(gpus + 1e-9)) * int(math.floor(1 / per_actor + 1e-9)) + (
            int(math.floor((gpus % 1) / per_actor + 1e-9)) if gpus % 1 else 0)
    return int(math.floor(gpus / per_actor + 1e-9))


def check_node_resources(s, nodes: list[dict]) -> None:
    """Per node: an actor must fit on at least one alive node (a cluster of small nodes cannot host a big actor)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if not alive:
        return
    for key, _, c, g in actor_shapes(s):
        if not any(r.get("CPU", 0) + 1e-9 >= c and r.get("GPU", 0) + 1e-9 >= g for r in alive):
            biggest = max(alive, key=lambda r: r.get("CPU", 0))
            raise ConfigError("backend.num_cpus" if key == "backend.num_actors" else key + ".num_cpus",
                              f"a client actor asks for {c:g} CPU / {g:g} GPU, but no node of the Ray cluster has that "
                              f"much (largest: {biggest.get('CPU', 0):g} CPU, {biggest.get('GPU', 0):g} GPU)")


def node_numerics_refusal(mode: str, reports: list) -> str | None:
    """Why ``mode`` cannot run on the nodes described by ``reports`` ((host, CPU model, has AVX2 and FMA) per node),
    or None: portable numerics needs AVX2 and FMA on every node (raysim/numerics.py)."""
    if mode != "portable":
        return None
    lacking = [f"{host} ({model})" for host, model, ok in reports if not ok]
    if not lacking:
        return None
    return (f"portable needs a CPU with AVX2 and FMA on every node; node {', '.join(lacking)} has none: use "
            f"backend.numerics: native (the table then depends on the CPU), or leave that node out of the cluster")


def check_node_numerics(s, nodes: list[dict]) -> None:
    """On a cluster (``backend.address``), before any actor starts: every alive node can run ``backend.numerics``
    (one zero-CPU task per node reads its CPU). A local cluster is this machine, which the driver checked already."""
    if s.backend.numerics != "portable" or not s.backend.address:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysim import numerics

    probe = ray.remote(num_cpus=0)(numerics.node_cpu)  # a torch-free module: the task's worker imports no torch
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes if n.get("Alive")]
    why = node_numerics_refusal("portable", ray.get(refs))
    if why:
        raise ConfigError("backend.numerics", why)


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


def actor_runtime_env(spec, backend) -> dict | None:
    """The client and server actors' runtime environment when the user's code must reach them (``backend.code``,
    paths from :mod:`raysim.config.usercode`): Ray ``py_modules`` (or ``working_dir``), uploaded once per content hash
    and unpacked on every node. An actor's ``py_modules`` replace the job's, so raysim's own packages are listed
    again on a ``backend.address`` cluster."""
    code, address = backend.code, backend.address  # the backend config section
    if code != "working_dir" and not spec.code:
        return None
    own = code_runtime_env(address).get("py_modules", [])
    if code == "working_dir":
        env = {"working_dir": os.getcwd()}
        if own:
            env["py_modules"] = own
    else:
        env = {"py_modules": own + list(spec.code)}
    return upload_working_dir(env)


def upload_working_dir(env: dict) -> dict:
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


def shipped_uris(renv: dict | None, n_user: int, working_dir: bool) -> list[str]:
    """The package URIs of the user's code in an actor runtime_env (:func:`actor_runtime_env`): the last ``n_user``
    ``py_modules`` (raysim's own come first) and the ``working_dir``."""
    if not renv:
        return []
    mods = list(renv.get("py_modules") or [])
    uris = mods[len(mods) - n_user:] if n_user else []
    if working_dir and renv.get("working_dir"):
        uris.append(renv["working_dir"])
    return [u for u in uris if isinstance(u, str) and "://" in u]


def session_dir() -> str | None:
    """The driver's Ray session directory (``/tmp/ray/session_...``), or None when Ray does not say."""
    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:  # a private API: a Ray version without it leaves the copy, as before
        return None


def remove_unpacked(session: str | None, uris: list[str]) -> list[str]:
    """Remove the unpacked copies (and downloaded archives) of ``uris`` that Ray left in a local session's
    ``runtime_resources`` (``py_modules_files/_ray_pkg_<hash>``, ``working_dir_files/...``); returns what it removed.
    Only names of Ray's own package form (``_ray_pkg_*``) directly in those two directories are touched."""
    from pathlib import Path

    if not session or not uris:
        return []
    removed = []
    for uri in uris:
        pkg = uri.split("://", 1)[1].rsplit("/", 1)[-1]
        stem = pkg[:-4] if pkg.endswith(".zip") else pkg
        if not stem.startswith("_ray_pkg_") or "/" in stem or stem in ("", ".", ".."):
            continue
        for sub in ("py_modules_files", "working_dir_files"):
            base = Path(session) / "runtime_resources" / sub
            for p in (base / stem, base / pkg):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists() or p.is_symlink():
                    p.unlink(missing_ok=True)
                else:
                    continue
                removed.append(str(p))
    return removed


def machine_memory() -> float:
    """Bytes of memory this machine has available (0 when unknown)."""
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0.0


ACTOR_MEMORY_FLOOR_MB = 250  # the least a client actor process takes: Python, torch and raysim imported, before any
#                              model or data (~250 MB resident each measured; 12 actors of a FedProto run took 9.2 GB)


def check_actor_memory(key: str, actors: int, memory: float, where: str) -> None:
    """Refuse ``actors`` client actors whose processes alone (``ACTOR_MEMORY_FLOOR_MB`` each) exceed ``memory`` bytes
    (0: unknown, not checked), naming ``key``: Ray would start them and the machine would swap or kill them."""
    need = actors * ACTOR_MEMORY_FLOOR_MB * 2**20
    if memory > 0 and need > memory:
        fit = int(memory // (ACTOR_MEMORY_FLOOR_MB * 2**20))
        raise ConfigError(key, f"{actors} client actors x at least {ACTOR_MEMORY_FLOOR_MB} MB each (a Python process "
                               f"with torch) = {need / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB {where} "
                               f"has; use at most {fit} actors (each hosts many clients)")


def check_resources(s, cpus: float, gpus: float, where: str, memory: float = 0.0) -> None:
    """Fail fast where Ray would leave actors pending forever, where the client actors' processes
    (:func:`check_actor_memory`) or their in-memory state stores (backend.state_memory_mb each) cannot fit in
    ``memory`` bytes (0: unknown, not checked)."""
    b = s.backend
    if b.model_resources:
        return _check_pools(s, cpus, gpus, where, memory)
    n = min(b.num_actors, s.num_clients)
    check_actor_memory("backend.num_actors", n, memory, where)
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
        if need_gpu_actors > gpu_capacity(b.num_gpus, gpus) or (
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


def actor_shapes(s) -> list[tuple[str, int, float, float]]:
    """(config key, actors at most, CPUs, GPUs) of each kind of client actor: the default actors when some
    architecture of the run is not in ``backend.model_resources``, then one per entry."""
    b, n = s.backend, s.num_clients
    archs = set(s.archs)
    listed = list(b.model_resources or [])
    shapes = []
    if not listed or archs - {r.arch for r in listed}:
        shapes.append(("backend.num_actors", min(b.num_actors, n), b.num_cpus, b.num_gpus))
    shapes += [(f"backend.model_resources[{i}]", min(r.num_actors, n), r.num_cpus, r.num_gpus)
               for i, r in enumerate(listed)]
    return shapes


def _check_pools(s, cpus: float, gpus: float, where: str, memory: float) -> None:
    """check_resources with per-architecture actor pools: every pool's actors (and the server) must fit at once —
    GPU fractions packed first-fit-decreasing onto whole GPUs, as Ray places them."""
    b = s.backend
    shapes = actor_shapes(s)
    actors = sum(k for _, k, _, _ in shapes)
    biggest = max(shapes, key=lambda t: t[1])[0]
    check_actor_memory(biggest if biggest == "backend.num_actors" else biggest + ".num_actors", actors, memory, where)
    if memory > 0 and actors * b.state_memory_mb * 2**20 > memory:
        raise ConfigError("backend.state_memory_mb", f"{actors} client actors x {b.state_memory_mb} MB of in-memory "
                                                     f"client states exceed the {memory / 2**30:.1f} GiB {where} has")
    items = sorted([(g, key) for key, k, _, g in shapes for _ in range(k) if g > 0]
                   + ([(b.server_num_gpus, "backend.server_num_gpus")] if b.server_num_gpus > 0 else []), reverse=True)
    if items and gpus <= 0:
        raise ConfigError(items[0][1] + ("" if items[0][1].endswith("gpus") else ".num_gpus"),
                          f"asks for GPUs but {where} has none (torch.cuda.is_available() is False and no GPUs are "
                          f"declared to Ray)")
    free = [1.0] * int(math.floor(gpus + 1e-9)) + ([gpus % 1] if gpus % 1 > 1e-9 else [])
    for g, key in items:
        if g > 1:  # whole GPUs
            whole = [i for i, f in enumerate(free) if f >= 1 - 1e-9][:int(g)]
            if len(whole) < g:
                raise ConfigError(key if key.endswith("gpus") else key + ".num_gpus",
                                  f"{sum(g for g, _ in items):g} GPUs asked in all (actors of every pool + server) do "
                                  f"not fit on the {gpus:g} GPU(s) of {where}")
            for i in whole:
                free[i] = 0.0
            continue
        slot = next((i for i, f in enumerate(free) if f + 1e-9 >= g), None)
        if slot is None:
            raise ConfigError(key if key.endswith("gpus") else key + ".num_gpus",
                              f"{sum(g for g, _ in items):g} GPUs asked in all (actors of every pool + server) do not "
                              f"fit on the {gpus:g} GPU(s) of {where}")
        free[slot] -= g
    need_cpu = sum(k * c for _, k, c, _ in shapes) + b.server_num_cpus
    if need_cpu > cpus + 1e-9:
        key = max(shapes, key=lambda s: s[1] * s[2])[0]
        raise ConfigError(key if key == "backend.num_actors" else key + ".num_actors",
                          f"the client actors of every pool + the server ask for {need_cpu:g} CPUs, but {where} has "
                          f"{cpus:g}; lower num_actors or num_cpus (fractions allowed)")


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
ADDRESS_FIX = ("use the address that 'ray start --head' printed on the head node (the --address=HOST:PORT of its "
                "'ray start' line), or leave backend.address out to start a local cluster")


def address_error(message: str) -> ConfigError:
    return ConfigError("backend.address", message)


def check_address(address: str, timeout_s: float) -> None:
    """Fail within ``timeout_s`` (one ConfigError naming backend.address) unless ``address`` reaches a running Ray
    cluster: the host resolves, the port accepts a connection, and what listens there answers as Ray's GCS does
    (gRPC over HTTP/2). ``auto`` must find a cluster started on this machine; ``ray://`` (Ray Client) is checked up
    to the connection."""
    addr = str(address).strip()
    if addr == "auto":
        addr = _local_cluster_address()
    client = addr.startswith("ray://")
    host, port = _host_port(address, addr[len("ray://"):] if client else addr)
    sock = _connect(address, host, port, timeout_s)
    if client:
        sock.close()
        return
    if not _answers_as_gcs(sock, timeout_s):
        raise address_error(f"{host}:{port} accepts connections but is not a Ray cluster's GCS (no answer as one "
                             f"within {timeout_s:g} s, backend.connect_timeout_s); {ADDRESS_FIX}")
    _check_local_node(host, port)


def _local_cluster_address() -> str:
    """``auto``: the address of a cluster started on this machine."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except Exception:
        found = None
    if not found:
        raise address_error(f"'auto' found no Ray cluster started on this machine; start one with 'ray start "
                             f"--head' or {ADDRESS_FIX}")
    return found


def _host_port(address: str, hostport: str) -> tuple[str, int]:
    if "://" in hostport or "/" in hostport:
        raise address_error(f"{address!r} is not HOST:PORT (or ray://HOST:PORT); {ADDRESS_FIX}")
    host, sep, port = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise address_error(f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:6379); {ADDRESS_FIX}")
    return host, int(port)


def _connect(address: str, host: str, port: int, timeout_s: float):
    import socket

    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        raise address_error(f"unknown host {host!r} in {address!r} ({e.strerror or e}); {ADDRESS_FIX}") from None
    except (socket.timeout, TimeoutError):
        raise address_error(f"{host}:{port} did not answer within {timeout_s:g} s (backend.connect_timeout_s); is "
                             f"the head node up and reachable from here? {ADDRESS_FIX}") from None
    except OSError as e:
        raise address_error(f"no Ray cluster at {host}:{port} ({e.strerror or e}); {ADDRESS_FIX}") from None


def _answers_as_gcs(sock, timeout_s: float) -> bool:
    """Ray's GCS is a gRPC server: it answers an HTTP/2 client preface with a SETTINGS frame. Closes ``sock``."""
    head = b""
    try:
        sock.settimeout(timeout_s)
        sock.sendall(HTTP2_PREFACE)
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        head = b""
    finally:
        sock.close()
    return len(head) >= 9 and head[3] == 0x04


def _check_local_node(host: str, port: int) -> None:
    """A driver joins a cluster through a raylet on its own machine: with none here, ray.init could only time out."""
    try:
        from ray._private.services import find_node_ids

        local = find_node_ids()
    except Exception:
        local = None
    if local is not None and not local:
        raise address_error(f"{host}:{port} answers as a Ray head, but no Ray node runs on this machine, and a driver "
                             f"joins a cluster through a node of its own machine: join it first with 'ray start "
                             f"--address={host}:{port}', or reach it through Ray Client (backend.address: "
                             f"ray://{host}:10001)")


def preflight_resources(s) -> None:
    """Before starting anything: for a local cluster Ray would start with, check what this machine has; for an
    existing cluster (backend.address), that it answers."""
    if s.backend.address:  # checked even when this process already holds a Ray session
        check_address(s.backend.address, s.backend.connect_timeout_s)
        return  # resources are checked against the live cluster in RayBackend.start
    if ray.is_initialized():  # this process's session (a notebook, a loop over runs): its cluster's resources
        res = ray.cluster_resources()
        check_resources(s, float(res.get("CPU", 0)), float(res.get("GPU", 0)), "the Ray cluster",
                        float(res.get("memory", 0)))
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_resources(s, float(os.cpu_count() or 1), float(gpus), "this machine", machine_memory())
