"""The building blocks every model is made of: :class:`SplitModel` (``body`` -> embedding of size ``embed_dim``, then
``head``), :class:`Dropout` whose masks come from an explicit generator (and the mask recording / replay the vectorised
executor uses), and :func:`num_parameters`. Imports nothing of raysim, so the zoo (:mod:`raysim.models`) and the user
model adapter (:mod:`raysim.adapt`) both build on it."""
from __future__ import annotations

import torch
import torch.nn as nn


class Dropout(nn.Module):
    """Dropout whose masks come from an explicit stream (``self.generator``, set by the executor per client step)
    instead of torch's global RNG, so a client's masks are a function of (seed, round, client) on any backend, looped
    or batched. The stream is counter-based (an object with ``mask(shape, p, dtype, device)``: the local-training
    methods', :class:`raysim.rng.Counter`, whose masks the vectorised executor computes for a whole group in one go) or a
    torch generator (a method's own loop). ``channelwise=True`` drops whole channels (Dropout2d). Without a stream:
    torch's global RNG."""

    def __init__(self, p: float = 0.5, channelwise: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p, self.channelwise = float(p), channelwise
        self.generator = None

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        shape = (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2) if self.channelwise else x.shape
        if _MASKS.replay is not None:  # vectorised executor: this client's mask, drawn beforehand (raysim.runner.vectorized)
            mask = next(_MASKS.replay)
        else:
            if _MASKS.record is not None:  # shape probe: which masks one forward draws, in call order
                _MASKS.record.append((tuple(shape), x.dtype, self.p))
            g = self.generator
            if g is not None and hasattr(g, "mask"):  # counter-based
                mask = g.mask(tuple(shape), self.p, x.dtype, x.device)
            else:
                mask = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - self.p, generator=g)
        return x * mask * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, channelwise={self.channelwise}"


class _MaskChannel:
    """Where :class:`Dropout` takes its masks from: its generator (default), a replay iterator (the vectorised
    executor feeds each client's pre-drawn masks), or its generator while recording the masks' shapes (a probe)."""

    replay = None
    record = None


_MASKS = _MaskChannel()


def dropout_masks_of(forward) -> list:
    """Run ``forward()`` recording the (shape, dtype, p) of every dropout mask it draws, in call order."""
    _MASKS.record = []
    try:
        forward()
        return list(_MASKS.record)
    finally:
        _MASKS.record = None


class replay_masks:
    """Context manager: every :class:`Dropout` forward inside takes the next of ``masks`` instead of drawing."""

    def __init__(self, masks):
        self.masks = masks

    def __enter__(self):
        _MASKS.replay = iter(self.masks)

    def __exit__(self, *exc):
        _MASKS.replay = None


def set_dropout_generator(model: nn.Module, generator) -> None:
    for m in model.modules():
        if isinstance(m, Dropout):
            m.generator = generator


class SplitModel(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module, embed_dim: int):
        super().__init__()
        self.body = body
        self.head = head
        self.embed_dim = embed_dim

    def forward(self, x, return_embedding: bool = False):
        z = self.body(x)
        logits = self.head(z)
        return (logits, z) if return_embedding else logits


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
