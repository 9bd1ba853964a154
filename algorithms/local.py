"""Local training only (no communication): the lower bound every federated method must beat."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.training import accuracy, clone_state, forward_all, train_epochs


def ce_loss(model, xb, yb):
    return F.cross_entropy(model(xb), yb), {}


class Local(Algorithm):
    name = "local"
    paper = "Baseline: each client trains alone on its own data."

    @dataclass(frozen=True)
    class Params:
        pass

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.load_state_dict(state["model"])
        metrics = train_epochs(model, data.x_train, data.y_train, self.task.train, ctx.generator("batches"), ce_loss)
        return ClientUpdate({"model": clone_state(model)}, {}, metrics)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": accuracy(logits.argmax(1), data.y_test)}
