"""Client actor failures on the Ray backend (``on_actor_failure: retry | skip | stop``): every call to the actors
goes through :meth:`ActorRecovery.call_actors`, which has the backend replace a dead actor (same clients, states from
the durable store, the last commits replayed) and retries or skips its call; uploads lost with an actor are made
again (:meth:`ActorRecovery.redo_lost_uploads`, from the last client step it remembers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import ray

from raysim.backends.ray_actors import alive
from raysim.errors import SimulationError


class StepTimeout(Exception):
    """A client actor's call of a step ran past ``backend.step_timeout_s`` (a stopped or hung process)."""


class ActorHost(Protocol):
    """What recovery needs of the backend: its client actors, by index."""

    actors: list

    def replace_actor(self, k: int) -> None:
        """A fresh actor in place of actor k: same clients, states from the durable store, the commits it may not
        have carried out replayed."""

    def confirmed(self, k: int) -> None:
        """Actor k answered a call: it carried out every commit sent before it (they run in order)."""


@dataclass(frozen=True)
class ClientStepCall:
    """A client step as the backend called it on its actors: what running an actor's share of it again needs."""

    step: Any
    payload: Any
    round_idx: int
    iteration: int
    groups: list  # per actor: the client ids it ran
    merge: Any = None  # the server step its uploads feed as partial aggregates (Follow.merge)


class ActorRecovery:
    """The on_actor_failure policy for the client actors of ``host`` (:class:`ActorHost`), with what it saw:
    ``failures`` (every death and the action taken, the run's ``actor_failures``) and the last client step with the
    actor behind each of its uploads (to make lost ones again)."""

    def __init__(self, host: ActorHost, policy: str, max_retries: int, step_timeout_s: float = 0.0):
        self.host = host
        self.policy, self.max_retries, self.step_timeout_s = policy, int(max_retries), float(step_timeout_s or 0.0)
        self.failures: list[dict] = []  # every client actor death seen (where, actor, attempt, action, error)
        self.last_step: Optional[ClientStepCall] = None
        self.upload_actor: dict = {}  # upload ref of the last client step -> the actor that made it

    def remember(self, call: ClientStepCall, upload_actor: dict) -> None:
        """The client step just run, and which actor made each of its uploads (``upload ref -> actor index``)."""
        self.last_step, self.upload_actor = call, dict(upload_actor)

    def on_death(self, k: int, where: str, error: BaseException, attempt: int) -> str:
        """What to do about client actor k dying during ``where``: 'retry' or 'skip' (or raise for stop). A death
        beyond ``max_retries`` retries is the machine's (a lost node, memory): the run stops with one line (exit 1,
        checkpoints kept) instead of failing the actor's clients silently."""
        exhausted = self.policy == "retry" and attempt >= self.max_retries
        action = "stop" if exhausted else self.policy
        self.failures.append({"where": where, "actor": k, "attempt": attempt + 1, "action": action,
                              "error": type(error).__name__})
        if exhausted:
            raise SimulationError(f"client actor {k} died during {where} ({_why(error)}) and again after "
                                  f"max_retries={self.max_retries} retries (a lost node or memory?); check the "
                                  f"cluster, raise max_retries, or set on_actor_failure: skip to fail its clients "
                                  f"instead")
        if action == "stop":
            raise SimulationError(f"client actor {k} died during {where} ({_why(error)}); "
                                  f"on_actor_failure: stop")
        self.host.replace_actor(k)
        return action

    def call_actors(self, groups: list, submit: Callable, where: str, submitted: Optional[Callable] = None) -> dict:
        """Submit ``submit(actor, group)`` -> (result_ref, report_ref) for every non-empty group and collect the
        reports: {actor index: (result_ref, reports)}; a dead actor is replaced and its call retried
        (on_actor_failure), or its clients are failed ((None, None)). ``submitted(calls)``: called once every first
        call is submitted, before any report is awaited."""
        actors = self.host.actors
        calls = {k: submit(actors[k], g) for k, g in enumerate(groups) if g}
        if submitted is not None:
            submitted(dict(calls))
        out = {}
        limit = self.step_timeout_s
        for k in sorted(calls):
            attempt = 0
            while True:
                res_ref, rep_ref = calls[k]
                try:
                    out[k] = (res_ref, ray.get(rep_ref, timeout=limit) if limit else ray.get(rep_ref))
                    self.host.confirmed(k)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                    if isinstance(e, ray.exceptions.GetTimeoutError):  # stopped or hung: taken for dead (killed when
                        e = StepTimeout(f"its call ran longer than backend.step_timeout_s={limit:g} s")  # replaced)
                    action = self.on_death(k, where, e, attempt)
                    if action == "retry":
                        attempt += 1
                        calls[k] = submit(self.host.actors[k], groups[k])
                        continue
                    out[k] = (None, None)
                    break
        return out

    def redo_lost_uploads(self, uploads: list, error, where: str) -> list:
        """The server could not read some uploads: they lived in the object store of a node (or actor) that is
        gone. Recreate the dead client actors and run their share of the last client step again (their states are
        still the committed ones from before it), then hand the fresh uploads to the server step."""
        last, actors = self.last_step, self.host.actors
        redo = sorted({k for ref, k in self.upload_actor.items() if ref in uploads and not alive(actors[k])})
        if last is None or not redo:
            raise error
        for k in redo:
            old = next(ref for ref, a in self.upload_actor.items() if a == k)
            self.on_death(k, where + " (its uploads were lost)", error, 0)
            up, rep = self.host.actors[k].run_client_step.options(num_returns=2).remote(
                last.step, last.payload, last.round_idx, last.iteration, last.groups[k], (), last.merge)
            ray.get(rep)  # same reports as before (the retried clients reproduce exactly)
            uploads[uploads.index(old)] = up
            del self.upload_actor[old]
            self.upload_actor[up] = k
        return uploads


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if isinstance(error, StepTimeout) else type(error).__name__
