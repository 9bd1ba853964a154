"""Small pure functions holding the maths that several methods share (tested against hand-computed numbers)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch


def weighted_average_states(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """sum_i w_i * state_i / sum_i w_i for floating tensors; integer buffers are taken from the first state."""
    if not states:
        raise ValueError("nothing to average")
    w = torch.as_tensor([float(x) for x in weights], dtype=torch.float64)
    if float(w.sum()) <= 0:
        raise ValueError("weights must sum to a positive number")
    w = w / w.sum()
    out = {}
    for k, v0 in states[0].items():
        if v0.is_floating_point():
            acc = torch.zeros_like(v0, dtype=torch.float64)
            for wi, s in zip(w, states):
                acc += wi * s[k].to(torch.float64)
            out[k] = acc.to(v0.dtype)
        else:
            out[k] = v0.clone()
    return out


def class_prototypes(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class mean embeddings. Returns (classes present, their prototypes |present| x d, counts)."""
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    present = torch.nonzero(counts, as_tuple=False).flatten()
    return present, sums[present] / counts[present].unsqueeze(1).to(z.dtype), counts[present]


def aggregate_prototypes(uploads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_classes: int, dim: int,
                         mode: str = "weighted") -> tuple[torch.Tensor, torch.Tensor]:
    """Global prototypes from (classes, prototypes, counts) uploads.

    ``weighted``: P_c = sum_i n_ic p_ic / sum_i n_ic (FedProto paper); ``mean``: plain mean over the clients holding c
    (FedProto's official code). Returns (prototypes C x d, mask C of classes that have one)."""
    num = torch.zeros(num_classes, dim, dtype=torch.float64)
    den = torch.zeros(num_classes, dtype=torch.float64)
    for classes, protos, counts in uploads:
        w = counts.to(torch.float64) if mode == "weighted" else torch.ones(len(classes), dtype=torch.float64)
        num.index_add_(0, classes.cpu(), protos.detach().cpu().to(torch.float64) * w.unsqueeze(1).cpu())
        den.index_add_(0, classes.cpu(), w.cpu())
    mask = den > 0
    out = torch.zeros(num_classes, dim, dtype=torch.float32)
    out[mask] = (num[mask] / den[mask].unsqueeze(1)).to(torch.float32)
    return out, mask


def nearest_prototype(z: torch.Tensor, protos: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """argmin_c MSE(z, P_c) (mean over the embedding dimension) among candidate classes (bool mask over C)."""
    d = ((z.unsqueeze(1) - protos.unsqueeze(0)) ** 2).mean(dim=2)
    d = d.masked_fill(~candidates.to(z.device).unsqueeze(0), float("inf"))
    return d.argmin(dim=1)


def prototype_regulariser(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FedProto's loss2: nn.MSELoss between z and its class's global prototype, where a sample whose class has no
    global prototype uses z.detach() as target (contributes zero but still counts in the mean over |B| x d)."""
    has = mask.to(z.device)[y]
    target = torch.where(has.unsqueeze(1), protos.to(z.device)[y], z.detach())
    return torch.nn.functional.mse_loss(z, target)


# server.mode: async (raysim/asyncrules.py): the server state moved toward an aggregate
def mix_tensor(old: torch.Tensor, new: torch.Tensor, w: float) -> torch.Tensor:
    """old + w (new - old) for floating tensors; anything else (counts, masks, flags) takes the new value."""
    if not (torch.is_floating_point(old) and torch.is_floating_point(new)) or old.shape != new.shape:
        return new
    if w == 1.0:
        return new.clone()
    return old + (new.to(old.dtype) - old) * w


def rebase_tensor(y: torch.Tensor, base: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """FedBuff's delta against the dispatch version, applied to the current state: ``current + (y - base)`` for
    floating tensors of one shape; anything else (counts, masks, flags) is ``y``."""
    if not (torch.is_floating_point(y) and torch.is_floating_point(base) and torch.is_floating_point(current)) or \
            not (y.shape == base.shape == current.shape):
        return y
    return current.to(y.dtype) + (y - base.to(y.dtype))


def rebase_trees(y: dict, base: dict, current: dict) -> dict:
    """:func:`rebase_tensor` by key over flat dicts of tensors (a state message's tensors against a state dict);
    keys missing from ``base`` or ``current`` keep ``y``'s value."""
    return {k: rebase_tensor(v, base[k], current[k]) if k in base and k in current else v for k, v in y.items()}


def mix_trees(old, new, w: float):
    """:func:`mix_tensor` over a tree of dicts / lists of tensors. Keys only in ``new`` take the new value, keys only
    in ``old`` keep the old one."""
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return mix_tensor(old, new, w)
    if isinstance(new, dict) and isinstance(old, dict):
        out = {k: mix_trees(old[k], v, w) if k in old else v for k, v in new.items()}
        out.update({k: v for k, v in old.items() if k not in new})
        return out
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(new) == len(old):
        return type(new)(mix_trees(o, n, w) for o, n in zip(old, new))
    return new
