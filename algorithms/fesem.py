"""FeSEM (Xie et al., "Multi-Center Federated Learning: Clients Clustering for Better Personalization", World Wide
Web 2023 / arXiv 2005.01026), following the FlexCFL re-implementation (reference §6.5).

The server keeps K centre models, cold-started from K differently seeded initialisations. Each round a client
downloads only the centre of its cluster, trains it locally and uploads the result. Stochastic EM on the server:
E-step, every participant is reassigned to the centre nearest to its local solution, argmin_k ||w_i - w~_k||_2
(flattened floating-point weights); M-step, each centre becomes the plain average of the local models assigned to
it (a centre nobody joined keeps its weights). Every client needs the same architecture.

``init`` says how the centres and the first assignment start:

* ``random`` (default; FlexCFL's cold start): K differently seeded initialisations; the first assignment is drawn
  uniformly at random from the (seed, "fesem_assign") stream so that no centre starts unused. Clients then never
  change cluster: a client trains from its centre, and a few local epochs move its weights far less than the
  distance between two independent initialisations (||w~_j - w~_k|| ~ sqrt(2 P) sigma for P weights of std sigma),
  so the E-step returns it to the centre it started from. ``fesem_drift_ratio`` (server metric, per round: the
  largest distance of a local model from its own starting centre divided by the smallest distance between two
  centres) stays far below 1/2, which is what a move needs (tests/test_clustered.py shows this by hand).
* ``clients`` (warm start, as k-means seeds its centres with data points): until the centres exist every client
  trains from one shared initial model; in the first round with participants the server takes K of the returned
  local models (seeded, uniformly without replacement) as the centres and runs the E-step and M-step on all of
  them; a client first sampled later also trains from the shared model before its first E-step. The first
  assignment is then made from the clients' data (their local solutions from one common start), and the centres,
  all descending from one model, lie close enough for a client to change cluster (``fesem_drift_ratio`` reaches
  1/2); whether any does is up to the data (``fesem_moved``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.local import ce_loss
from algorithms.prototype_maths import assign_nearest, flatten_state
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context, ReportsClusters
from raysim.config import choice, positive
from raysim.errors import ConfigError
from raysim.messages import Message, state_message
from raysim.shared_maths import weighted_average_states
from raysim.training import clone_state, device_accuracy, forward_all, train_epochs, TrainOptions


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


def drift_ratio(local_states: list, started_from: list, centres: list) -> float:
    """max_i ||w_i - w~_{k(i)}|| / min_{j != k} ||w~_j - w~_k||: how far local training moved the clients from the
    centres they started from, against the gap between centres. A client can only change cluster when it moved
    closer to another centre than to its own; by the triangle inequality that needs a drift of at least half the
    gap, so a ratio below 1/2 means nobody moves this round."""
    cents = torch.stack([flatten_state(c) for c in centres]).to(torch.float64)
    if len(cents) < 2:
        return 0.0
    gaps = torch.cdist(cents, cents)
    gap = float(gaps[~torch.eye(len(cents), dtype=torch.bool)].min())
    drift = max(float(torch.linalg.vector_norm(flatten_state(a).to(torch.float64) - flatten_state(b).to(torch.float64)))
                for a, b in zip(local_states, started_from))
    return drift / gap if gap > 0 else float("inf")


class FeSEM(ReportsClusters, Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    uploads = frozenset({"weights"})

    name = "fesem"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "cluster"}
    paper = "Xie et al., Multi-Center Federated Learning: Clients Clustering for Better Personalization, WWW Journal 2023"

    @dataclass(frozen=True)
    class Params:
        num_clusters: int = 2
        init: str = "random"  # random: K seeded centres, random first assignment (FlexCFL) | clients: K local models

        def check(self, path):
            positive(f"{path}.num_clusters", self.num_clusters)
            choice(f"{path}.init", self.init, ["random", "clients"])

    def validate(self):
        self.require_homogeneous()
        if self.params.num_clusters > self.task.num_clients:
            raise ConfigError("algorithm.params.num_clusters", f"must be <= data.num_clients ({self.task.num_clients}), "
                                                               f"got {self.params.num_clusters}")

    def init_server_state(self, ctx: Context):
        seed, k = self.task.seed, self.params.num_clusters
        centres = []
        for j in range(k):
            with rngmod.init_seed(seed, f"fesem_centre_{j}"):
                centres.append(clone_state(self.task.build_model(0)))
        if self.params.init == "clients":
            with rngmod.init_seed(seed, "fesem_shared"):
                shared = clone_state(self.task.build_model(0))
            return {"centres": centres, "shared": shared, "live": False,
                    "assign": torch.full((self.task.num_clients,), -1, dtype=torch.int64)}
        r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "fesem_assign")
        assign = torch.as_tensor(r.integers(0, k, size=self.task.num_clients), dtype=torch.int64)
        return {"centres": centres, "assign": assign}

    def broadcast(self, server_state, ctx: Context):
        out = {}
        if "shared" in server_state:  # init: clients: the shared model trains every client not assigned yet
            out["shared"] = state_message("weights", server_state["shared"])
        if server_state.get("live", True):
            out.update({f"centre_{j}": state_message("weights", c) for j, c in enumerate(server_state["centres"])})
        out["assignment"] = Message("cluster_assignment", {"assign": server_state["assign"].clone()})
        return out

    def downlink(self, payload, client_id: int, ctx=None):
        """A client downloads only its own centre and cluster id (before the warm start: the shared model)."""
        k = int(payload["assignment"]["assign"][client_id])
        if k < 0:
            return {"model": payload["shared"], "cluster": Message("cluster_id", {"k": torch.tensor([k])})}
        return {"model": payload[f"centre_{k}"], "cluster": Message("cluster_id", {"k": torch.tensor([k])})}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.load_state_dict(payload["model"].tensors)
        metrics = train_epochs(model, data.x_train, data.y_train, TrainOptions(
            self.task.train, ctx.generator("batches"), ctx.generator("dropout", device=ctx.device)), ce_loss)
        upload = {"model": state_message("weights", model.state_dict(keep_vars=True))}
        return ClientUpdate(state, upload, metrics)

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        local = [uploads[i]["model"].tensors for i in ids]
        old_assign = server_state["assign"]
        extra = {}
        if not server_state.get("live", True):  # warm start: K of this round's local models become the centres
            r = ctx.rng("fesem_init")
            picks = sorted(r.choice(len(ids), size=min(self.params.num_clusters, len(ids)), replace=False).tolist())
            start = [local[j] for j in picks] + server_state["centres"][len(picks):]
            extra = {"live": True, "shared": server_state["shared"]}
        else:
            start = server_state["centres"]
            ratio = drift_ratio(local, [start[int(old_assign[i])] for i in ids], start)
            extra_metrics = {"fesem_drift_ratio": ratio}
        centres, assign = fesem_step(local, start)
        new_assign = old_assign.clone()
        new_assign[torch.as_tensor(ids)] = assign
        moved = int(((new_assign != old_assign) & (old_assign >= 0)).sum())
        sizes = torch.bincount(new_assign[new_assign >= 0], minlength=self.params.num_clusters)
        metrics = {"fesem_moved": float(moved), "fesem_largest_cluster": float(sizes.max())}
        if not extra:
            metrics.update(extra_metrics)
        return {"centres": centres, "assign": new_assign, **extra}, metrics

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(payload["model"].tensors)
        logits, _ = forward_all(model, data.x_test)
        out = {"test_acc": device_accuracy(logits.argmax(1), data.y_test)}
        k = int(payload["cluster"]["k"][0])
        if k >= 0:  # a client the warm start has not assigned yet reports no cluster
            out["cluster"] = float(k)
        return out
