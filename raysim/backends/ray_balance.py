"""Cost-aware placement on the Ray backend (``backend.balance: cost``; the plan itself is Ray-free:
:mod:`raysim.engine.placement`): before a training step the step's clients are placed by predicted cost within their
actor pool, and the clients that change actor move with their data and committed state, actor to actor."""
from __future__ import annotations

import ray

from raysim.backends.ray_actors import alive
from raysim.engine.placement import ideal, moves, plan_pools


class CostBalancing:
    """Mixed into RayBackend (its ``actors``, ``assignment``, ``pools``, ``cost``, ``_flush_commits``, ``_warm``,
    ``balance_log``)."""

    def _rebalance(self, step, client_ids, where: str) -> None:
        """Place a training step's clients by predicted cost; move the clients whose actor changes (their data and
        committed state go actor to actor through the object store; the old actor forgets them only once the new
        one holds them, so a move interrupted by an actor's death loses nothing)."""
        costs = {c: self.cost.predict(step.name, c) for c in client_ids}
        new = plan_pools(costs, self.assignment, self.pools)
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
                    if alive(self.actors[b]):
                        self.actors[b].forget_clients.remote(gone)
                return
            for a, cs in by_src.items():
                self.actors[a].forget_clients.remote(sorted(cs))
            for c, (_, b) in todo.items():
                self.assignment[c] = b
        self._pending_balance = {"where": where, "predicted": costs, "moves": len(todo)}

    def _log_balance(self, reports, step_name: str) -> None:
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
