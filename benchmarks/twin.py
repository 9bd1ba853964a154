"""Plain-PyTorch twins of benchmarks/gpu.py's workload: the same work raysim does, written the way a researcher writes
it by hand, so raysim's rows have a yardstick measured in the same process (issue "Faster than a hand-written loop on
a GPU"). Nothing of raysim's engine is used here; only its model zoo builds the same network.

* :class:`PlainLoop` — one client after another: the data of every client resident on the device, one live model,
  the global weights copied into it in place per client, ``torch.optim.SGD`` (momentum) for the client's local
  epochs, the sample-weighted sum of the trained weights accumulated on the device (FedAvg); with ``objective=
  "proto"`` the FedProto/FedTGP client instead: CE + lam * MSE(z, P_y) against the global prototypes, the client's
  own weights kept between rounds, per-class embedding sums and counts accumulated after training (eval mode).
* :class:`VmapCohort` — the cohort as one batched computation: the clients' parameters stacked, one
  ``torch.func.vmap(grad(loss))`` per local step, momentum SGD on the stacked tensors (foreach ops), the weighted
  average as one reduction.

Both read nothing back to the host inside a round (the loss is never printed), as a careful hand-written loop does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class Work:
    """Every client's data on the device ([clients, n, ...] and [clients, n]) and the local training settings."""

    x: torch.Tensor
    y: torch.Tensor
    batch: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    epochs: int = 1
    num_classes: int = 10

    @property
    def clients(self) -> int:
        return int(self.x.shape[0])

    @property
    def n(self) -> int:
        return int(self.x.shape[1])


def client_tensors(x, y, clients: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``clients * n`` samples as ``clients`` contiguous clients of ``n`` (numpy or torch in)."""
    x = torch.as_tensor(x[:clients * n]).to(device, torch.float32)
    y = torch.as_tensor(y[:clients * n]).to(device, torch.int64)
    return x.reshape(clients, n, *x.shape[1:]), y.reshape(clients, n)


class PlainLoop:
    """The hand-written per-client loop (module docstring). ``round(ids)`` trains the clients ``ids`` one after
    another and aggregates."""

    def __init__(self, model: torch.nn.Module, work: Work, objective: str = "ce", lam: float = 1.0, seed: int = 0):
        """``objective``: ``ce`` (FedAvg), ``prox`` (FedProx: + lam/2 ||w - w_g||^2, lam is mu) or ``proto``
        (FedProto / FedTGP clients: + lam MSE(z, P_y))."""
        self.model, self.work, self.objective, self.lam = model, work, objective, lam
        dev = work.x.device
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(seed)
        self.sd = model.state_dict()  # aliases the live model's tensors: copied into in place
        self.glob = {k: v.detach().clone() for k, v in self.sd.items()}
        self.own: dict[int, dict] = {}  # proto: each client's own weights between rounds
        d = getattr(model, "embed_dim", 1)
        self.protos = torch.zeros(work.num_classes, d, device=dev)  # proto: global prototypes (zero: none yet)
        self.has_protos = False

    def _loss(self, xb, yb):
        if self.objective == "ce":
            return F.cross_entropy(self.model(xb), yb)
        if self.objective == "prox":
            prox = sum(((p - self.glob[n]) ** 2).sum() for n, p in self.model.named_parameters())
            return F.cross_entropy(self.model(xb), yb) + 0.5 * self.lam * prox
        logits, z = self.model(xb, return_embedding=True)
        loss = F.cross_entropy(logits, yb)
        if self.has_protos:
            loss = loss + self.lam * F.mse_loss(z, self.protos[yb])
        return loss

    def _train(self, c: int) -> None:
        w = self.work
        x, y = w.x[c], w.y[c]
        self.model.train()
        opt = torch.optim.SGD(self.model.parameters(), lr=w.lr, momentum=w.momentum)
        for _ in range(w.epochs):
            perm = torch.randperm(w.n, device=x.device, generator=self.gen)
            for s in range(0, w.n, w.batch):
                idx = perm[s:s + w.batch]
                opt.zero_grad(set_to_none=True)
                self._loss(x[idx], y[idx]).backward()
                opt.step()

    @torch.no_grad()
    def _load(self, state: dict) -> None:
        for k, v in self.sd.items():
            v.copy_(state[k])

    def round(self, ids: list[int]) -> None:
        if self.objective in ("ce", "prox"):
            self._fedavg_round(ids)
        else:
            self._proto_round(ids)

    def _fedavg_round(self, ids: list[int]) -> None:
        acc = {k: torch.zeros_like(v) for k, v in self.glob.items() if v.is_floating_point()}
        for c in ids:
            self._load(self.glob)
            self._train(c)
            with torch.no_grad():
                for k, a in acc.items():
                    a.add_(self.sd[k], alpha=self.work.n)
        total = self.work.n * len(ids)
        with torch.no_grad():
            for k, a in acc.items():
                self.glob[k] = a.div_(total)

    def _proto_round(self, ids: list[int]) -> None:
        w = self.work
        d = self.protos.shape[1]
        sums = torch.zeros(w.num_classes, d, device=w.x.device)
        counts = torch.zeros(w.num_classes, device=w.x.device)
        for c in ids:
            self._load(self.own.get(c, self.glob))
            self._train(c)
            with torch.no_grad():
                self.own.setdefault(c, {k: torch.empty_like(v) for k, v in self.sd.items()})
                for k, v in self.sd.items():
                    self.own[c][k].copy_(v)
                self.model.eval()
                _, z = self.model(w.x[c], return_embedding=True)
                sums.index_add_(0, w.y[c], z)
                counts.index_add_(0, w.y[c], torch.ones_like(w.y[c], dtype=counts.dtype))
        with torch.no_grad():  # FedProto's weighted rule; classes nobody uploaded keep their prototype
            seen = counts > 0
            self.protos = torch.where(seen.unsqueeze(1), sums / counts.clamp_min(1).unsqueeze(1), self.protos)
            self.has_protos = True


class VmapCohort:
    """The cohort as one batched computation (module docstring): FedAvg with momentum SGD, every client in the cohort
    training ``epochs`` epochs of ``n / batch`` steps together."""

    def __init__(self, model: torch.nn.Module, work: Work, seed: int = 0):
        self.model, self.work = model, work
        self.gen = torch.Generator(device=work.x.device)
        self.gen.manual_seed(seed)
        self.names = [n for n, _ in model.named_parameters()]
        self.glob = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.buffers = {n: b for n, b in model.named_buffers()}

        def loss(p, xb, yb):
            return F.cross_entropy(torch.func.functional_call(model, (p, self.buffers), (xb,)), yb)

        self.grad = torch.func.vmap(torch.func.grad(loss))

    def round(self, ids: list[int]) -> None:
        w, k = self.work, len(ids)
        rows = torch.as_tensor(ids, device=w.x.device)
        x, y = w.x[rows], w.y[rows]
        p = {n: v.unsqueeze(0).repeat(k, *([1] * v.dim())) for n, v in self.glob.items()}
        bufs: Optional[list] = None
        ar = torch.arange(k, device=x.device).unsqueeze(1)
        for _ in range(w.epochs):
            perm = torch.rand(k, w.n, device=x.device, generator=self.gen).argsort(dim=1)
            for s in range(0, w.n, w.batch):
                idx = perm[:, s:s + w.batch]
                g = self.grad(p, x[ar, idx], y[ar, idx])
                grads = [g[n] for n in self.names]
                with torch.no_grad():
                    if bufs is None:
                        bufs = [t.clone() for t in grads]
                    else:
                        torch._foreach_mul_(bufs, w.momentum)
                        torch._foreach_add_(bufs, grads)
                    torch._foreach_add_([p[n] for n in self.names], bufs, alpha=-w.lr)
        with torch.no_grad():  # equal sample counts: the weighted average is the mean
            self.glob = {n: t.mean(dim=0) for n, t in p.items()}
