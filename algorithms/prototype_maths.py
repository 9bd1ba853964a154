"""Pure functions holding the maths of the prototype family and its baselines (FedTGP, FedProto-UH, FedPU, FedProx,
FedPer / LG-FedAvg, FeSEM, FedDistill). Each is tested against hand-computed numbers in tests/test_prototype_maths.py.
Formulas and their sources: shared reference ``algorithms.md`` §1.10, §1.11, §2.3, §6."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# FedTGP (Zhang et al., AAAI 2024), reference §2.3


def pairwise_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ||a_i - b_j||_2 (sqrt of the squared distance, as FedTGP's server loss)."""
    diff = a.unsqueeze(1) - b.unsqueeze(0)
    return (diff * diff).sum(-1).clamp_min(0.0).sqrt()


def tgp_margin_distance(centres: torch.Tensor, mask: torch.Tensor, mode: str = "seed") -> float:
    """The distance FedTGP's adaptive margin is capped from, before the cap: over the classes in ``mask`` of Q
    (C x d, the unweighted means of this round's uploaded prototypes),

    ``seed`` (default; seed 002 section 5 "part 2", the same as the paper's slides p.31; ``paper`` is a synonym):
    max_{c != c'} ||Q_c - Q_c'|| -- the largest pairwise distance between class centres;
    ``code`` (official servertgp.py): max_c gap_c with gap_c = min_{c' != c} ||Q_c - Q_c'||.
    Fewer than two classes: no pair, 0."""
    idx = torch.nonzero(mask).flatten()
    if len(idx) < 2:
        return 0.0
    q = centres[idx].to(torch.float64)
    d = pairwise_distances(q, q)
    if mode in ("seed", "paper"):
        return float(d.max())
    if mode == "code":
        d = d + torch.diag(torch.full((len(idx),), float("inf"), dtype=d.dtype))
        return float(d.min(dim=1).values.max())
    raise ValueError(f"unknown margin mode {mode!r}")


def tgp_margin(centres: torch.Tensor, mask: torch.Tensor, tau: float, mode: str = "seed") -> float:
    """FedTGP's adaptive margin delta(t) = min(tgp_margin_distance(centres, mask, mode), tau) (see there): ``seed``
    delta = min(max_{c != c'} ||Q_c - Q_c'||, tau); ``code`` delta = min(max_c min_{c' != c} ||Q_c - Q_c'||, tau).
    Fewer than two classes: no pair, delta = 0."""
    return min(tgp_margin_distance(centres, mask, mode), float(tau))


def tgp_contrastive_loss(feats: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, delta: float) -> torch.Tensor:
    """FedTGP's adaptive-margin contrastive loss, averaged over the uploaded prototypes (rows of ``feats``):

        -log[ exp(-(phi(p, P_y) + delta)) / (exp(-(phi(p, P_y) + delta)) + sum_{c != y} exp(-phi(p, P_c))) ]

    with phi the Euclidean distance; i.e. cross-entropy on the logits -(distance + delta * onehot(y))."""
    dist = pairwise_distances(feats, global_protos)
    # the one-hot of y as a comparison (F.one_hot checks the labels' range: host reads at every server step)
    onehot = (labels.unsqueeze(1) == torch.arange(global_protos.shape[0], device=labels.device)).to(dist.dtype)
    logits = -(dist + delta * onehot)
    return F.cross_entropy(logits, labels)


def prototype_distance_regulariser(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Seed 002's client regulariser (section 5, step 4), E_{c ~ C_i}[phi(P_i^c, P'^c)] with phi the Euclidean
    distance, on a minibatch: P_i^c is the mean embedding of the batch's samples of class c, the expectation the
    plain mean over the classes present in the batch that have a global prototype (``mask``; None: every class has
    one). Classes absent from the batch, or without a global prototype, add nothing; none left: 0. The official
    code's form (``raysim.shared_maths.prototype_regulariser``) is instead nn.MSELoss(z, P_y) per sample, averaged over
    |B| x d. Written without data-dependent branches (one-hot sums, a masked mean), so it runs under vmap."""
    num_classes = protos.shape[0]
    onehot = (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).to(z.dtype)  # B x C
    counts = onehot.sum(0)
    local = (onehot.t() @ z) / counts.clamp_min(1.0).unsqueeze(1)  # P_i^c for the classes in the batch
    present = counts > 0
    if mask is not None:
        present = present & mask.to(z.device)
    diff = local - protos.to(device=z.device, dtype=z.dtype)
    sq = (diff * diff).sum(1)
    dist = torch.where(sq > 0, sq, torch.ones_like(sq)).sqrt() * (sq > 0).to(sq.dtype)  # gradient 0 at distance 0
    weight = present.to(z.dtype)
    return (dist * weight).sum() / weight.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------------------------
# FedProto-UH (fixed orthogonal head from FedNH's FedUH), reference §1.10


def orthogonal_head(num_classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """W (C x d) with orthonormal rows, as ``nn.init.orthogonal_`` computes it: the QR factorisation of a N(0, 1)
    matrix (rotation-invariant, so no class is favoured), drawn from an explicit generator. (FedNH calls
    ``orthogonal_(torch.rand(C, d))``, but orthogonal_ overwrites its argument with its own normal draw; a QR of the
    *uniform* matrix itself would give class 0 the all-positive row, the best margin for non-negative embeddings.)"""
    if num_classes > dim:
        raise ValueError(f"an orthogonal head needs num_classes <= embedding size, got {num_classes} > {dim}")
    w = torch.randn(num_classes, dim, generator=generator)
    # QR of the transpose gives d x C with orthonormal columns (what nn.init.orthogonal_ computes, without the
    # global RNG); the sign fix makes the factorisation unique
    q, r = torch.linalg.qr(w.t())
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.t().contiguous()


def uh_logits(z: torch.Tensor, head: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s * <z / ||z||, W_c> (FedNH's normalised-embedding cosine head; W is fixed and not re-normalised)."""
    return scale * (F.normalize(z, dim=1, eps=1e-12) @ head.t())


# ---------------------------------------------------------------------------------------------------------------
# FedPU (Lin et al., ICML 2022), reference §1.11

UNLABELLED = -1  # the label a client sees for an unlabelled sample (its true label is never read)


@dataclass(frozen=True)
class Labelling:
    """Which share of a positive class keeps its labels: rho = ``rate`` (FedPU's positive_rate) of its n_c samples,
    only for classes with n_c >= ``min_class_samples``, at least one when ``at_least_one``."""
    rate: float
    min_class_samples: int = 0
    at_least_one: bool = True


def pu_split(y: torch.Tensor, classes: Sequence[int], num_classes: int, labelling: Labelling,
             rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A client's labelled / unlabelled split (FedPU's ``puSpilt_index``, with a seeded shuffle instead of "the
    first" samples): for every positive class c in ``classes`` with n_c >= ``labelling.min_class_samples`` samples,
    floor(rho * n_c) samples (at least one when ``labelling.at_least_one``) keep their label; all other samples (of
    the remaining positive classes and of every non-positive class) are unlabelled.

    Returns (observed labels with UNLABELLED for unlabelled samples, the class prior of the unlabelled set over all
    C classes, pi_c = (unlabelled samples of class c) / |U| (0 when U is empty; FedPU treats this prior as known),
    the positive-class indicator m (C,): 1 for every class in ``classes``)."""
    positive_rate, min_class_samples, at_least_one = labelling.rate, labelling.min_class_samples, labelling.at_least_one
    y_np = y.detach().cpu().numpy()
    observed = np.full(len(y_np), UNLABELLED, dtype=np.int64)
    positive = np.zeros(num_classes, dtype=np.float32)
    for c in classes:
        idx = np.flatnonzero(y_np == c)
        if len(idx) == 0:
            continue
        positive[c] = 1.0
        if len(idx) < min_class_samples:
            continue
        n_lab = len(idx) if positive_rate >= 1.0 else int(np.floor(positive_rate * len(idx)))
        if at_least_one:
            n_lab = max(1, n_lab)
        lab = rng.permutation(idx)[:n_lab]
        observed[lab] = c
    unl = observed == UNLABELLED
    n_unl = int(unl.sum())
    prior = np.bincount(y_np[unl], minlength=num_classes).astype(np.float64)[:num_classes]
    if n_unl > 0:
        prior = prior / n_unl
    dev = y.device
    return (torch.as_tensor(observed, device=dev), torch.as_tensor(prior, dtype=torch.float32, device=dev),
            torch.as_tensor(positive, device=dev))


def pu_loss(logits: torch.Tensor, y_obs: torch.Tensor, prior: torch.Tensor, positive: torch.Tensor,
            eps: float = 1e-6) -> torch.Tensor:
    """FedPU's ``MPULoss_V2`` PU term on one batch (labelled rows have y_obs >= 0, unlabelled UNLABELLED):

        L_U  = 1 / (max(1, |U|) C) * sum_{x in U} sum_c m_c * -log(1 - p_c(x) + eps)
        L_Pc = 1 / max(1, |P|)     * sum_{(x, y) in P} pi_y * -log(1 - p_y(x) + eps)
        PULoss = L_U - L_Pc         (no non-negative clamp, as the official code)"""
    p = F.softmax(logits, dim=1)
    num_classes = logits.shape[1]
    unl = y_obs < 0
    lab = ~unl
    neg_log = -torch.log(1.0 - p + eps)
    n_u = int(unl.sum())
    n_p = int(lab.sum())
    l_u = (neg_log[unl] * positive.unsqueeze(0)).sum() / (max(1, n_u) * num_classes)
    if n_p:
        yl = y_obs[lab]
        l_pc = (prior[yl] * neg_log[lab].gather(1, yl.unsqueeze(1)).squeeze(1)).sum() / n_p
    else:
        l_pc = logits.sum() * 0.0
    return l_u - l_pc


def labelled_ce(logits: torch.Tensor, y_obs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the labelled rows of a batch (0 with a gradient path when the batch has none)."""
    lab = y_obs >= 0
    if not bool(lab.any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits[lab], y_obs[lab])


# ---------------------------------------------------------------------------------------------------------------
# FedProx, FedPer / LG-FedAvg, FeSEM, FedDistill, reference §6


def proximal_term(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's (mu / 2) * ||w - w_g||^2 over all trainable parameters."""
    total = params[0].new_zeros(())
    for p, a in zip(params, anchors):
        total = total + ((p - a) ** 2).sum()
    return 0.5 * mu * total


def select_prefix(state: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """The entries of a SplitModel state dict under ``prefix`` ("body." or "head."), keys kept whole."""
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def flatten_state(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All floating-point entries of a state dict as one float64 vector (sorted by key)."""
    return torch.cat([state[k].detach().reshape(-1).to(torch.float64).cpu() for k in sorted(state)
                      if state[k].is_floating_point()])


def assign_nearest(points: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """FeSEM's E-step: argmin_k ||w_i - w~_k||_2 (ties go to the lower k)."""
    return pairwise_distances(points, centres).argmin(dim=1)


def class_mean_logits(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of logits and counts (accumulated over a client's training batches)."""
    sums = torch.zeros(num_classes, logits.shape[1], dtype=torch.float64).index_add_(0, y.cpu(), logits.detach().cpu().to(torch.float64))
    return sums, torch.bincount(y.cpu(), minlength=num_classes)


def distill_loss(logits: torch.Tensor, y: torch.Tensor, global_logits: torch.Tensor, mask: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """FedDistill's regulariser, ours: T^2 * KL(softmax(l_y / T) || softmax(f(x) / T)), averaged over the batch
    rows whose class has a global logit (HtFLlib feeds the raw averaged logits to CrossEntropyLoss; we use a proper
    soft target). Rows without one contribute 0 but count in the mean, like FedProto's regulariser."""
    has = mask.to(logits.device)[y]
    if not bool(has.any()):
        return logits.sum() * 0.0
    t = float(temperature)
    target = F.softmax(global_logits.to(logits.device)[y] / t, dim=1)
    logp = F.log_softmax(logits / t, dim=1)
    kl = (target * (torch.log(target.clamp_min(1e-12)) - logp)).sum(1)
    return (t * t) * (kl * has.to(kl.dtype)).mean()
