"""FedProto-UH: FedProto (Tan et al., AAAI 2022) with a fixed, orthogonally initialised head, as in the seed's
reproduction (seed 000, "固定头 UH"; reference §1.10), whose head idea is FedNH's "FedUH" (Dai et al., "Tackling Data
Heterogeneity in Federated Learning with Class Prototypes", AAAI 2023).

The head W (C x d) has orthonormal rows (``nn.init.orthogonal_``: the QR of a N(0, 1) draw, rotation-invariant, so
no class is favoured) and is never trained. ``head``:

* ``linear`` (default, the seed's design): the client's last layer is an orthogonally initialised, frozen linear
  layer, logits = W z (no bias), on the model's embedding z; prototypes are means of z, as in FedProto.
* ``cosine`` (FedNH's head): logits = s * <z / ||z||, W_c> with a learnable scale s (``scale``, ``learn_scale``);
  the prototype loss and the prototypes use the normalised embedding z / ||z|| (the vector the head consumes).

The classifier replaces the base model's whole head (its dropout included). Inference reports the head's argmax
("test_acc") and the nearest global prototype ("test_acc_proto"). Communication of the head: W is a pure function
of the experiment seed (stream (seed, -, server, "uh_head")), so every client rebuilds the same matrix locally from
the shared seed and it costs 0 floats on the wire (our choice; a deployment without a shared seed would send its
C*d floats once, in a setup schedule). FedNH's gradient-norm clipping is not applied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from algorithms.fedproto import FedProto
from algorithms.prototype_maths import orthogonal_head, uh_logits
from raysim import rng as rngmod
from raysim.config import choice
from raysim.errors import ConfigError
from raysim.models import SplitModel, arch_key


class _Normalise(nn.Module):
    def forward(self, z):
        return F.normalize(z, dim=1, eps=1e-12)


class FixedOrthogonalHead(nn.Module):
    """s * <z_hat, W_c> with W a buffer (saved with the weights, never trained)."""

    def __init__(self, weight: torch.Tensor, scale: float, learn_scale: bool):
        super().__init__()
        self.register_buffer("weight", weight.clone())
        s = torch.tensor(float(scale))
        if learn_scale:
            self.scale = nn.Parameter(s)
        else:
            self.register_buffer("scale", s)

    def forward(self, z):
        return uh_logits(z, self.weight, self.scale)


class FixedLinearHead(nn.Module):
    """logits = W z: a linear layer (no bias) whose weight W is a buffer (saved with the weights, never trained)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.clone())

    def forward(self, z):
        return z @ self.weight.t()


def uh_model(base: SplitModel, weight: torch.Tensor, scale: float, learn_scale: bool, head: str = "cosine") -> SplitModel:
    """``base``'s feature extractor with the fixed head instead of base's classifier (``cosine``: after
    normalising the embedding)."""
    if head == "linear":
        return SplitModel(nn.Sequential(base.body), FixedLinearHead(weight), base.embed_dim)
    return SplitModel(nn.Sequential(base.body, _Normalise()), FixedOrthogonalHead(weight, scale, learn_scale), base.embed_dim)


class FedProtoUH(FedProto):
    name = "fedproto_uh"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = ("Tan et al., FedProto, AAAI 2022 + the fixed orthogonal head (FedUH) of Dai et al., FedNH, AAAI 2023")

    @dataclass(frozen=True)
    class Params(FedProto.Params):
        head: str = "linear"  # linear: frozen orthogonal last layer (the seed's) | cosine: FedNH's normalised head
        scale: float = 1.0  # cosine: initial s (FedNH: 1.0 for its small CNN, 20.0 for ResNet18)
        learn_scale: bool = True  # cosine: FedNH_fix_scaling=False

        def check(self, path):
            super().check(path)
            choice(f"{path}.head", self.head, ["linear", "cosine"])
            if self.scale <= 0:
                raise ConfigError(f"{path}.scale", f"must be > 0, got {self.scale}")

    def validate(self):
        super().validate()
        d = self.embed_dim()
        if self.task.num_classes > d:
            raise ConfigError("model.params.embed_dim", f"an orthogonal head needs embed_dim >= num_classes "
                                                        f"({self.task.num_classes}), got {d}")

    def head_weight(self) -> torch.Tensor:
        g = rngmod.torch_generator(self.task.seed, rngmod.NO_ROUND, rngmod.SERVER, "uh_head")
        return orthogonal_head(self.task.num_classes, self.embed_dim(), g)

    def build_client_model(self, client_id: int):
        return uh_model(self.task.build_model(client_id), self.head_weight(), self.params.scale, self.params.learn_scale,
                        self.params.head)

    def live_model(self, ctx):
        base = ctx.model()  # the fixed head on the runner's live body (both in ctx.models)
        return ctx.models.get(("uh", arch_key(self.task.archs[ctx.client_id])),
                              lambda: uh_model(base, self.head_weight(), self.params.scale, self.params.learn_scale,
                                               self.params.head))
