"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv 1912.00818; reference §6.3).

Clients share only the base layers; each keeps the rest. ``shared: convs`` (default, the seed's baseline): the base is
the convolutional layers of the body (the weights and biases of its ``nn.Conv2d`` modules, selected by module type:
5,280 of ``cnn_mnist``'s parameters, so 106k floats per round up for 20 clients); the body's fully connected layers
and the head stay personal. ``shared: body``: the whole body (PFLlib's FedPer: feature extractor shared, head
personal; 21,330 floats for cnn_mnist). The server averages the uploaded shared layers with sample-count weights and
sends the average back; a client overwrites only those layers with it (PFLlib ``clientper.set_parameters``), trains
the whole model, and uploads its shared layers. Evaluation: the client's own personal layers on the latest global
shared ones. Every client needs the same architecture; all start from one common initialisation of the shared
layers (the server's, sent in round 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from algorithms.fedavg import merge_sample_weighted, rebase_state_upload, sample_weighted_average
from algorithms.local import ce_loss
from algorithms.prototype_maths import select_prefix
from raysim.algorithm import Asynchronous, Context, LocalStart, LocalTraining
from raysim.config import choice
from raysim.errors import ConfigError
from raysim.messages import Layered, Message, rows_of, state_message
from raysim.runner.grouped import group_test_accuracy
from raysim.training import clone_state, device_accuracy, forward_all


class SharedPartAverage(Asynchronous, LocalTraining):
    """Shared by FedPer and LG-FedAvg: one part of the model (``shared`` = "body" or "head") is averaged on the
    server with sample-count weights; the other part stays on the client."""

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "personalised"}

    def declared_uploads(self):
        """The shared part's weights, the kind named after the part (FedPer's ``params.shared``, LG-FedAvg's head),
        and the sample counts; a subclass that declares ``uploads`` (FedGen-HT) declares them all."""
        return set(self.uploads) if self.uploads is not None else {f"{self.shared}_weights", "num_samples"}

    shared: str = "body"

    @dataclass(frozen=True)
    class Params:
        pass

    def prefix(self) -> str:
        return self.shared + "."

    def select_shared(self, state: dict, model) -> dict:
        """The entries of ``state`` (``model``'s state dict) that are communicated."""
        return select_prefix(state, self.prefix())

    def init_server_state(self, ctx: Context):
        # one common initialisation of the shared part (client 0's architecture), as FedAvg's global model
        model = self.task.build_model(0)
        return {"shared": self.select_shared(clone_state(model), model)}

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
        # the client's own state under the broadcast shared part (loaded by the executor: LocalStart.weights)
        shared = payload["shared"].tensors if "shared" in payload else {}
        return LocalStart(weights=Layered(shared, state["model"]) if shared else state["model"])

    def objective(self, start: LocalStart):
        return ce_loss

    def vectorizable(self, start: LocalStart) -> bool:
        return True

    def client_final(self, model, start, payload, state, data, ctx: Context):
        new_state = clone_state(model)
        upload = {"shared": state_message(f"{self.shared}_weights", self.select_shared(new_state, model)),
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return {"model": new_state}, upload

    def client_final_group(self, group):
        """client_final for a vectorised group: each client's new state and shared upload are its rows of the trained
        stacks (no copy per client), the sample counts one stacked tensor."""
        if type(self).client_final is not SharedPartAverage.client_final:
            return None
        full = group.state_stacks()
        shared = self.select_shared(full, group.model)
        counts = torch.tensor([[d.num_train] for d in group.datas], dtype=torch.int64)
        return [({"model": w}, {"shared": Message(f"{self.shared}_weights", s), "num_samples": Message("num_samples", n)})
                for w, s, n in zip(rows_of(full), rows_of(shared), rows_of({"n": counts}))]

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        return {"shared": sample_weighted_average(uploads, ids, "shared")}, {}

    def merge_uploads(self, uploads):
        return merge_sample_weighted(uploads, "shared") if uploads else None

    def async_rebase(self, upload, base_state, server_state, ctx):
        return rebase_state_upload(upload, "shared", base_state, server_state)

    def evaluate_group(self, payloads, states, datas, ctxs):
        """evaluate_client for clients of one architecture with test sets of one shape and one broadcast: one
        grouped forward of every client's test set under its own state with the shared part. None: per client."""
        if type(self).evaluate_client is not SharedPartAverage.evaluate_client:
            return None
        model = ctxs[0].model()
        shared = payloads[0]["shared"].tensors if "shared" in payloads[0] else {}
        if any(c.model() is not model for c in ctxs[1:]) or any(
                (p["shared"].tensors if "shared" in p else {}) is not shared for p in payloads[1:]):
            return None
        weights = [Layered(shared, s["model"]) if shared else s["model"] for s in states]
        accs = group_test_accuracy(model, weights, [d.x_test for d in datas], [d.y_test for d in datas])
        return None if accs is None else [{"test_acc": a} for a in accs]

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        self.load(model, payload, state)
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": device_accuracy(logits.argmax(1), data.y_test)}


def conv_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the weights and biases of the ``nn.Conv2d`` modules in ``model.body``."""
    keys = []
    for name, m in model.body.named_modules():
        if isinstance(m, nn.Conv2d):
            keys += [f"body.{name}.{p}" for p, _ in m.named_parameters(recurse=False)]
    return keys


class FedPer(SharedPartAverage):
    name = "fedper"
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv:1912.00818, 2019"

    @dataclass(frozen=True)
    class Params:
        shared: str = "convs"  # convs: the body's conv layers (the seed's baseline) | body: the whole body (PFLlib)

        def check(self, path):
            choice(f"{path}.shared", self.shared, ["convs", "body"])

    @property
    def shared(self) -> str:
        return self.params.shared

    def select_shared(self, state: dict, model) -> dict:
        if self.shared == "body":
            return select_prefix(state, "body.")
        return {k: state[k] for k in conv_keys(model)}

    def validate(self):
        self.require_homogeneous()
        if self.shared == "convs" and not conv_keys(self.task.build_model(0)):
            raise ConfigError("algorithm.params.shared", f"shared: convs needs nn.Conv2d layers in the body, and "
                                                         f"{self.task.archs[0].arch} has none; use shared: body")
