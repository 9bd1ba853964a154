"""Local training and evaluation helpers shared by the methods (tensor slicing, no DataLoader overhead)."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from raysim.config import TrainConfig


def make_optimizer(params, cfg: TrainConfig, lr: Optional[float] = None) -> torch.optim.Optimizer:
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def minibatches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled index batches for one epoch (the last, smaller batch is kept)."""
    perm = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        yield perm[start:start + batch_size]


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, generator: torch.Generator,
                 loss_fn: Callable, optimizer: Optional[torch.optim.Optimizer] = None, epochs: Optional[int] = None) -> dict:
    """Run ``epochs`` of minibatch training with ``loss_fn(model, xb, yb) -> (loss, parts dict)``; returns mean losses."""
    model.train()
    opt = optimizer or make_optimizer(model.parameters(), cfg)
    totals: dict[str, float] = {}
    steps = 0
    idx_device = x.device
    for _ in range(cfg.local_epochs if epochs is None else epochs):
        for idx in minibatches(int(y.shape[0]), cfg.batch_size, generator):
            idx = idx.to(idx_device)
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            loss, parts = loss_fn(model, xb, yb)
            loss.backward()
            opt.step()
            steps += 1
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + float(v)
    return {f"train_{k}": v / max(steps, 1) for k, v in totals.items()}


@torch.no_grad()
def forward_all(model: nn.Module, x: torch.Tensor, batch_size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, embeddings) for all of x in eval mode."""
    model.eval()
    logits, zs = [], []
    for s in range(0, int(x.shape[0]), batch_size):
        lo, z = model(x[s:s + batch_size], return_embedding=True)
        logits.append(lo)
        zs.append(z)
    if not logits:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(logits), torch.cat(zs)


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, number of samples) — the number is the weight of the value in the result table."""
    n = int(y.shape[0])
    return (float((pred == y).sum()) / n if n else float("nan")), float(n)


def clone_state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
