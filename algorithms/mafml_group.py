"""MAFML's group forms (``backend.vectorize: true``): one MAFML iteration's two client steps for every node a runner
hosts at once, the nodes' models as one grouped network (:mod:`raysim.runner.grouped`: grouped channels-last convolutions,
batched linear layers, Adam over the stacked parameters). The same maths as :meth:`MAFML.local` and
:meth:`MAFML.step_global`, the same generator draws per node, the same states, uploads and metrics; sums ordered
differently, so the numbers agree within the vectorised executor's stated tolerance, not bit for bit.

A group is taken when its nodes share one architecture of standard layers without dropout, draw batches of one
size, hold a local gradient of the model's size (the global step), and ``per_teacher`` is off; otherwise the
functions return None and the runner runs the per-node steps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from algorithms.mutual_ops import project_conflicting, public_shares, random_batch, weighted_kl
import raysim.runner.grouped as grouped
from raysim.algorithm import ClientUpdate
from raysim.layers import Dropout
from raysim.messages import Message


class _Group:
    """The nodes' models stacked: parameters {name: [K, ...]} and their Adam (:class:`raysim.runner.grouped.StackedOptimizer`),
    built from the nodes' states (which stay the source of truth)."""

    def __init__(self, model, names, states, cfg, lr, device):
        self.model, self.names = model, names
        self.params = {n: torch.stack([st["model"][n].to(device) for st in states]) for n in names}
        self.opt = grouped.StackedOptimizer(cfg, self.params, [st["opt"] for st in states], lr)
        self.rows = torch.arange(len(states))

    def forward(self, params, x, training: bool):
        self.model.train(training)
        return grouped.grouped_forward(self.model, params, x, False, iter(()))

    def step(self, grads: dict) -> None:
        self.opt.step(self.params, grads, self.rows, whole=True)

    def flat(self, grads: dict, i: int) -> torch.Tensor:
        return torch.cat([grads[n][i].reshape(-1) for n in self.names])

    def unflat(self, grads: dict, i: int, g: torch.Tensor) -> None:
        off = 0
        for n in self.names:
            t = grads[n][i]
            t.copy_(g[off:off + t.numel()].view_as(t))
            off += t.numel()

    def state(self, i: int, g_loc: torch.Tensor) -> dict:
        return {"model": {n: self.params[n][i].clone() for n in self.names},
                "opt": self.opt.state_of(i, self.names), "g_loc": g_loc}


def _group(alg, states, ctxs, lr) -> Optional[_Group]:
    model = ctxs[0].model()
    if any(ctx.model() is not model for ctx in ctxs[1:]) or not grouped.supported(model):
        return None
    if any(isinstance(m, Dropout) and m.p > 0 for m in model.modules()):
        return None
    names = [n for n, _ in model.named_parameters()]
    if any(set(st["model"]) != set(names) for st in states):
        return None
    return _Group(model, names, states, alg.task.train, lr, ctxs[0].device)


def local(alg, payloads, states, datas, ctxs) -> Optional[list]:
    """:meth:`MAFML.local` for every node of the group: a private Adam step, the local gradient kept, soft labels of a
    batch of the node's own public share."""

    cfg = alg.task.train
    gens = [ctx.generator("batches") for ctx in ctxs]
    idx = [random_batch(d.num_train, cfg.batch_size, g).to(d.y_train.device) for d, g in zip(datas, gens)]
    if len({len(i) for i in idx}) != 1:
        return None
    grp = _group(alg, states, ctxs, cfg.lr)
    if grp is None:
        return None
    k = len(ctxs)
    xb = torch.stack([d.x_train[i] for d, i in zip(datas, idx)])
    yb = torch.stack([d.y_train[i] for d, i in zip(datas, idx)])
    leaves = {n: t.detach().requires_grad_(True) for n, t in grp.params.items()}
    logits = grp.forward(leaves, xb, True)
    c = logits.shape[-1]
    losses = F.cross_entropy(logits.reshape(-1, c), yb.reshape(-1), reduction="none").view(k, -1).mean(1)
    grads = grouped.stacked_grads(losses.sum(), leaves)
    g_locs = [grp.flat(grads, i).detach().clone() for i in range(k)]
    grp.step(grads)
    px, py, own = public_shares(alg.task, ctxs[0])
    size = alg.params.public_batch or cfg.batch_size
    picks = []
    for ctx, g in zip(ctxs, gens):
        mine = own[ctx.client_id]
        picks.append(mine[random_batch(len(mine), size, g).to(mine.device)])
    if len({len(p) for p in picks}) != 1:
        return None
    with torch.no_grad():
        pub = grp.forward(grp.params, torch.stack([px[p] for p in picks]), False)
    out = []
    for i, pick in enumerate(picks):
        probs = F.softmax(pub[i], dim=1)
        acc = (pub[i].argmax(1) == py[pick]).float().mean()
        up = {"soft": Message("soft_labels", {"idx": pick.cpu(), "p": probs.cpu(), "acc": acc.reshape(1).cpu()})}
        out.append(ClientUpdate(grp.state(i, g_locs[i]), up, {"train_loss": float(losses[i].detach()),
                                                               "public_batch_acc": float(acc)}))
    return out


def step_global(alg, payloads, states, datas, ctxs) -> Optional[list]:
    """:meth:`MAFML.step_global` for every node of the group (the summed form, eq. 3-6): the student's KL + CE on its
    teachers' public batches, the conflict projection against the node's local gradient (eq. 7), an Adam step."""

    if alg.params.per_teacher:
        return None
    device = ctxs[0].device
    teachers = [alg.teachers(p, device) for p in payloads]
    if not teachers[0] or len({len(t) for t in teachers}) != 1 or len({len(i) for t in teachers for _, i, _ in t}) != 1:
        return None
    cfg = alg.task.train
    grp = _group(alg, states, ctxs, alg.params.public_lr or cfg.lr)
    if grp is None:
        return None
    size = sum(p.numel() for p in grp.params.values()) // len(ctxs)
    g_locs = [st["g_loc"].to(device) for st in states]
    if any(g.numel() != size for g in g_locs):
        return None
    px, py, _ = public_shares(alg.task, ctxs[0])
    k, b = len(ctxs), len(teachers[0][0][1])
    leaves = {n: t.detach().requires_grad_(True) for n, t in grp.params.items()}
    x = torch.stack([torch.cat([px[idx] for _, idx, _ in t]) for t in teachers])  # [K, T*B, ...]
    logits = grp.forward(leaves, x, True)
    kls, ces = [], []
    for i, t in enumerate(teachers):
        s = [logits[i, j * b:(j + 1) * b] for j in range(len(t))]
        kls.append(weighted_kl(s, [p for _, _, p in t], [a for a, _, _ in t]))
        ces.append(torch.stack([F.cross_entropy(sj, py[idx]) for sj, (_, idx, _) in zip(s, t)]).mean())
    grads = grouped.stacked_grads(sum(kl + ce for kl, ce in zip(kls, ces)), leaves)
    fired = []
    for i in range(k):
        g_pub = grp.flat(grads, i)
        g, hit = project_conflicting(g_pub, g_locs[i]) if alg.params.project else (g_pub, False)
        if hit:
            grp.unflat(grads, i, g)
        fired.append(hit)
    grp.step(grads)
    return [ClientUpdate(grp.state(i, torch.zeros(0)), {},
                         {"projected": float(fired[i]), "train_kl": float(kls[i].detach()),
                          "train_ce_public": float(ces[i].detach())}) for i in range(k)]
