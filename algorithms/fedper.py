"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv 1912.00818; reference §6.3).

Clients share only the base (the SplitModel body, the feature extractor); each keeps its own head. The server
averages the uploaded bodies with sample-count weights and sends the average back; a client overwrites only its body
with it (PFLlib ``clientper.set_parameters``), trains the whole model, and uploads its body. Evaluation: the client's
own head on the latest global body. Every client needs the same body architecture; all start from one common body
initialisation (the server's, sent in round 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.local import ce_loss
from algorithms.proto_ops import select_prefix
from raysim.algorithm import Context, LocalStart, LocalTraining
from raysim.messages import Message, state_message
from raysim.ops import weighted_average_states
from raysim.training import accuracy, clone_state, forward_all


class SharedPartAverage(LocalTraining):
    """Shared by FedPer and LG-FedAvg: one part of the model (``shared`` = "body" or "head") is averaged on the
    server with sample-count weights; the other part stays on the client."""

    def declared_uploads(self):
        return {f"{self.shared}_weights", "num_samples"}

    shared: str = "body"

    @dataclass(frozen=True)
    class Params:
        pass

    def prefix(self) -> str:
        return self.shared + "."

    def init_server_state(self, ctx: Context):
        # one common initialisation of the shared part (client 0's architecture), as FedAvg's global model
        return {"shared": select_prefix(clone_state(self.task.build_model(0)), self.prefix())}

    def broadcast(self, server_state, ctx: Context):
        if "shared" not in server_state:
            return {}
        return {"shared": state_message(f"{self.shared}_weights", server_state["shared"])}

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def load(self, model, payload, state):
        model.load_state_dict(state["model"])
        if "shared" in payload:
            model.load_state_dict({k: v.to(next(model.parameters()).device) for k, v in payload["shared"].tensors.items()},
                                  strict=False)

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        self.load(model, payload, state)
        return LocalStart()

    def objective(self, start: LocalStart):
        return ce_loss

    def client_final(self, model, start, payload, state, data, ctx: Context):
        new_state = clone_state(model)
        upload = {"shared": state_message(f"{self.shared}_weights", select_prefix(new_state, self.prefix())),
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return {"model": new_state}, upload

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        states = [uploads[i]["shared"].tensors for i in ids]
        weights = [int(uploads[i]["num_samples"]["n"][0]) for i in ids]
        return {"shared": weighted_average_states(states, weights)}, {}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        self.load(model, payload, state)
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": accuracy(logits.argmax(1), data.y_test)}


class FedPer(SharedPartAverage):
    name = "fedper"
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv:1912.00818, 2019"
    shared = "body"

    def validate(self):
        self.require_homogeneous()
