"""Shared maths of the generative methods (SlaugFL, FedGen, VHL), as small pure functions with hand-computed tests
(tests/test_generative.py).

* :func:`dual_calibration_loss` — SlaugFL's device loss (reference §5.5): L_cla + lambda_sep * L_sep;
* :func:`mode_seeking_ratio` / :func:`diversity_loss` — the mode-seeking diversity term of SlaugFL's scenario-2
  generator (§5.4);
* :func:`cosine_distance` / :func:`filter_candidates` — SlaugFL's candidate filter (seed eq. 11);
* :func:`per_class_accuracy` / :func:`select_representatives` — SlaugFL's representative devices (seed Algorithm 2);
* :func:`to_input_space` — map a generator's tanh output (pixels in [-1, 1]) into the task's normalised input space.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from raysim.messages import Message


def frozen(module: torch.nn.Module, weights: dict) -> torch.nn.Module:
    """``module`` with ``weights`` loaded, in eval mode and without gradients: a teacher (FedGen's uploaded heads and
    its clients' generator, SlaugFL's representative models)."""
    module.load_state_dict(weights)
    module.eval()
    module.requires_grad_(False)
    return module


def label_counts_message(data, num_classes: int) -> Message:
    """A client's training-label counts (int64, one per class), as FedGen's clients upload them."""
    return Message("class_counts", {"counts": torch.bincount(data.y_train.cpu(), minlength=num_classes).to(torch.int64)})


def to_input_space(t: torch.Tensor, norm: Optional[tuple]) -> torch.Tensor:
    """tanh output t in [-1, 1] read as pixels p = (t + 1) / 2, normalised as the task's data: (p - mean) / std.
    Without a normalisation (data not from uint8 pixels) the output is used as it is."""
    if norm is None:
        return t
    mean, std = norm
    return ((t + 1.0) / 2.0 - mean) / std


@dataclass(frozen=True)
class DualCalibration:
    """What SlaugFL's dual calibration holds fixed over a client's batches: the number of real classes C, the global
    p-f prototypes and their mask (None before any exist), and the weights lam_syn, lam_sep and temperature beta."""
    num_classes: int
    global_protos: Optional[torch.Tensor]
    proto_mask: Optional[torch.Tensor]
    lam_syn: float
    lam_sep: float
    beta: float


def dual_calibration_loss(logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor,
                          cal: DualCalibration) -> tuple[torch.Tensor, dict]:
    """SlaugFL's dual calibration on a batch of the augmented data (labels 0..C-1 real, C..2C-1 synthetic):

    L_cla = CE(real logits, y) + lam_syn * CE(syn logits, y)   (each the mean over its part of the batch; an empty
            part contributes 0; logits over all 2C outputs, synthetic targets are y + C);
    L_sep = mean over the classes c present in the batch that have a global p-f prototype of
            CE([cos(f_c, Zbar_c') / beta]_{c' with a prototype}, c),  f_c = mean embedding of the batch's samples of
            class c, real and synthetic (synthetic labels mapped back to c);
    L = L_cla + lam_sep * L_sep (L_sep = 0 while there are no global prototypes)."""
    num_classes, global_protos, proto_mask = cal.num_classes, cal.global_protos, cal.proto_mask
    lam_syn, lam_sep, beta = cal.lam_syn, cal.lam_sep, cal.beta
    # written without data-dependent control flow or selection (no host read per step; traceable by vmap): a part or
    # a class that is absent weighs 0, and a mean over nothing is 0
    real = (y < num_classes).to(logits.dtype)
    ce = F.cross_entropy(logits, y, reduction="none")
    ce_real = (ce * real).sum() / real.sum().clamp_min(1.0)
    ce_syn = (ce * (1.0 - real)).sum() / (1.0 - real).sum().clamp_min(1.0)
    l_cla = ce_real + lam_syn * ce_syn
    l_sep = logits.sum() * 0.0
    if global_protos is not None and proto_mask is not None and lam_sep > 0:
        base = torch.where(y < num_classes, y, y - num_classes)
        onehot = (base.unsqueeze(1) == torch.arange(num_classes, device=y.device)).to(z.dtype)  # [B, C]
        counts = onehot.sum(0)
        f = (onehot.t() @ z) / counts.clamp_min(1.0).unsqueeze(1)  # f_c: the batch's mean embedding of class c
        mask = proto_mask.to(z.device)
        # the classes with a prototype as the columns (the others at -1e9: exp underflows to exactly 0, so the
        # softmax is over the prototype classes only), class c's target its own column
        sim = F.cosine_similarity(f.unsqueeze(1), global_protos.to(z.device).unsqueeze(0), dim=2) / beta
        sim = sim.masked_fill(~mask.unsqueeze(0), -1e9)
        per_class = F.cross_entropy(sim, torch.arange(num_classes, device=z.device), reduction="none")
        present = ((counts > 0) & mask).to(z.dtype)
        l_sep = torch.where(present > 0, per_class, 0.0).sum() / present.sum().clamp_min(1.0)
    loss = l_cla + lam_sep * l_sep
    return loss, {"cla": l_cla.detach(), "sep": l_sep.detach()}


def mode_seeking_ratio(g1: torch.Tensor, g2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """l_z = mean|G(z1) - G(z2)| / mean|z1 - z2| (mode-seeking GAN)."""
    return (g1 - g2).abs().mean() / (z1 - z2).abs().mean()


def diversity_loss(gen: torch.Tensor, noise: torch.Tensor, lam: float, eps: float = 1e-5) -> torch.Tensor:
    """lam / (l_z + eps), l_z the mode-seeking ratio between the two halves of the batch (SlaugFL's acgan.py)."""
    h = gen.shape[0] // 2
    if h == 0:
        return gen.sum() * 0.0
    return lam / (mode_seeking_ratio(gen[:h], gen[h:2 * h], noise[:h], noise[h:2 * h]) + eps)


def cosine_distance(feats: torch.Tensor, proto: torch.Tensor) -> torch.Tensor:
    """d_cos = 1 - cos(f, Z) per row of feats."""
    return 1.0 - F.cosine_similarity(feats, proto.unsqueeze(0).expand_as(feats), dim=1)


def filter_candidates(feats: torch.Tensor, proto: torch.Tensor, top_k: int, delta: Optional[float] = None) -> torch.Tensor:
    """Indices of the candidates kept for one class: those with d_cos(f, Z) <= delta (when delta is given), the
    top_k closest of them, in increasing distance (ties: lower index first)."""
    d = cosine_distance(feats, proto)
    order = torch.argsort(d, stable=True)
    if delta is not None:
        order = order[d[order] <= delta]
    return order[:top_k]


def per_class_accuracy(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Top-1 accuracy per class (C,); NaN for a class absent from y."""
    correct = torch.bincount(y[pred == y], minlength=num_classes).to(torch.float64)
    total = torch.bincount(y, minlength=num_classes).to(torch.float64)
    return torch.where(total > 0, correct / total.clamp(min=1), torch.full_like(total, float("nan")))


def select_representatives(acc: torch.Tensor, eligible: torch.Tensor, client_ids: list) -> torch.Tensor:
    """acc (K x C) per-class accuracies of K devices' models on the global test set, eligible (K x C) whether the
    device can supply a class-c prototype (it holds class-c validation data). For each class the eligible device with
    the highest accuracy (ties: the lowest client id, rows are in client-id order); -1 where nobody is eligible.
    Returns client ids (C,)."""
    a = torch.where(eligible, torch.nan_to_num(acc.to(torch.float64), nan=-1.0), torch.full_like(acc, -2.0,
                                                                                                   dtype=torch.float64))
    best = torch.argmax(a, dim=0)  # first maximum: the lowest client id
    ids = torch.as_tensor(client_ids, dtype=torch.int64)[best]
    return torch.where(eligible.any(dim=0), ids, torch.full_like(ids, -1))


def select_prototype_sources(acc: torch.Tensor, eligible: torch.Tensor, client_ids: list, s: int,
                             rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """SlaugFL's S selected local class prototypes (seed 004 §V-C3). ``s`` = C (or 0): every class's representative
    (:func:`select_representatives`). ``s`` < C: ``s`` classes drawn at random among those with a representative keep
    it, the others get -1. C < ``s`` <= 2C: besides the C representatives, ``s`` - C classes drawn at random among
    those with a second eligible device also get that device, the one with the second-highest accuracy (the best one
    excluded). Fewer than ``s`` only when too few classes have a device. Returns (first, second): client ids (C,), -1
    where none.""" 
    c = acc.shape[1]
    first = select_representatives(acc, eligible, client_ids)
    second = torch.full_like(first, -1)
    if s == 0 or s == c:
        return first, second
    ids = torch.as_tensor(client_ids, dtype=torch.int64)
    if s < c:
        keep = torch.zeros(c, dtype=torch.bool)
        keep[_draw(first, s, rng)] = True
        return torch.where(keep, first, torch.full_like(first, -1)), second
    others = eligible & (ids.unsqueeze(1) != first.unsqueeze(0))  # every device but the class's representative
    runner_up = select_representatives(acc, others, client_ids)
    extra = _draw(runner_up, s - c, rng)
    second[extra] = runner_up[extra]
    return first, second


def _draw(source: torch.Tensor, n: int, rng: np.random.Generator) -> torch.Tensor:
    """``n`` classes drawn without replacement among those with a device (``source`` >= 0), all of them when fewer."""
    able = torch.nonzero(source >= 0, as_tuple=False).flatten().numpy()
    picked = rng.choice(able, size=min(n, len(able)), replace=False) if len(able) else able
    return torch.as_tensor(np.sort(picked), dtype=torch.int64)


def mean_class_prototypes(sent: list, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sent``: (classes, prototypes) of each device that sent some. Returns (C x d) the mean prototype of each class
    over the devices that sent one (two with S > C: the seed averages them), zeros elsewhere, and the (C,) mask."""
    total, count = torch.zeros(c, d), torch.zeros(c)
    for classes, protos in sent:
        total[classes] += protos.to(torch.float32)
        count[classes] += 1.0
    mask = count > 0
    return torch.where(mask.unsqueeze(1), total / count.clamp(min=1.0).unsqueeze(1), total), mask
