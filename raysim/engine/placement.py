"""Cost-aware placement of clients on actors (``backend.balance: cost``), Ray-free.

The Ray backend hosts every client on one actor; a step's round time is set by the busiest actor. With a fixed
layout (client i on actor i % n, ``backend.balance: static``) a Dirichlet split or a zoo of model sizes leaves one
actor working long after the others. :class:`CostModel` predicts a client's step time and :func:`plan` assigns the
step's clients to actors with few moves from the current layout (or longest-processing-time-first when that is
clearly better), keeping the current layout when it is already close to the plan (every move ships the client's data
and state from one actor to the other).

Prediction, per step name (training and evaluation cost differently):
* a client measured before: an exponential moving average of its measured step seconds;
* otherwise its training samples x the per-sample seconds measured for its architecture;
* an architecture never measured: samples x its parameter count x the seconds per (sample x parameter) measured over
  every architecture so far (before any measurement: samples x parameters, a relative prior).
So the first round is placed by data size x model size, every later one by what was measured (as Pollen does for
Flower's simulation). Placement only moves work: a client's result never depends on which actor runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class CostModel:
    def __init__(self, samples: dict[int, int], arch: dict[int, int], arch_params: dict[int, int],
                 decay: float = 0.5):
        self.samples = {c: max(1, int(n)) for c, n in samples.items()}
        self.arch = dict(arch)
        self.arch_params = {a: max(1, int(p)) for a, p in arch_params.items()}
        self.decay = decay
        self._client: dict[tuple[str, int], float] = {}  # (step, client) -> EMA seconds
        self._arch_s: dict[tuple[str, int], list[float]] = {}  # (step, arch) -> [seconds, samples]
        self._all_s: dict[str, list[float]] = {}  # step -> [seconds, samples x params]

    def observe(self, step: str, client_id: int, seconds: float) -> None:
        if not seconds > 0:
            return
        key = (step, client_id)
        old = self._client.get(key)
        self._client[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        a, n = self.arch[client_id], self.samples[client_id]
        acc = self._arch_s.setdefault((step, a), [0.0, 0.0])
        acc[0] += seconds
        acc[1] += n
        tot = self._all_s.setdefault(step, [0.0, 0.0])
        tot[0] += seconds
        tot[1] += n * self.arch_params[a]

    def predict(self, step: str, client_id: int) -> float:
        if (step, client_id) in self._client:
            return self._client[(step, client_id)]
        a, n = self.arch[client_id], self.samples[client_id]
        acc = self._arch_s.get((step, a))
        if acc and acc[1] > 0:
            return n * acc[0] / acc[1]
        tot = self._all_s.get(step)
        rate = tot[0] / tot[1] if tot and tot[1] > 0 else 1.0
        return n * self.arch_params[a] * rate


def makespan(costs: dict[int, float], assignment: dict[int, int], n: int) -> float:
    loads = [0.0] * n
    for c, w in costs.items():
        loads[assignment[c]] += w
    return max(loads) if loads else 0.0


def _lpt(costs: dict[int, float], current: dict[int, int], n: int) -> dict[int, int]:
    """Longest processing time first onto the least loaded actor (ties: the client's current actor, then the lowest
    index)."""
    loads = [0.0] * n
    new: dict[int, int] = {}
    for c in sorted(costs, key=lambda c: (-costs[c], c)):
        low = min(loads)
        cands = [k for k in range(n) if loads[k] <= low + 1e-12]
        k = current[c] if current[c] in cands else cands[0]
        new[c] = k
        loads[k] += costs[c]
    return new


def _fewest_moves(costs: dict[int, float], current: dict[int, int], n: int) -> dict[int, int]:
    """From the current layout, move one client at a time from the busiest actor to the least busy one (the client
    whose cost is nearest half their gap) while that lowers the busiest actor's load: few moves, each a real gain."""
    new = {c: current[c] for c in costs}
    loads = [0.0] * n
    for c, w in costs.items():
        loads[new[c]] += w
    for _ in range(len(costs) * n):
        hi = max(range(n), key=lambda k: (loads[k], -k))
        lo = min(range(n), key=lambda k: (loads[k], k))
        gap = loads[hi] - loads[lo]
        cands = [c for c in new if new[c] == hi and 0 < costs[c] < gap]
        if not cands:
            break
        c = min(cands, key=lambda c: (abs(costs[c] - gap / 2), c))
        new[c] = lo
        loads[hi] -= costs[c]
        loads[lo] += costs[c]
    return new


def plan(costs: dict[int, float], current: dict[int, int], n: int, slack: float = 1.05) -> dict[int, int]:
    """Actor for each client of ``costs`` (client -> predicted seconds). Two candidates: a few single moves from the
    current layout (busiest actor to least busy) and longest-processing-time-first (LPT); LPT is taken only when its
    predicted makespan beats the few-moves one by more than ``slack``, and the current layout is kept when its makespan
    is within ``slack`` of the chosen plan's. Every move ships a client's data and state between actors, so noise in
    the measured step times of equal clients must not reshuffle them (LPT alone re-deals every client whose place
    differs from its list-scheduling position). Deterministic for given inputs."""
    if n <= 1 or not costs:
        return {c: current[c] for c in costs}
    few, lpt = _fewest_moves(costs, current, n), _lpt(costs, current, n)
    best = lpt if makespan(costs, few, n) > slack * makespan(costs, lpt, n) else few
    if makespan(costs, current, n) <= slack * makespan(costs, best, n):
        return {c: current[c] for c in costs}
    return best


def ideal(costs: dict[int, float], n: int) -> float:
    """The lower bound of a step's time on n actors: max(total work / n, the largest single client)."""
    return max(sum(costs.values()) / n, max(costs.values(), default=0.0))


def moves(old: dict[int, int], new: dict[int, int]) -> dict[int, tuple[int, int]]:
    """client -> (from actor, to actor) for every client whose actor changes."""
    return {c: (old[c], k) for c, k in new.items() if old[c] != k}


def cost_model(task, fed_data) -> "CostModel":
    """The cost model of a run's clients: training samples, architecture (one index per distinct arch_key) and its
    parameter count (each architecture built once)."""
    from raysim.data.federated import client_sizes
    from raysim.models import arch_key

    keys = [arch_key(a) for a in task.archs]
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    params = {}
    for cid, k in enumerate(keys):
        if index[k] not in params:
            params[index[k]] = sum(p.numel() for p in task.build_model(cid).parameters())
    samples = dict(enumerate(client_sizes(fed_data.clients, "train")))
    return CostModel(samples, {cid: index[k] for cid, k in enumerate(keys)}, params)


# -- actor pools per architecture (backend.model_resources) --------------------------------------------------------
@dataclass
class ActorPool:
    """The actors of one resource shape: those of a ``backend.model_resources`` entry (``arch``: the clients of that
    architecture), or the default ones (``arch`` None: every other client; backend.num_actors x num_cpus/num_gpus)."""

    arch: Optional[str]
    actors: list  # global actor indices
    num_cpus: float
    num_gpus: float
    gpu_memory_mb: float = 0.0


def actor_pools(backend, arch_names: list[str]) -> tuple[list[ActorPool], dict[int, int]]:
    """The run's actor pools and the initial layout (client -> actor): a listed architecture's clients on its own
    pool (min(num_actors, its clients) actors), the rest on the default pool; within a pool the i-th client (by id)
    on its (i mod n)-th actor. Without ``model_resources``: one default pool, client i on actor i mod n (as ever)."""
    listed = {r.arch: r for r in (backend.model_resources or [])}
    by_pool: dict[Optional[str], list[int]] = {}
    for cid, name in enumerate(arch_names):
        by_pool.setdefault(name if name in listed else None, []).append(cid)
    pools, layout, k = [], {}, 0
    for key in [None] + list(listed):
        clients = by_pool.get(key)
        if not clients:
            continue
        r = listed.get(key)
        n = min(r.num_actors if r else backend.num_actors, len(clients))
        pools.append(ActorPool(key, list(range(k, k + n)), r.num_cpus if r else backend.num_cpus,
                               r.num_gpus if r else backend.num_gpus, r.gpu_memory_mb if r else 0.0))
        for i, cid in enumerate(clients):
            layout[cid] = k + i % n
        k += n
    return pools, layout


def plan_pools(costs: dict[int, float], current: dict[int, int], pools: list[ActorPool]) -> dict[int, int]:
    """:func:`plan` within each pool: a client only ever moves between actors of its own pool."""
    out = {}
    for pool in pools:
        local = {a: i for i, a in enumerate(pool.actors)}
        mine = {c: w for c, w in costs.items() if current[c] in local}
        if mine:
            new = plan(mine, {c: local[current[c]] for c in mine}, len(pool.actors))
            out.update({c: pool.actors[i] for c, i in new.items()})
    return out
