"""The backend interface the driver talks to (two generic primitives — run a client step for a set of client ids, run
a server step — plus commit, checkpoint shards, lifecycle and one typed report at the end, :class:`BackendReport`),
and how the driver gets one: by name, from the implementations in ``raysim/backends/`` (which sit above the engine
and import its runners), registered from above (:mod:`raysim.shipped`, :func:`register_backend`) and resolved when
a run starts (:func:`make_backend`, :func:`preflight`), so the driver side of the engine neither imports nor names a
backend module.
Backends hold no algorithm logic. Handles (payloads, uploads) are opaque: in-process objects for the sequential
backend, Ray object references for the Ray backend."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class NextServerStep:
    """The server step that comes right after a client step, with what it will be given besides the step's uploads:
    ``failures`` so far ((client id, reason) pairs; the client step's own failed reports add theirs) and ``keep``
    (the uploads the environment delivered; None: all). Said only when nothing the driver does in between can change
    them, so a backend may start it before the driver asks (the Ray backend does: ``RayBackend.client_step``)."""

    step: Any
    failures: list
    keep: Optional[list] = None


@dataclass(frozen=True)
class Follow:
    """What follows a client step's uploads: ``merge``, the server step they feed, when each client runner is to send
    one partial aggregate (``ClientRunner.run_client_step``); ``server``, the server step that comes next
    (:class:`NextServerStep`), for a backend that can act on it early (others ignore it)."""

    merge: Any = None
    server: Optional[NextServerStep] = None


NO_FOLLOW = Follow()


@dataclass(frozen=True)
class BackendReport:
    """What a backend tells the run about how it ran it (:meth:`Backend.report`, once, at the end); the driver
    records it as it is, in the run's metadata and timing. Every field's default is what an in-process backend has
    to say."""

    processes: list = field(default_factory=list)  # the kernel choice of each computing process other than the
    #                                                driver (Ray: the server and client actors, with their nodes)
    runner_failures: list = field(default_factory=list)  # every client-runner death seen and what was done about it
    transport_bytes: dict = field(default_factory=dict)  # round -> tensor bytes moved between processes, by kind
    placement: list = field(default_factory=list)  # per placed step: predicted and measured loads, moves
    store: list = field(default_factory=list)  # per client runner: its state store's statistics
    fallbacks: list = field(default_factory=list)  # the fallbacks from one executor or form to another the client
    #                                                runners took (raysim.runner.fallbacks), each once


class Backend(ABC):
    name = "base"
    client_runners: int = 1  # how many client runners host the clients (Ray: its client actors); in-process: one

    def start(self) -> None: ...

    @abstractmethod
    def initial_payload(self, round_idx: int) -> Any:
        """The payload round ``round_idx`` starts with, built from the server state (run start, resume, after setup)."""

    @abstractmethod
    def client_step(self, step, payload: Any, round_idx: int, iteration: int, client_ids: list[int],
                    follow: Follow = NO_FOLLOW) -> tuple[Any, list]:
        """Run ``step`` for ``client_ids``; return (handle to their uploads, ClientReports sorted by client id).
        One call per actor per step. New client states stay pending until :meth:`commit`. ``follow``: what the
        uploads feed (:class:`Follow`)."""

    @abstractmethod
    def commit(self, client_ids: list[int], token: Optional[str] = None) -> None:
        """The step's reports reached the driver: commit the new states of ``client_ids``; drop other pending ones."""

    @abstractmethod
    def server_step(self, step, round_idx: int, iteration: int, uploads: Any, failures: list,
                    keep: Optional[list] = None) -> tuple[Optional[Any], dict]:
        """Run a server step on the uploads (only those of ``keep``, when given); return (handle to the new payload
        or None when the step left it unchanged, server metrics)."""

    @abstractmethod
    def save_checkpoint(self, directory: str) -> dict:
        """Write the server state and every client state as shards under ``directory`` (no gathering on the
        driver); return a manifest {"server": file, "clients": [files]}."""

    @abstractmethod
    def load_checkpoint(self, directory: str, manifest: dict) -> None:
        """Restore states from shards written by any number of actors."""

    @abstractmethod
    def save_messages(self, path: str, payloads: dict, uploads: dict) -> None:
        """Write payloads (version -> payload handle) and uploads (batch -> (upload handle, client ids to keep)) as
        one state file at ``path``, by the server runner (``ServerRunner.save_messages``; server.mode: async
        checkpoints: the messages of the clients in flight)."""

    @abstractmethod
    def load_messages(self, path: str) -> tuple[dict, dict]:
        """Read what :meth:`save_messages` wrote back as handles: (version -> payload handle, batch -> upload handle),
        each usable as :meth:`client_step`'s payload and :meth:`server_step`'s uploads."""

    def report(self) -> BackendReport:
        """How the run went on this backend (:class:`BackendReport`), asked once after the last round."""
        return BackendReport()

    def shutdown(self) -> None: ...


def run_state_dir(spec, settings):
    """A fresh directory for this run's state stores, under ``backend.state_dir`` (or the system's temporary
    directory); the backend removes it at shutdown. Returns (spec with state_dir set, the directory)."""
    import dataclasses
    import tempfile

    base = settings.backend.state_dir
    if base:
        os.makedirs(base, exist_ok=True)
    d = tempfile.mkdtemp(prefix=f"raysim-{settings.run_name}-", dir=base or None)
    durable = settings.backend.name == "ray" and settings.on_actor_failure == "retry"
    return dataclasses.replace(spec, state_dir=d, durable=durable), d


# the implementations by name ("module:attribute", imported when a run starts), registered from above: the shipped
# ones by raysim/shipped.py when raysim is imported (the backends sit above the engine; the engine names none of them)
BACKENDS: dict[str, str] = {}
PREFLIGHT: dict[str, str] = {"target": ""}  # the checks before a run starts (every backend's)


def register_backend(name: str, target: str) -> None:
    """Make ``backend.name: <name>`` build ``target`` (``"module:Class"``, called as ``Class(spec, fed_data,
    settings)``)."""
    BACKENDS[name] = target


def register_preflight(target: str) -> None:
    """The checks :func:`preflight` runs (``"module:function"``, called with the run's BackendSettings)."""
    PREFLIGHT["target"] = target


def make_backend(spec, fed_data, settings) -> Backend:
    """The backend ``settings.backend.name`` (settings: raysim.engine.settings.BackendSettings)."""
    from raysim.config.registry import load_target

    name = settings.backend.name
    if name not in BACKENDS:
        raise ValueError(name)
    return load_target(BACKENDS[name])(spec, fed_data, settings)


def preflight(settings) -> None:
    """The checks that must pass before a run starts (``raysim.backends.preflight``: the GPUs a config asks for
    exist, a cluster answers, ...)."""
    from raysim.config.registry import load_target

    load_target(PREFLIGHT["target"])(settings)
