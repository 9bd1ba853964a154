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
from raysim.algorithm import Context, FrozenForward, LocalStart
from raysim.config import positive
from raysim.messages import Message, rows_of
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

    uploads = frozenset({"weights", "num_samples"})

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
        # declared, not loaded: the global weights are the start (LocalStart.weights); the global and the previous
        # weights are loaded into the frozen modules when the per-client objective is made; a vectorised group
        # stacks the previous weights (the objective's rows) and gets both frozen models' outputs on each batch
        # (LocalStart.frozen: the frozen module in eval mode under the global weights, and under each client's own)
        glob, prev = self._frozen_pair(ctx)
        glob.eval()
        prev.eval()
        weights = payload["model"].tensors
        previous = (state or {}).get("prev") or weights
        embed = {"return_embedding": True}
        return LocalStart(aux={"glob": glob, "prev": prev, "global": weights, "previous": previous}, weights=weights,
                          rows={"prev": previous}, frozen={"glob_out": FrozenForward(glob, weights, embed),
                                                           "prev_out": FrozenForward(glob, "prev", embed)})

    def _loss(self, glob_embed, prev_embed):
        """The local objective, given the frozen global and previous models' embeddings of a batch."""
        mu, tau = self.params.mu, self.params.tau

        def loss_fn(model, xb, yb, epoch):
            logits, z = model(xb, return_embedding=True)
            ce = F.cross_entropy(logits, yb)
            with torch.no_grad():
                zg = glob_embed(xb)
                zp = prev_embed(xb)
            con = moon_contrastive(z, zg, zp, tau)
            return ce + mu * con, {"ce": ce.detach(), "con": con.detach()}

        return loss_fn

    def objective(self, start: LocalStart):
        glob, prev = start.aux["glob"], start.aux["prev"]
        glob.load_state_dict(start.aux["global"])
        prev.load_state_dict(start.aux["previous"])
        return self._loss(lambda xb: glob(xb, return_embedding=True)[1], lambda xb: prev(xb, return_embedding=True)[1])

    def row_objective(self, start: LocalStart):
        """The objective of a vectorised group: the frozen global and previous models' embeddings of the batch come
        in the client's rows (``rows["glob_out"]``, ``rows["prev_out"]``: (logits, embedding), computed by the
        executor for the whole group, ``LocalStart.frozen``)."""

        def loss_fn(model, xb, yb, epoch, rows):
            return self._loss(lambda _: rows["glob_out"][1], lambda _: rows["prev_out"][1])(model, xb, yb, epoch)

        return loss_fn

    def vectorizable(self, start: LocalStart) -> bool:
        return True  # the previous model, per client, is the objective's rows

    def client_final(self, model, start, payload, state, data, ctx: Context):
        new_state, upload = super().client_final(model, start, payload, state, data, ctx)
        return {**(new_state or {}), "prev": clone_state(model)}, upload

    def client_final_group(self, group):
        """client_final for a vectorised group: the upload (FedAvg's) and the state's previous model are rows of the
        trained stacks, the sample counts one stacked tensor."""
        if type(self).client_final is not Moon.client_final:
            return None
        counts = torch.tensor([[d.num_train] for d in group.datas], dtype=torch.int64)
        return [({**(state or {}), "prev": w}, {"model": Message("weights", w), "num_samples": Message("num_samples", n)})
                for state, w, n in zip(group.states, rows_of(group.state_stacks()), rows_of({"n": counts}))]
