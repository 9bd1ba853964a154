"""Client actor failures on the Ray backend (``on_actor_failure: retry | skip | stop``): every call to the actors
goes through :meth:`ActorRecovery._call_actors`, which replaces a dead actor (same clients, states from the durable
store, the last commits replayed) and retries or skips its call; uploads lost with an actor are made again."""
from __future__ import annotations

import ray

from raysim.backends.ray_actors import alive
from raysim.errors import SimulationError


class StepTimeout(Exception):
    """A client actor's call of a step ran past ``backend.step_timeout_s`` (a stopped or hung process)."""


class ActorRecovery:
    """Mixed into RayBackend (its ``actors``, ``spec``, ``cost``, ``_group``, ``_group_refs``, ``_new_client_actor``,
    commit bookkeeping, ``_last_client_step``, ``_upload_actor``, ``actor_failures``)."""

    def _replace_actor(self, k: int) -> None:
        """A new actor for group k: same clients, states from the durable store; the last commit is replayed
        (idempotent: it renames the staged files the dead actor may not have committed)."""
        try:
            ray.kill(self.actors[k], no_restart=True)
        except Exception:
            pass
        if self.cost is not None:  # clients may have moved since the start: the group as it is now
            self._group_refs[k] = ray.put(self._group(k))
        self.actors[k] = self._new_client_actor(k)
        # the commits the dead actor may not have carried out, in order (else the last one issued); replaying one it
        # did carry out is harmless (a commit renames the staged file when it is still there)
        replay = self._unconfirmed[k] or ([self._last_commit[k]] if self._last_commit[k] is not None else [])
        self._unsent[k], self._unconfirmed[k] = [], []
        for ids, token in replay:
            self.actors[k].commit_and_discard.remote(ids, token)
        ray.get(self.actors[k].ready.remote())

    def _on_actor_death(self, k: int, where: str, error: BaseException, attempt: int) -> str:
        """What to do about client actor k dying during ``where``: 'retry' or 'skip' (or raise for stop). A death
        beyond ``max_retries`` retries is the machine's (a lost node, memory): the run stops with one line (exit 1,
        checkpoints kept) instead of failing the actor's clients silently."""
        s = self.settings
        policy = s.on_actor_failure
        exhausted = policy == "retry" and attempt >= s.max_retries
        action = "stop" if exhausted else policy
        self.actor_failures.append({"where": where, "actor": k, "attempt": attempt + 1, "action": action,
                                    "error": type(error).__name__})
        if exhausted:
            raise SimulationError(f"client actor {k} died during {where} ({_why(error)}) and again after "
                                  f"max_retries={s.max_retries} retries (a lost node or memory?); check the cluster, "
                                  f"raise max_retries, or set on_actor_failure: skip to fail its clients instead")
        if action == "stop":
            raise SimulationError(f"client actor {k} died during {where} ({_why(error)}); "
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
        limit = float(getattr(getattr(self.settings, "backend", None), "step_timeout_s", 0.0) or 0.0)
        for k in sorted(calls):
            attempt = 0
            while True:
                res_ref, rep_ref = calls[k]
                try:
                    out[k] = (res_ref, ray.get(rep_ref, timeout=limit) if limit else ray.get(rep_ref))
                    self._unconfirmed[k] = []  # the actor ran its calls in order: every commit before this one too
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                    if isinstance(e, ray.exceptions.GetTimeoutError):  # stopped or hung: taken for dead (killed when
                        e = StepTimeout(f"its call ran longer than backend.step_timeout_s={limit:g} s")  # replaced)
                    action = self._on_actor_death(k, where, e, attempt)
                    if action == "retry":
                        attempt += 1
                        calls[k] = submit(self.actors[k], groups[k])
                        continue
                    out[k] = (None, None)
                    break
        return out

    def _redo_lost_uploads(self, uploads: list, error, where: str) -> list:
        """The server could not read some uploads: they lived in the object store of a node (or actor) that is
        gone. Recreate the dead client actors and run their share of the last client step again (their states are
        still the committed ones from before it), then hand the fresh uploads to the server step."""
        step, payload, round_idx, iteration, groups, merge = self._last_client_step
        redo = sorted({k for ref, k in self._upload_actor.items() if ref in uploads and not alive(self.actors[k])})
        if not redo:
            raise error
        for k in redo:
            old = next(ref for ref, a in self._upload_actor.items() if a == k)
            self._on_actor_death(k, where + " (its uploads were lost)", error, 0)
            up, rep = self.actors[k].run_client_step.options(num_returns=2).remote(step, payload, round_idx, iteration,
                                                                                   groups[k], (), merge)
            ray.get(rep)  # same reports as before (the retried clients reproduce exactly)
            uploads[uploads.index(old)] = up
            del self._upload_actor[old]
            self._upload_actor[up] = k
        return uploads


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if isinstance(error, StepTimeout) else type(error).__name__
