"""Local training only (no communication): the lower bound every federated method must beat."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from raysim.algorithm import Context, LocalStart, LocalTraining
from raysim.training import accuracy, clone_state, forward_all


def ce_loss(model, xb, yb):
    return F.cross_entropy(model(xb), yb), {}


class Local(LocalTraining):
    def declared_uploads(self):
        return set()

    name = "local"
    paper = "Baseline: each client trains alone on its own data."

    @dataclass(frozen=True)
    class Params:
        pass

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(state["model"])
        return LocalStart()

    def objective(self, start: LocalStart):
        return ce_loss

    def vectorizable(self, start: LocalStart) -> bool:
        return True  # plain cross-entropy: the same loss for every client

    def client_final(self, model, start, payload, state, data, ctx: Context):
        return {"model": clone_state(model)}, {}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": accuracy(logits.argmax(1), data.y_test)}
