"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021; reference §6.7).

FedAvg whose local loss adds a model-contrastive term: CE + mu * l_con with

    l_con = -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) )

z the embedding of the model being trained, z_glob that of the round's global model, z_prev that of the client's
previous-round local model (kept in the client's state; a client's first round uses the global model, as the official
code's initial pool does, which makes l_con the constant log 2). Both reference models are frozen and run in eval
mode. No projection head: z is the model body's embedding (PFLlib's choice; the official code adds a 2-layer
projection head of out_dim 256). Defaults tau = 0.5, mu = 1 (official argparse). Server: FedAvg.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.fedavg import FedAvg
from raysim.algorithm import Context, LocalStart
from raysim.config import positive
from raysim.training import clone_state


def moon_contrastive(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over the batch of -log softmax([cos(z, z_glob), cos(z, z_prev)] / tau)[0]."""
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    logits = torch.stack([pos, neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


class Moon(FedAvg):
    needs_embedding = True  # (FedAvg's subclass) reads the embedding / the head
    name = "moon"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = "Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021"

    def declared_uploads(self):
        return {"weights", "num_samples"}

    @dataclass(frozen=True)
    class Params:
        mu: float = 1.0
        tau: float = 0.5

        def check(self, path):
            positive(f"{path}.mu", self.mu, allow_zero=True)
            positive(f"{path}.tau", self.tau)

    def pu_view(self, data):
        return None

    def _frozen_pair(self, ctx: Context):
        """The runner's frozen live modules for the global and the previous model (weights loaded by the caller)."""
        from raysim.models import arch_key

        key = arch_key(self.task.archs[ctx.client_id])
        return tuple(ctx.models.get((role, key), lambda: self.task.build_model(ctx.client_id).requires_grad_(False))
                     for role in ("moon_global", "moon_prev"))

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(payload["model"].tensors)
        glob, prev = self._frozen_pair(ctx)
        glob.load_state_dict(payload["model"].tensors)
        prev.load_state_dict((state or {}).get("prev") or payload["model"].tensors)
        glob.eval()
        prev.eval()
        return LocalStart(aux={"glob": glob, "prev": prev})

    def objective(self, start: LocalStart):
        glob, prev = start.aux["glob"], start.aux["prev"]
        mu, tau = self.params.mu, self.params.tau

        def loss_fn(model, xb, yb, epoch):
            logits, z = model(xb, return_embedding=True)
            ce = F.cross_entropy(logits, yb)
            with torch.no_grad():
                _, zg = glob(xb, return_embedding=True)
                _, zp = prev(xb, return_embedding=True)
            con = moon_contrastive(z, zg, zp, tau)
            return ce + mu * con, {"ce": ce.detach(), "con": con.detach()}

        return loss_fn

    def vectorizable(self, start: LocalStart) -> bool:
        return False  # the previous model is per client

    def client_final(self, model, start, payload, state, data, ctx: Context):
        new_state, upload = super().client_final(model, start, payload, state, data, ctx)
        return {**(new_state or {}), "prev": clone_state(model)}, upload
