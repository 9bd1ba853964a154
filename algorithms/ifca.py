"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh et al., "An Efficient Framework for Clustered Federated
Learning", NeurIPS 2020), following the official code (jichan3751/ifca, ``mnist/train_cluster_mnist.py``; reference
§3.3).

The server keeps K cluster models theta_1..theta_K, initialised independently (differently seeded). Each round every
sampled client downloads all K models, evaluates each on its own training data and picks k(i) = argmin_k loss; it
trains a copy of theta_{k(i)} for ``local_steps`` (tau) full-batch gradient steps with learning rate ``lr`` (plain
gradient descent, as the official ``local_param_update``) and uploads it with its choice. The server averages the
returned models within each cluster, with equal weights as the official ``global_param_update``; a cluster nobody
chose keeps its model. IFCA's Rotated-MNIST defaults: MLP 784-200-10 (``model.arch: mlp1``), tau = 10, lr 0.1, K = 4.
With ``local_steps: 0`` the client instead runs ``train.local_epochs`` minibatch epochs of the train config.

Evaluation: the client again picks the lowest-loss model on its *training* data (``eval_assign: train``; the official
code picks on the test machine's test data, which uses test labels: ``eval_assign: test`` reproduces that) and
reports its test accuracy and the choice (``cluster``, for the ARI). Users download K models every round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.local import ce_loss
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.config import ConfigError, choice, positive
from raysim.messages import Message, state_message
from raysim.models import set_dropout_generator
from raysim.ops import weighted_average_states
from raysim.training import accuracy, clone_state, forward_all, train_epochs


@torch.no_grad()
def model_losses(model, states: list, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each model state on (x, y), in eval mode."""
    out = []
    for s in states:
        model.load_state_dict(s)
        logits, _ = forward_all(model, x)
        out.append(float(F.cross_entropy(logits, y)))
    return torch.tensor(out, dtype=torch.float64)


def choose_cluster(losses: torch.Tensor) -> int:
    """IFCA's estimate: argmin_k loss (ties: the lower k, as np.argmin)."""
    return int(torch.argmin(losses))


def cluster_average(states: list, choices: list[int], centres: list) -> list:
    """Per-cluster plain average of the returned models; a cluster nobody chose keeps its model."""
    out = []
    for k, old in enumerate(centres):
        members = [s for s, c in zip(states, choices) if c == k]
        out.append(weighted_average_states(members, [1.0] * len(members)) if members else old)
    return out


class IFCA(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "ifca"
    paper = "Ghosh et al., An Efficient Framework for Clustered Federated Learning, NeurIPS 2020"

    def declared_uploads(self):
        return {"weights", "cluster_id"}

    @dataclass(frozen=True)
    class Params:
        num_clusters: int = 4
        local_steps: int = 10  # tau full-batch gradient steps (0: train.local_epochs minibatch epochs instead)
        lr: float = 0.1  # the full-batch steps' learning rate (IFCA's); minibatch epochs use train.lr
        eval_assign: str = "train"  # the data a client picks its model on at test time: train | test (official)

        def check(self, path):
            positive(f"{path}.num_clusters", self.num_clusters)
            positive(f"{path}.local_steps", self.local_steps, allow_zero=True)
            positive(f"{path}.lr", self.lr)
            choice(f"{path}.eval_assign", self.eval_assign, ["train", "test"])

    def validate(self):
        self.require_homogeneous()
        if self.params.num_clusters > self.task.num_clients:
            raise ConfigError("algorithm.params.num_clusters", f"must be <= data.num_clients ({self.task.num_clients}), "
                                                               f"got {self.params.num_clusters}")

    def init_server_state(self, ctx: Context):
        models = []
        for k in range(self.params.num_clusters):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rngmod.derive_seed(self.task.seed, rngmod.NO_ROUND, rngmod.SERVER, f"ifca_model_{k}"))
                models.append(clone_state(self.task.build_model(0)))
        return {"models": models}

    def broadcast(self, state, ctx: Context):
        return {f"model_{k}": state_message("weights", m) for k, m in enumerate(state["models"])}

    def _models(self, payload) -> list:
        return [payload[f"model_{k}"].tensors for k in range(self.params.num_clusters)]

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        states = self._models(payload)
        losses = model_losses(model, states, data.x_train, data.y_train)
        k = choose_cluster(losses)
        model.load_state_dict(states[k])
        p = self.params
        if p.local_steps > 0:
            opt = torch.optim.SGD(model.parameters(), lr=p.lr)
            set_dropout_generator(model, ctx.generator("dropout", device=ctx.device))
            try:
                model.train()
                total = 0.0
                for _ in range(p.local_steps):
                    opt.zero_grad(set_to_none=True)
                    loss, _ = ce_loss(model, data.x_train, data.y_train)
                    loss.backward()
                    opt.step()
                    total += float(loss.detach())
            finally:
                set_dropout_generator(model, None)
            metrics = {"train_loss": total / p.local_steps}
        else:
            metrics = train_epochs(model, data.x_train, data.y_train, self.task.train, ctx.generator("batches"),
                                   ce_loss, dropout_generator=ctx.generator("dropout", device=ctx.device))
        metrics["cluster_loss"] = float(losses[k])
        upload = {"model": state_message("weights", model.state_dict()),
                  "cluster": Message("cluster_id", {"k": torch.tensor([k])})}
        return ClientUpdate(state, upload, metrics)

    def aggregate(self, state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return state, {}
        choices = [int(uploads[i]["cluster"]["k"][0]) for i in ids]
        models = cluster_average([uploads[i]["model"].tensors for i in ids], choices, state["models"])
        sizes = torch.bincount(torch.as_tensor(choices), minlength=self.params.num_clusters)
        return {"models": models}, {"largest_cluster": float(sizes.max()), "clusters_used": float((sizes > 0).sum())}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        states = self._models(payload)
        x, y = (data.x_train, data.y_train) if self.params.eval_assign == "train" else (data.x_test, data.y_test)
        k = choose_cluster(model_losses(model, states, x, y))
        model.load_state_dict(states[k])
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": accuracy(logits.argmax(1), data.y_test), "cluster": float(k)}
