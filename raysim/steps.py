"""Step schedules: how an algorithm describes one round (and an optional setup phase) as an ordered list of steps.

A round is a sequence of

* :class:`ClientStep` — every client of a set (the round's sampled clients, or all clients) runs one algorithm
  method on the *current payload* and its own state: ``fn(payload, state, data, ctx) -> ClientUpdate``. The new
  states are committed once their reports have reached the driver; the uploads become the *current uploads*.
  ``mode="evaluate"``: ``fn(payload, state, data, ctx) -> metrics`` (no upload, no new state);
* :class:`ServerStep` — the server runs ``fn(server_state, uploads, ctx) -> ServerUpdate(state, payload, metrics)``
  on the current uploads (sorted by client id); a returned payload becomes the *current payload* (``None`` keeps
  the previous one). ``mode="evaluate"``: ``fn(server_state, global_test, ctx) -> metrics``;
* :class:`Repeat` — a group of steps run ``times`` times within the round (MAFML's I iterations); ``ctx.iteration``
  counts them. Optimiser state kept in a client's state persists across the repetitions.

The driver walks the schedule; backends only know the two primitives "run a client step for these client ids" and
"run a server step". Every message a step moves is accounted per client, per direction, per payload kind and per
step name. Evaluation is a schedule of the same steps (:data:`EVALUATION`).

A setup schedule starts with the empty payload ``{}``. The round's payload at the start of round ``t`` is
``initial_payload(server_state, t)`` when a run starts or resumes, and otherwise whatever the previous round's server
steps left; so the last server step of a round must leave what ``initial_payload`` would build from the same server
state (the default schedule's ``aggregate`` step ends with ``broadcast``), or at least a payload every client
downloads (``downlink``) as it would that one, which is what makes a resumed run equal an uninterrupted one (MAFML's
relay leaves teachers that only its global step downloads: the next local step downloads nothing either way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

SAMPLED = "sampled"
ALL = "all"


@dataclass(frozen=True)
class ClientStep:
    name: str  # accounting name: rows "up_bytes@<name>" etc.
    fn: Optional[str] = None  # algorithm method; default: ``name``
    clients: str = SAMPLED  # "sampled" (the round's clients) | "all"
    mode: str = "train"  # "train" (new state + upload) | "evaluate" (metrics only)

    @property
    def method(self) -> str:
        return self.fn or self.name

    def __post_init__(self):
        if self.clients not in (SAMPLED, ALL):
            raise ValueError(f"ClientStep {self.name!r}: clients must be 'sampled' or 'all', got {self.clients!r}")
        if self.mode not in ("train", "evaluate"):
            raise ValueError(f"ClientStep {self.name!r}: mode must be 'train' or 'evaluate', got {self.mode!r}")


@dataclass(frozen=True)
class ServerStep:
    name: str
    fn: Optional[str] = None
    mode: str = "train"  # "train" | "evaluate" (fn(server_state, global_test, ctx) -> metrics)
    # an algorithm method ``merge(uploads) -> upload | None`` that combines the uploads of some clients into one
    # upload this step treats as theirs (a partial aggregate: e.g. FedAvg's sample-weighted average with the summed
    # sample count). With ``backend.partial_aggregate`` each client runner sends one merged upload instead of one per
    # client (:func:`raysim.algorithm.upload_merger` says when a merge applies)
    merge: Optional[str] = None

    @property
    def method(self) -> str:
        return self.fn or self.name


@dataclass(frozen=True)
class Repeat:
    times: int
    steps: tuple

    def __post_init__(self):
        if int(self.times) < 1:
            raise ValueError(f"Repeat: times must be >= 1, got {self.times}")


Step = Union[ClientStep, ServerStep]
Schedule = tuple  # of Step | Repeat


def flatten(schedule) -> list[tuple[Step, int]]:
    """(step, iteration) pairs in execution order; steps outside a Repeat have iteration 0."""
    out: list[tuple[Step, int]] = []
    for item in schedule or ():
        if isinstance(item, Repeat):
            for it in range(int(item.times)):
                for sub in item.steps:
                    if isinstance(sub, Repeat):
                        raise ValueError("nested Repeat groups are not supported")
                    out.append((sub, it))
        elif isinstance(item, (ClientStep, ServerStep)):
            out.append((item, 0))
        else:
            raise TypeError(f"a schedule holds ClientStep, ServerStep or Repeat, got {type(item).__name__}")
    return out


def check_schedule(schedule, algorithm, where: str) -> None:
    """Every step names a method the algorithm has; step names are unique within the schedule."""
    names = set()
    for step, it in flatten(schedule):
        if not callable(getattr(algorithm, step.method, None)):
            raise TypeError(f"{type(algorithm).__name__}.{where}: step {step.name!r} calls {step.method!r}, which the "
                            f"algorithm does not define")
        merge = getattr(step, "merge", None)
        if merge is not None and not callable(getattr(algorithm, merge, None)):
            raise TypeError(f"{type(algorithm).__name__}.{where}: step {step.name!r} merges uploads with {merge!r}, "
                            f"which the algorithm does not define")
        if it == 0:
            if (type(step), step.name) in names:
                raise ValueError(f"{type(algorithm).__name__}.{where}: step name {step.name!r} is used twice")
            names.add((type(step), step.name))


# the classic one-exchange round built from the hooks (broadcast, client_update, aggregate)
CLASSIC_ROUND = (ClientStep("update", "client_update"),
                 ServerStep("aggregate", "classic_aggregate", merge="merge_uploads"))
EVALUATION = (ClientStep("evaluate", "evaluate_client", clients=ALL, mode="evaluate"),
              ServerStep("evaluate_server", "evaluate_server", mode="evaluate"))
