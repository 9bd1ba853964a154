"""FedFomo (Zhang et al., "Personalized Federated Learning with First Order Model Optimization", ICLR 2021),
following PFLlib's ``clientfomo.py`` / ``serverfomo.py`` (reference §3.4).

The server keeps every client's last uploaded model and an affinity matrix P (N x N, initialised to the identity).
Each round it sends a sampled client i the M models of other clients with the highest P[i, j] among those it holds
(M capped by how many it holds; ties go to the lower client id). Client i holds out a validation split
(``data.val_fraction``, FedFomo's 0.2) and weighs each received model n against its own previous model:

    w_n = (L_val(theta_i^old) - L_val(theta_n)) / (||theta_n - theta_i^old||_2 + 1e-5)

sends the raw w_n back (the server adds them to P[i, n]), clips them at 0 and normalises them to sum 1; when all are
zero it keeps its old model, otherwise theta_i = sum_n w_n theta_n. It then trains locally (train.local_epochs on the
remaining training data) and uploads the result. Every client starts from the same initial model (PFLlib's clients
copy the global model); the first round nobody has uploaded yet, so clients train their initial model.

Differences from PFLlib, stated: the server keeps each client's *last* model, not only the previous round's uploads
(the reference spec), and a client never receives its own model (its old model is the reference point).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.local import ce_loss
from algorithms.prototype_maths import flatten_state
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.messages import Message, state_message
from raysim.shared_maths import weighted_average_states
from raysim.training import clone_state, device_accuracy, forward_all, train_epochs, TrainOptions


def fomo_weights(old_loss: float, peer_losses: list[float], distances: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw weights w_n, the weights used: max(w, 0) normalised to sum 1, or all zero when none is positive)."""
    raw = torch.tensor([(old_loss - l) / (d + 1e-5) for l, d in zip(peer_losses, distances)], dtype=torch.float64)
    used = raw.clamp(min=0)
    s = float(used.sum())
    return raw, (used / s if s > 0 else torch.zeros_like(used))


def top_peers(P_row: torch.Tensor, candidates: list[int], m: int) -> list[int]:
    """The ``m`` candidates with the highest affinity (ties: the lower id)."""
    order = sorted(candidates, key=lambda j: (-float(P_row[j]), j))
    return order[:min(m, len(order))]


@torch.no_grad()
def val_loss(model, state, x, y) -> float:
    model.load_state_dict(state)
    logits, _ = forward_all(model, x)
    return float(F.cross_entropy(logits, y))


class FedFomo(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "fedfomo"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "personalised"}
    paper = "Zhang et al., Personalized Federated Learning with First Order Model Optimization, ICLR 2021"
    uploads = frozenset({"weights", "affinity"})

    @dataclass(frozen=True)
    class Params:
        num_peers: int = 5  # M: models sent to each client (PFLlib default 5)

        def check(self, path):
            positive(f"{path}.num_peers", self.num_peers)

    def validate(self):
        self.require_homogeneous()
        if self.task.val_fraction <= 0:
            raise ConfigError("data.val_fraction", "FedFomo weighs the received models on a validation split: set "
                                                   "data.val_fraction (FedFomo's 0.2)")

    def init_server_state(self, ctx: Context):
        n = self.task.num_clients
        return {"P": torch.eye(n, dtype=torch.float64), "models": {}}

    def init_client_state(self, ctx: Context):
        with rngmod.init_seed(self.task.seed, "fomo_init"):  # every client starts from the same model
            return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def broadcast(self, state, ctx: Context):
        out = {f"model_{j}": state_message("weights", m) for j, m in sorted(state["models"].items())}
        out["affinity"] = Message("affinity", {"P": state["P"].clone()})
        return out

    def downlink(self, payload, client_id: int, ctx=None):
        held = sorted(int(k.split("_")[1]) for k in payload if k.startswith("model_"))
        peers = top_peers(payload["affinity"]["P"][client_id], [j for j in held if j != client_id],
                          self.params.num_peers)
        down = {f"peer_{j}": payload[f"model_{j}"] for j in peers}
        down["peer_ids"] = Message("peer_ids", {"ids": torch.tensor(peers, dtype=torch.int64)})
        return down

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        old = state["model"]
        ids = payload["peer_ids"]["ids"].tolist()
        metrics = {}
        start = old
        raw = torch.zeros(0, dtype=torch.float64)
        if ids:
            peers = [payload[f"peer_{j}"].tensors for j in ids]
            l_old = val_loss(model, old, data.x_val, data.y_val)
            losses = [val_loss(model, s, data.x_val, data.y_val) for s in peers]
            flat_old = flatten_state(old)
            dists = [float(torch.linalg.vector_norm(flatten_state(s) - flat_old)) for s in peers]
            raw, used = fomo_weights(l_old, losses, dists)
            if float(used.sum()) > 0:
                keep = [(s, float(w)) for s, w in zip(peers, used) if float(w) > 0]
                start = weighted_average_states([s for s, _ in keep], [w for _, w in keep])
            metrics["fomo_positive"] = float((used > 0).sum())
        model.load_state_dict(start)
        metrics.update(train_epochs(model, data.x_train, data.y_train, TrainOptions(
            self.task.train, ctx.generator("batches"), ctx.generator("dropout", device=ctx.device)), ce_loss))
        new = clone_state(model)
        upload = {"model": state_message("weights", new),
                  "affinity": Message("affinity", {"ids": torch.tensor(ids, dtype=torch.int64), "w": raw})}
        return ClientUpdate({"model": new}, upload, metrics)

    def aggregate(self, state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return state, {}
        P, models = state["P"].clone(), dict(state["models"])
        for i in ids:
            models[i] = uploads[i]["model"].tensors
            a = uploads[i]["affinity"]
            if a["ids"].numel():
                P[i, a["ids"]] += a["w"]
        return {"P": P, "models": models}, {}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": device_accuracy(logits.argmax(1), data.y_test)}
