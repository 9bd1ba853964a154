"""PN-ICFL's maths as pure functions (the seed 001_ce8e72c830799c1d.txt, §3.2-3.4): squared Euclidean distances
to prototypes and the prototypical loss, a user's embedding (per-class means and counts), the E-step (each user to the
nearest cluster centre over the classes both hold) and the M-step (centres from the embeddings the E-step used),
k-means initialisation with k-means++ restarts, episodes (N-way support/query sampling) and their losses, the
seed's Algorithm 2 partition of all local data into B tasks and their losses, the body's
state and batched embedding. :mod:`algorithms.pnicfl` builds the method's steps from them."""
from __future__ import annotations


from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


# -- pure maths (hand examples: tests/test_clustered.py and tests/test_maths.py) ----------------------------------------

def sq_dists(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """||z_j - p_c||^2 for every (j, c): (n x d), (C x d) -> n x C (Snell's squared Euclidean distance)."""
    return ((z.unsqueeze(1) - protos.unsqueeze(0)) ** 2).sum(-1)


def proto_loss(zq: torch.Tensor, yq: torch.Tensor, protos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prototypical-network loss and accuracy: -mean log softmax_c(-||z_q - p_c||^2)[y_q]; ``yq`` indexes ``protos``."""
    logp = F.log_softmax(-sq_dists(zq, protos), dim=1)
    return F.nll_loss(logp, yq), (logp.argmax(1) == yq).float().mean()


def user_embedding(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u (C x d: the mean embedding of each class, zero for absent classes) and the class counts n_c (C, int64)."""
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    u = sums / counts.clamp(min=1).unsqueeze(1).to(z.dtype)
    return u, counts


def cluster_distances(u: torch.Tensor, counts: torch.Tensor, E: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The seed's model distance (eq. 9-10) for users u (N x C x d), counts (N x C) against cluster prototype matrices
    E (K x C x d) with class masks (K x C): d_ik = sum_c w_ikc ||u_i^c - E_k^c||^2 / sum_c w_ikc, with
    w_ikc = n_ic [c in E_k] (the class distribution renormalised over the classes both hold); +inf when none."""
    u, E = u.to(torch.float64), E.to(torch.float64)
    sq = ((u.unsqueeze(1) - E.unsqueeze(0)) ** 2).sum(-1)  # N x K x C
    w = counts.to(torch.float64).unsqueeze(1) * mask.to(torch.float64).unsqueeze(0)  # N x K x C
    tot = w.sum(-1)
    d = (w * sq).sum(-1) / tot.clamp(min=1e-300)
    return torch.where(tot > 0, d, torch.full_like(d, float("inf")))


def e_step(u, counts, E, mask) -> torch.Tensor:
    """s_i = argmin_k d_ik (ties: the lower k)."""
    return cluster_distances(u, counts, E, mask).argmin(dim=1)


def initial_centres(u: torch.Tensor, counts: torch.Tensor, k: int, rng: np.random.Generator,
                    method: str = "random") -> list[int]:
    """Indices (into the rows of u) of the users whose embeddings become E_1..E_k: ``random`` (the seed: k picked
    uniformly without replacement) or ``kmeans++`` (first uniform, then each with probability ~ min_j d(i, j)^2
    under the model distance d, which is itself a weighted squared Euclidean distance, so this is greedier than
    Arthur & Vassilvitskii's D^2 weighting; users at distance 0 or inf of every chosen centre are never / always
    preferred)."""
    n = u.shape[0]
    k = min(k, n)
    if method == "random":
        return sorted(rng.choice(n, size=k, replace=False).tolist())
    chosen = [int(rng.integers(n))]
    masks = counts > 0
    while len(chosen) < k:
        d = cluster_distances(u, counts, u[chosen], masks[chosen]).min(dim=1).values
        finite = torch.isfinite(d)
        d = torch.where(finite, d, torch.full_like(d, float(d[finite].max()) if finite.any() else 1.0))
        p = (d ** 2).numpy()
        p[chosen] = 0.0
        if p.sum() <= 0:  # every other user coincides with a centre: pick uniformly among the rest
            p = np.ones(n)
            p[chosen] = 0.0
        chosen.append(int(rng.choice(n, p=p / p.sum())))
    return sorted(chosen)


KMEANS_ITERS = 20  # the most E/M alternations of one k-means restart


def kmeans_init(u: torch.Tensor, counts: torch.Tensor, k: int, rng: np.random.Generator, method: str,
                restarts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Initial cluster prototypes (E: k x C x d, mask: k x C) from the first round's user embeddings.

    ``restarts == 0``: the embeddings of the k users :func:`initial_centres` picks (the seed, with ``random``).
    ``restarts >= 1``: k-means under the model distance on the server, from ``restarts`` seedings (``method``): each
    seeding is refined by alternating :func:`e_step` and :func:`m_step` (at most ``KMEANS_ITERS`` times, until nothing
    changes), and the solution with the lowest total distance sum_i d_{i s_i} wins (users at +inf of every centre
    count first, then the finite sum; ties: the earlier restart). Also returns the winning seeding's user indices."""
    if restarts == 0:
        picks = initial_centres(u, counts, k, rng, method)
        return u[picks].clone(), counts[picks] > 0, picks
    best = None
    for _ in range(restarts):
        picks = initial_centres(u, counts, k, rng, method)
        E, mask = u[picks].clone(), counts[picks] > 0
        for _ in range(KMEANS_ITERS):
            s = e_step(u, counts, E, mask)
            E2, mask2 = m_step(E, mask, s.tolist(), u, counts)
            if torch.equal(E2, E) and torch.equal(mask2, mask):
                break
            E, mask = E2, mask2
        d = cluster_distances(u, counts, E, mask).min(dim=1).values
        finite = torch.isfinite(d)
        key = (int((~finite).sum()), float(d[finite].sum()))
        if best is None or key < best[0]:
            best = (key, E, mask, picks)
    return best[1], best[2], best[3]


def m_step(E: torch.Tensor, mask: torch.Tensor, assign: list[int], u: torch.Tensor, counts: torch.Tensor):
    """E_k^c = sum_{i: s_i = k} n_ic u_i^c / sum n_ic (eq. 14); classes and clusters nobody brought keep theirs."""
    E, mask = E.clone(), mask.clone()
    a = torch.as_tensor(assign)
    for k in range(E.shape[0]):
        members = torch.nonzero(a == k, as_tuple=False).flatten()
        if len(members) == 0:
            continue
        n = counts[members].to(torch.float64)  # m x C
        num = (n.unsqueeze(-1) * u[members].to(torch.float64)).sum(0)
        den = n.sum(0)
        has = den > 0
        E[k][has] = (num[has] / den[has].unsqueeze(1)).to(E.dtype)
        mask[k] |= has
    return E, mask


def estep_embeddings(round_u: dict, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (u, counts) rows the E-step stored for the users ``ids`` (a user must have been in that E-step)."""
    pos = {int(c): j for j, c in enumerate(round_u["ids"].tolist())}
    missing = [i for i in ids if i not in pos]
    if missing:
        raise RuntimeError(f"pnicfl: users {missing} delivered an update without an embedding in this round's E-step")
    sel = torch.as_tensor([pos[i] for i in ids], dtype=torch.int64)
    return round_u["u"][sel], round_u["counts"][sel]


class Episode(NamedTuple):
    """One episode: its classes, the support indices per class, the query indices per class."""
    classes: list
    support: list
    query: list


def sample_episode(y: torch.Tensor, classes: list[int], n_way: int, n_support: int, n_query: int,
                   rng: np.random.Generator) -> Episode:
    """(episode classes, support indices per class, query indices per class): n_way of ``classes`` at random, then
    n_support + n_query distinct samples of each (with replacement when the class has fewer)."""
    yn = y.cpu().numpy()
    way = rng.choice(len(classes), size=min(n_way, len(classes)), replace=False)
    ep = [classes[j] for j in sorted(way.tolist())]
    sup, qry = [], []
    for c in ep:
        idx = np.flatnonzero(yn == c)
        need = n_support + n_query
        pick = rng.choice(idx, size=need, replace=len(idx) < need)
        sup.append(pick[:n_support])
        qry.append(pick[n_support:])
    return Episode(ep, sup, qry)


def episode_losses(body, x: torch.Tensor, episode: Episode, cluster=None, cluster_mask=None):
    """L_proto of one ``episode`` (classes, support and query indices) and (PN-ICFL+) L_g: queries against the
    cluster prototypes of the episode's classes that have one (None when none has). Returns (L_proto, accuracy, L_g
    or None)."""
    ep, sup, qry = episode
    n_s = len(sup[0])
    idx = np.concatenate([np.concatenate([s, q]) for s, q in zip(sup, qry)])
    z = body(x[torch.as_tensor(idx, device=x.device)])
    per = n_s + len(qry[0])
    z = z.view(len(ep), per, -1)
    protos = z[:, :n_s].mean(1)
    zq = z[:, n_s:].reshape(-1, z.shape[-1])
    yq = torch.arange(len(ep), device=x.device).repeat_interleave(per - n_s)
    loss, acc = proto_loss(zq, yq, protos)
    lg = None
    if cluster is not None:
        have = [j for j, c in enumerate(ep) if bool(cluster_mask[c])]
        if have:
            sel = torch.as_tensor(have, device=x.device)
            zq_g = z[sel, n_s:].reshape(-1, z.shape[-1])
            yq_g = torch.arange(len(have), device=x.device).repeat_interleave(per - n_s)
            lg, _ = proto_loss(zq_g, yq_g, cluster[torch.as_tensor([ep[j] for j in have])].to(z.device))
    return loss, acc, lg


def partition_tasks(y: torch.Tensor, classes: list[int], n_tasks: int, rng: np.random.Generator) -> list[Episode]:
    """The seed's Algorithm 2, line 1: all of D split into ``n_tasks`` (B) disjoint few-shot tasks, each sample in
    exactly one. Each class's indices are shuffled and the classes' shuffled lists, one after the other, are dealt to
    the tasks in turn (sample j of the concatenation to task j mod B), so the tasks differ in size by at most one and
    each holds about 1/B of every class. Within a task, a class's first ceil(m/2) samples are its support, the rest
    its queries (a class with one sample in the task is support only: a prototype among the candidates, no query).
    [INFERRED: the seed states the partition, not how a task is split into support and query.]"""
    yn = y.cpu().numpy()
    order = np.concatenate([rng.permutation(np.flatnonzero(yn == c)) for c in classes])
    task_of = np.arange(len(order)) % n_tasks
    out = []
    for t in range(n_tasks):
        mine = order[task_of == t]
        ep, sup, qry = [], [], []
        for c in classes:
            idx = mine[yn[mine] == c]
            if len(idx):
                k = (len(idx) + 1) // 2
                ep.append(c)
                sup.append(idx[:k])
                qry.append(idx[k:])
        out.append(Episode(ep, sup, qry))
    return out


def task_losses(body, x: torch.Tensor, task: Episode, cluster=None, cluster_mask=None):
    """:func:`episode_losses` for a task whose classes have unequal support and query sizes (a part of
    :func:`partition_tasks`): L_proto over the task's queries against its support prototypes (every class of the task
    a candidate) and (PN-ICFL+) L_g against the cluster prototypes of the task's classes that have one. Returns
    (L_proto, accuracy, L_g or None); None for all three when the task has no query."""
    ep, sup, qry = task
    if sum(len(q) for q in qry) == 0:
        return None, None, None
    idx = np.concatenate([np.concatenate([s, q]) for s, q in zip(sup, qry)])
    z = body(x[torch.as_tensor(idx, device=x.device)])
    starts = np.cumsum([0] + [len(s) + len(q) for s, q in zip(sup, qry)])
    protos = torch.stack([z[a:a + len(s)].mean(0) for a, s in zip(starts, sup)])
    zq_parts = [z[a + len(s):a + len(s) + len(q)] for a, s, q in zip(starts, sup, qry)]
    zq = torch.cat(zq_parts)
    yq = torch.cat([torch.full((len(q),), j, dtype=torch.int64) for j, q in enumerate(qry)]).to(x.device)
    loss, acc = proto_loss(zq, yq, protos)
    lg = None
    if cluster is not None:
        have = [j for j, c in enumerate(ep) if bool(cluster_mask[c])]  # candidates: the task's classes E holds
        if sum(len(qry[j]) for j in have):
            zq_g = torch.cat([zq_parts[j] for j in have])
            yq_g = torch.cat([torch.full((len(qry[j]),), i, dtype=torch.int64) for i, j in enumerate(have)])
            lg, _ = proto_loss(zq_g, yq_g.to(x.device), cluster[torch.as_tensor([ep[j] for j in have])].to(z.device))
    return loss, acc, lg


def body_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.body.state_dict().items()}


@torch.no_grad()
def embed_all(body, x: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    body.eval()
    return torch.cat([body(x[s:s + batch]) for s in range(0, int(x.shape[0]), batch)]) if len(x) else x.new_zeros(0)
