"""FeSEM (Xie et al., "Multi-Center Federated Learning: Clients Clustering for Better Personalization", World Wide
Web 2023 / arXiv 2005.01026), following the FlexCFL re-implementation (reference §6.5).

The server keeps K centre models, cold-started from K differently seeded initialisations. Each round a client
downloads only the centre of its cluster, trains it locally and uploads the result. Stochastic EM on the server:
E-step, every participant is reassigned to the centre nearest to its local solution, argmin_k ||w_i - w~_k||_2
(flattened floating-point weights); M-step, each centre becomes the plain average of the local models assigned to
it (a centre nobody joined keeps its weights). The first assignment is drawn uniformly at random from the
(seed, "fesem_assign") stream so that no centre starts unused. Every client needs the same architecture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.local import ce_loss
from algorithms.proto_ops import assign_nearest, flatten_state
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.config import ConfigError, positive
from raysim.messages import Message, state_message
from raysim.ops import weighted_average_states
from raysim.training import accuracy, clone_state, forward_all, train_epochs


def fesem_step(local_states: list, centres: list) -> tuple[list, torch.Tensor]:
    """One E+M step: (new centres, assignment of each local state). Pure, for tests and the server."""
    points = torch.stack([flatten_state(s) for s in local_states])
    cents = torch.stack([flatten_state(c) for c in centres])
    assign = assign_nearest(points, cents)
    new = []
    for k, old in enumerate(centres):
        members = [s for s, a in zip(local_states, assign.tolist()) if a == k]
        new.append(weighted_average_states(members, [1.0] * len(members)) if members else old)
    return new, assign


class FeSEM(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do

    def declared_uploads(self):
        return {"weights"}

    name = "fesem"
    paper = "Xie et al., Multi-Center Federated Learning: Clients Clustering for Better Personalization, WWW Journal 2023"

    @dataclass(frozen=True)
    class Params:
        num_clusters: int = 2

        def check(self, path):
            positive(f"{path}.num_clusters", self.num_clusters)

    def validate(self):
        self.require_homogeneous()
        if self.params.num_clusters > self.task.num_clients:
            raise ConfigError("algorithm.params.num_clusters", f"must be <= data.num_clients ({self.task.num_clients}), "
                                                               f"got {self.params.num_clusters}")

    def init_server_state(self, ctx: Context):
        seed, k = self.task.seed, self.params.num_clusters
        centres = []
        for j in range(k):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rngmod.derive_seed(seed, rngmod.NO_ROUND, rngmod.SERVER, f"fesem_centre_{j}"))
                centres.append(clone_state(self.task.build_model(0)))
        r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "fesem_assign")
        assign = torch.as_tensor(r.integers(0, k, size=self.task.num_clients), dtype=torch.int64)
        return {"centres": centres, "assign": assign}

    def broadcast(self, server_state, ctx: Context):
        out = {f"centre_{j}": state_message("weights", c) for j, c in enumerate(server_state["centres"])}
        out["assignment"] = Message("cluster_assignment", {"assign": server_state["assign"].clone()})
        return out

    def downlink(self, payload, client_id: int, ctx=None):
        """A client downloads only its own centre (and its cluster id)."""
        k = int(payload["assignment"]["assign"][client_id])
        return {"model": payload[f"centre_{k}"], "cluster": Message("cluster_id", {"k": torch.tensor([k])})}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.load_state_dict(payload["model"].tensors)
        metrics = train_epochs(model, data.x_train, data.y_train, self.task.train, ctx.generator("batches"), ce_loss,
                               dropout_generator=ctx.generator("dropout", device=ctx.device))
        upload = {"model": state_message("weights", model.state_dict())}
        return ClientUpdate(state, upload, metrics)

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        centres, assign = fesem_step([uploads[i]["model"].tensors for i in ids], server_state["centres"])
        new_assign = server_state["assign"].clone()
        new_assign[torch.as_tensor(ids)] = assign
        moved = int((new_assign != server_state["assign"]).sum())
        sizes = torch.bincount(new_assign, minlength=self.params.num_clusters)
        return {"centres": centres, "assign": new_assign}, {"fesem_moved": float(moved),
                                                            "fesem_largest_cluster": float(sizes.max())}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(payload["model"].tensors)
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": accuracy(logits.argmax(1), data.y_test), "cluster": float(payload["cluster"]["k"][0])}
