"""FedAvg (McMahan et al., AISTATS 2017): clients train the global model locally, the server averages the
uploaded weights with sample-count weights: w = sum_i (n_i / sum n) w_i.

Options ``positive_rate`` / ``pu_weight``: the FedPU positive-unlabelled setting and loss (algorithms/fedpu.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms import fedpu
from algorithms.local import ce_loss
from algorithms.mutual_ops import domain_metrics
from raysim.algorithm import Context, LocalStart, LocalTraining
from raysim.messages import Message, state_message
from raysim.ops import weighted_average_states
from raysim.training import accuracy, clone_state, forward_all


def sample_counts(uploads, ids) -> list[int]:
    """n_i of each upload's ``num_samples`` message (FedAvg's weights), in ``ids`` order."""
    return [int(uploads[i]["num_samples"]["n"][0]) for i in ids]


def sample_weighted_average(uploads, ids, key: str = "model") -> dict:
    """FedAvg's rule over the state messages ``uploads[i][key]``: sum_i (n_i / sum n) w_i."""
    return weighted_average_states([uploads[i][key].tensors for i in ids], sample_counts(uploads, ids))


class FedAvg(LocalTraining):
    needs_embedding = False  # logits and whole state dicts only: any user model will do

    def declared_uploads(self):
        return {"weights", "num_samples"}

    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"

    @dataclass(frozen=True)
    class Params:
        positive_rate: float = 1.0  # FedPU: share of each positive class's samples that keep their label
        pu_weight: float = 1.0  # FedPU: weight of the PU loss (only active when positive_rate < 1)
        pu_split: str = "seed"  # FedPU: seed (labelled_classes of the held classes; rate 1 = all) | official | held
        labelled_classes: int = 2  # FedPU seed/official split: positive classes per client (seeded subset; 0 = all)
        pu_min_class: int = 40  # FedPU seed/official split: a positive class keeps labels only with >= this many

        def check(self, path):
            fedpu.check_params(path, self.positive_rate, self.pu_weight, self.pu_split, self.labelled_classes,
                               self.pu_min_class)

    def validate(self):
        self.require_homogeneous()

    def init_server_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(0))}

    def broadcast(self, server_state, ctx: Context):
        return {"model": state_message("weights", server_state["model"])}

    def pu_view(self, data):
        return fedpu.make_view(data, self.task.num_classes, self.params.positive_rate, self.task.seed,
                             self.params.pu_split, self.params.labelled_classes, self.params.pu_min_class)

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(payload["model"].tensors)
        view = self.pu_view(data)
        # unlabelled samples carry UNLABELLED, not their label
        return LocalStart(y=None if view is None else view.y_obs, aux={"view": view, "global": payload["model"].tensors})

    def objective(self, start: LocalStart):
        view = start.aux["view"]
        return ce_loss if view is None else fedpu.pu_ce_loss(view, self.params.pu_weight)

    def vectorizable(self, start: LocalStart) -> bool:
        return start.aux["view"] is None  # FedPU's view is per client (its own prior and positive classes)

    def client_final(self, model, start, payload, state, data, ctx: Context):
        upload = {"model": state_message("weights", model.state_dict()),
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return state, upload

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        return {"model": sample_weighted_average(uploads, ids)}, {}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(payload["model"].tensors)
        # test_acc on the client's test split; with data.local_split also the seed-003 metrics bwt / fwt / acc_all
        return domain_metrics(model, data)

    def evaluate_server(self, server_state, test, ctx: Context) -> dict:
        model = ctx.model(0)
        model.load_state_dict(server_state["model"])
        logits, _ = forward_all(model, test.x.to(ctx.device))
        return {"global_test_acc": accuracy(logits.argmax(1), test.y.to(ctx.device))}
