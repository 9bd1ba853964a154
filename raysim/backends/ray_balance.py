"""Cost-aware placement on the Ray backend (``backend.balance: cost``; the plan itself is Ray-free:
:mod:`raysim.engine.placement`): before a training step the step's clients are placed by predicted cost within their
actor pool (:meth:`CostBalancing.place`), and the clients that change actor move with their data and committed state,
actor to actor; after it, the measured step times correct the cost model (:meth:`CostBalancing.record`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import ray

from raysim.backends.ray_actors import alive
from raysim.engine.placement import ideal, moves, plan_pools


class BalanceHost(Protocol):
    """What balancing needs of the backend: its client actors, which actor hosts each client (moved clients are
    reassigned in it), and its commits sent before clients move."""

    actors: list
    assignment: dict

    def flush_commits(self) -> None:
        """Send every commit not yet carried by a step call."""


@dataclass(frozen=True)
class Placement:
    """One training step's placement: where it ran, the clients' predicted costs, how many clients moved."""

    where: str
    predicted: dict
    moves: int


class CostBalancing:
    """Cost-aware placement of ``host``'s clients over its actor ``pools`` by ``cost`` (a
    :class:`raysim.engine.placement.CostModel`), with what it learnt: the (actor, step) pairs that have run once
    (their first call also builds models: not a measurement) and ``log``, per placed step, the predicted and measured
    per-actor loads and the moves (``RunResult.timing["balance"]``)."""

    def __init__(self, host: BalanceHost, cost, pools: list):
        self.host, self.cost, self.pools = host, cost, pools
        self.warm: set = set()  # (actor, step name) pairs that have run once
        self.log: list[dict] = []

    def place(self, step, client_ids, where: str) -> Optional[Placement]:
        """Place a training step's clients by predicted cost; move the clients whose actor changes (their data and
        committed state go actor to actor through the object store; the old actor forgets them only once the new
        one holds them, so a move interrupted by an actor's death loses nothing). None when a move failed (the old
        layout stays)."""
        actors, assignment = self.host.actors, self.host.assignment
        costs = {c: self.cost.predict(step.name, c) for c in client_ids}
        new = plan_pools(costs, assignment, self.pools)
        todo = moves(assignment, new)
        if todo:
            self.host.flush_commits()  # a moving client leaves with its committed state
            by_src: dict[int, list[int]] = {}
            for c, (a, _) in todo.items():
                by_src.setdefault(a, []).append(c)
            exports = {a: actors[a].export_clients.remote(sorted(cs)) for a, cs in by_src.items()}
            by_dst: dict[int, list[int]] = {}
            for c, (a, b) in todo.items():
                by_dst.setdefault(b, []).append(a)
            adopted = {b: actors[b].adopt_clients.remote(*[exports[a] for a in sorted(set(srcs))])
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
                    if alive(actors[b]):
                        actors[b].forget_clients.remote(gone)
                return None
            for a, cs in by_src.items():
                actors[a].forget_clients.remote(sorted(cs))
            for c, (_, b) in todo.items():
                assignment[c] = b
        return Placement(where, costs, len(todo))

    def record(self, placement: Placement, reports, step_name: str) -> None:
        """The step's measured times: the cost model learns from the warm actors' ones; the loads go to the log."""
        assignment = self.host.assignment
        n = len(self.host.actors)
        measured, pred = [0.0] * n, [0.0] * n
        seconds = {}
        for r in reports:
            k = assignment[r.client_id]
            if r.ok and r.seconds > 0:
                if (k, step_name) in self.warm:  # an actor's first call of a step also builds models: not observed
                    self.cost.observe(step_name, r.client_id, r.seconds)
                seconds[r.client_id] = r.seconds
            measured[k] += r.seconds
        self.warm |= {(assignment[r.client_id], step_name) for r in reports}
        for c, w in placement.predicted.items():
            pred[assignment[c]] += w
        self.log.append({"where": placement.where, "moves": placement.moves, "predicted_loads": pred,
                         "measured_loads": measured, "ideal_s": ideal(seconds, n) if seconds else 0.0})
