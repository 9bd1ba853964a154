"""FedProto-UH: FedProto (Tan et al., AAAI 2022) with a fixed, orthogonally initialised head — the "FedUH" head of
FedNH (Dai et al., "Tackling Data Heterogeneity in Federated Learning with Class Prototypes", AAAI 2023), combined
with FedProto as in the seed's reproduction (reference §1.10; the combination is inferred there).

Every client's classifier is logits = s * <z / ||z||, W_c>, where W (C x d) has orthonormal rows and is never
trained, and s is a learnable scale (FedNH's default; ``learn_scale: false`` freezes it). The prototype loss and the
prototypes use the normalised embedding z / ||z|| (the vector the head consumes); inference reports the head's argmax
("test_acc") and the nearest global prototype ("test_acc_proto"). W is a pure function of the experiment seed
(stream (seed, -, server, "uh_head")), so every client rebuilds the same matrix locally and it is not communicated
(a deployment without a shared seed would send its C*d floats once). FedNH's gradient-norm clipping is not applied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from algorithms.fedproto import FedProto
from algorithms.proto_ops import orthogonal_head, uh_logits
from raysim import rng as rngmod
from raysim.config import ConfigError
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


def uh_model(base: SplitModel, weight: torch.Tensor, scale: float, learn_scale: bool) -> SplitModel:
    """``base``'s feature extractor followed by normalisation, with the fixed head instead of base's classifier."""
    return SplitModel(nn.Sequential(base.body, _Normalise()), FixedOrthogonalHead(weight, scale, learn_scale), base.embed_dim)


class FedProtoUH(FedProto):
    name = "fedproto_uh"
    paper = ("Tan et al., FedProto, AAAI 2022 + the fixed orthogonal head (FedUH) of Dai et al., FedNH, AAAI 2023")

    @dataclass(frozen=True)
    class Params(FedProto.Params):
        scale: float = 1.0  # initial s (FedNH: 1.0 for its small CNN, 20.0 for ResNet18)
        learn_scale: bool = True  # FedNH_fix_scaling=False

        def check(self, path):
            super().check(path)
            if self.scale <= 0:
                raise ConfigError(f"{path}.scale", f"must be > 0, got {self.scale}")

    def __init__(self, params, task):
        super().__init__(params, task)
        self._live: dict[str, SplitModel] = {}

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
        return uh_model(self.task.build_model(client_id), self.head_weight(), self.params.scale, self.params.learn_scale)

    def live_model(self, ctx):
        base = ctx.model()
        key = arch_key(self.task.archs[ctx.client_id])
        if key not in self._live or self._live[key].body[0] is not base.body:
            self._live[key] = uh_model(base, self.head_weight(), self.params.scale, self.params.learn_scale).to(ctx.device)
        return self._live[key]
