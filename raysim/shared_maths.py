"""Small pure functions holding the maths that several methods share (tested against hand-computed numbers)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from raysim.messages import stacked_segments


def weighted_average_states(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """sum_i w_i * state_i / sum_i w_i for floating tensors; integer buffers are taken from the first state.

    The arithmetic of the plain loop ``acc = 0; for i: acc += (w_i / sum w) * state_i.to(float64)`` in client
    order, bit for bit, in a few operations per call instead of three per tensor and state (a partial aggregate of
    every step of a runner takes this path): the floating tensors of each state are laid side by side in one float64
    row (per dtype and device), the rows of a chunk of states (at most ~32 MB) stacked, multiplied by their
    normalised weights (the same float64 products) and added to the running sum in client order (((0 + p_0) + p_1)
    + ..., the loop's order); above ~1M floats a state, one tensor at a time in place."""
    if not states:
        raise ValueError("nothing to average")
    if torch.is_tensor(weights):  # e.g. sample counts as they arrived (counts: positive by construction, not read)
        w = weights.reshape(-1).to(torch.float64)
    else:
        values = [float(x) for x in weights]
        if not sum(values) > 0:
            raise ValueError("weights must sum to a positive number")
        w = torch.as_tensor(values, dtype=torch.float64)
    w = (w / w.sum()).tolist()  # the normalised weights (a host tensor's values: no device read)
    segments = stacked_segments(states)
    if segments is not None and len(segments) <= max(1, len(states) // 4):  # rows of a few groups' stacks (the
        return _weighted_stacks(segments, w)  # vectorised executor's uploads): no per-state work
    out = {k: v0.clone() for k, v0 in states[0].items() if not v0.is_floating_point()}
    groups: dict = {}
    for k, v0 in states[0].items():
        if v0.is_floating_point():
            groups.setdefault((v0.dtype, v0.device), []).append(k)
    for (dtype, _), keys in groups.items():
        if sum(states[0][k].numel() for k in keys) > _STACK_LIMIT:  # a large model: memory-bound, so in place
            for k in keys:
                out[k] = _weighted_in_place([s[k] for s in states], w).to(dtype)
            continue
        flat = _weighted_rows([[s[k] for k in keys] for s in states], w).to(dtype)
        for k, part in zip(keys, flat.split([states[0][k].numel() for k in keys])):
            out[k] = part.view(states[0][k].shape)
    return {k: out[k] for k in states[0]}


_STACK_LIMIT = 1 << 20  # floats per state above which the average runs in place (no stacked copies)


def _weighted_in_place(tensors: Sequence[torch.Tensor], w: list) -> torch.Tensor:
    """sum_i w[i] * tensors[i] in float64, summed in order from 0, one tensor at a time in place (the same float64
    products and sums as the stacked scan; three passes over each tensor instead of copies of the whole stack)."""
    acc = torch.zeros_like(tensors[0], dtype=torch.float64)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        for wi, t in zip(w, tensors):
            acc.add_(t.to(torch.float64, copy=True).mul_(wi))  # a copy even of a float64 state
        return acc
    tmp = torch.empty_like(acc)  # one float64 scratch tensor for every state's product (the same values)
    for wi, t in zip(w, tensors):
        acc.add_(tmp.copy_(t).mul_(wi))
    return acc


def _weighted_rows(states: Sequence[Sequence[torch.Tensor]], w: list) -> torch.Tensor:
    """sum_i w[i] * row_i in float64, summed in order from 0, where row_i is state i's tensors flattened side by side
    (docstring of weighted_average_states): a chunk of rows is laid out and scaled at once, then added to the running
    sum one row after another (vectorised in-place adds: the loop's order, none of a scan's strided passes). The rows
    of a chunk are written in float64 by one ``cat`` into one buffer, reused by every chunk (the float32 -> float64
    conversion is exact: the same values as stacking, concatenating and converting, with one pass over the states
    instead of three and one allocation a call instead of three a chunk)."""
    first = states[0][0]
    numel = sum(t.numel() for t in states[0])
    chunk = max(1, (32 << 20) // max(1, 8 * numel))
    acc = first.new_zeros(numel, dtype=torch.float64)  # where the states are
    ws = first.new_tensor(w, dtype=torch.float64).unsqueeze(1)
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for s in states for t in s)
    buf = None
    for start in range(0, len(states), chunk):
        part = states[start:start + chunk]
        n = len(part)
        if differentiable:  # cat(out=) refuses tensors that need grad: the stacked copies, as autograd sees them
            cols = [torch.stack([s[j] for s in part]).reshape(n, -1) if n > 1 else part[0][j].reshape(1, -1)
                    for j in range(len(part[0]))]
            rows = (torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]).to(torch.float64)
        else:
            if buf is None:
                buf = first.new_empty((min(chunk, len(states)), numel), dtype=torch.float64)
            rows = buf[:n]
            torch.cat([t if t.dim() == 1 else t.reshape(-1) for s in part for t in s], out=rows.view(-1))
        rows.mul_(ws if n == len(states) else ws[start:start + n])
        for row in rows.unbind():
            acc.add_(row)
    return acc


def _weighted_stacks(segments: list, w: list) -> dict:
    """weighted_average_states over rows of stacks (name -> [K, ...]), given as [(stacks, rows)] in the states'
    order: the same float64 products, summed in the same order from 0 (a sequential scan down the rows, carried from
    one segment to the next: ((0 + p_0) + p_1) + ..., what the loop's in-place adds compute, bit for bit), in a few
    operations per dtype and segment whatever the number of rows."""
    stacks0, rows0 = segments[0]
    out = {n: s[rows0[0]].clone() for n, s in stacks0.items() if not s.is_floating_point()}
    groups: dict = {}
    for n, s in stacks0.items():
        if s.is_floating_point():
            groups.setdefault((s.dtype, s.device), []).append(n)
    for (dtype, _), names in groups.items():
        sizes = [stacks0[n][0].numel() for n in names]
        per_name = sum(sizes) > _STACK_LIMIT  # a large model: one tensor at a time (bounded extra memory)
        for part_names in ([[n] for n in names] if per_name else [names]):
            acc, at = None, 0
            for stacks, rows in segments:
                parts = [stacks[n].reshape(stacks[n].shape[0], -1) for n in part_names]
                if rows != list(range(stacks[part_names[0]].shape[0])):
                    take = torch.as_tensor(rows, device=parts[0].device)
                    parts = [p.index_select(0, take) for p in parts]
                flat = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                acc = _scan_rows(flat, w[at:at + len(rows)], acc)
                at += len(rows)
            flat = acc.to(dtype)
            for n, piece in zip(part_names, flat.split([stacks0[n][0].numel() for n in part_names])):
                out[n] = piece.view(stacks0[n].shape[1:])
    return {n: out[n] for n in stacks0}


def _scan_rows(rows: torch.Tensor, w: list, acc=None) -> torch.Tensor:
    """acc + sum_i w[i] * rows[i] in float64 summed in order from ``acc`` (0 when None; docstring of
    _weighted_stacks): chunks of rows scaled at once, each chunk scanned down its rows after the running sum (at most
    ~32 MB of float64 at a time)."""
    k, numel = rows.shape
    chunk = max(1, (32 << 20) // max(1, 8 * numel))
    ws = torch.tensor(w, dtype=torch.float64).to(rows.device).unsqueeze(1)
    acc = rows.new_zeros((1, numel), dtype=torch.float64) if acc is None else acc.reshape(1, numel)
    for start in range(0, k, chunk):
        part = rows[start:start + chunk].to(torch.float64, copy=True).mul_(ws[start:start + chunk])
        acc = torch.cat([acc, part]).cumsum(0)[-1:]
    return acc[0]


def class_prototypes(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class mean embeddings. Returns (classes present, their prototypes |present| x d, counts)."""
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    present = torch.nonzero(counts, as_tuple=False).flatten()
    return present, sums[present] / counts[present].unsqueeze(1).to(z.dtype), counts[present]


def moved_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` on ``ref``'s device: an aggregate computed where the uploads are, brought home to the server state it
    joins (once per round)."""
    return t.cpu() if ref.device.type == "cpu" else t.to(ref.device)


def known_class_prototypes(z: torch.Tensor, y: torch.Tensor, classes: Sequence[int],
                           num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`class_prototypes` when the host already knows ``classes``, the sorted classes present in ``y`` (a
    client's training labels: ``ClientData.classes``): the same tensors, bit for bit, without finding the present
    classes on the device (a host read on a GPU)."""
    present = torch.as_tensor(list(classes), dtype=torch.int64).to(z.device)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    counts = torch.zeros(num_classes, dtype=torch.int64, device=z.device).index_add_(0, y, torch.ones_like(y))
    return present, (sums / counts.unsqueeze(1).to(z.dtype))[present], counts[present]


def group_class_prototypes(z: torch.Tensor, y: torch.Tensor, classes: Sequence[Sequence[int]],
                           num_classes: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`known_class_prototypes` of K clients at once: ``z`` [K, n, d], ``y`` [K, n], ``classes`` each client's
    sorted classes present (known on the host). Per client (classes, prototypes, counts), views of three tensors: the
    sums of client k's rows in the same order as its own (one index_add over K x C rows), in a few operations for the
    whole group."""
    k, n, d = z.shape
    key = (y + num_classes * torch.arange(k, device=y.device).unsqueeze(1)).reshape(-1)
    sums = torch.zeros(k * num_classes, d, dtype=z.dtype, device=z.device).index_add_(0, key, z.reshape(-1, d))
    counts = torch.zeros(k * num_classes, dtype=torch.int64, device=z.device).index_add_(0, key, torch.ones_like(key))
    flat = [c for i, cs in enumerate(classes) for c in (num_classes * i + int(x) for x in cs)]
    rows = torch.as_tensor(flat, dtype=torch.int64).to(z.device)
    present = torch.as_tensor([int(x) for cs in classes for x in cs], dtype=torch.int64).to(z.device)
    means = (sums / counts.unsqueeze(1).to(z.dtype))[rows]
    sizes = [len(cs) for cs in classes]
    return list(zip(present.split(sizes), means.split(sizes), counts[rows].split(sizes)))


def aggregate_prototypes(uploads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_classes: int, dim: int,
                         mode: str = "weighted") -> tuple[torch.Tensor, torch.Tensor]:
    """Global prototypes from (classes, prototypes, counts) uploads.

    ``weighted``: P_c = sum_i n_ic p_ic / sum_i n_ic (FedProto paper); ``mean``: plain mean over the clients holding c
    (FedProto's official code). Returns (prototypes C x d, mask C of classes that have one)."""
    dev = uploads[0][1].device if uploads else torch.device("cpu")  # where the uploads are (nothing read back)
    num = torch.zeros(num_classes, dim, dtype=torch.float64, device=dev)
    den = torch.zeros(num_classes, dtype=torch.float64, device=dev)
    # a CPU index_add_ adds the rows in index order, so all uploads in one call (concatenated in order) give the
    # per-upload sums bit for bit; elsewhere (CUDA: atomics, or a sorted deterministic order) one call per upload
    parts = [uploads] if dev.type == "cpu" and len(uploads) > 1 else [[u] for u in uploads]
    for part in parts:
        classes = torch.cat([u[0] for u in part]) if len(part) > 1 else part[0][0]
        protos = torch.cat([u[1].detach() for u in part]) if len(part) > 1 else part[0][1].detach()
        w = (torch.cat([u[2] for u in part]).to(dev, torch.float64) if len(part) > 1 else part[0][2].to(dev, torch.float64)
             ) if mode == "weighted" else torch.ones(len(classes), dtype=torch.float64, device=dev)
        c = classes.to(dev)
        num.index_add_(0, c, protos.to(dev, torch.float64) * w.unsqueeze(1))
        den.index_add_(0, c, w)
    mask = den > 0
    out = torch.where(mask.unsqueeze(1), num / den.clamp_min(1e-300).unsqueeze(1), 0.0).to(torch.float32)
    return out, mask


def nearest_prototype(z: torch.Tensor, protos: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """argmin_c MSE(z, P_c) (mean over the embedding dimension) among candidate classes (bool mask over C)."""
    d = ((z.unsqueeze(1) - protos.unsqueeze(0)) ** 2).mean(dim=2)
    d = d.masked_fill(~candidates.to(z.device).unsqueeze(0), float("inf"))
    return d.argmin(dim=1)


def prototype_regulariser(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FedProto's loss2: nn.MSELoss between z and its class's global prototype, where a sample whose class has no
    global prototype uses z.detach() as target (contributes zero but still counts in the mean over |B| x d).
    ``mask`` None: every class has a prototype (``protos`` on z's device)."""
    if mask is None:  # every class has one (known on the host): the target is P_y
        return torch.nn.functional.mse_loss(z, protos[y])
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
