"""FedDistill / FD (Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", arXiv 1811.11479), in HtFLlib's heterogeneous form (reference §6.9).

Clients upload per-class mean logits, accumulated over their training batches (train mode, as HtFLlib); the server
takes, per class, the plain mean over the clients that hold it (keeping earlier values for classes nobody uploaded
this round) and sends the C x C table back. Local loss: CE(f(x), y) + lambda * T^2 * KL(softmax(l_y / T) ||
softmax(f(x) / T)). Deviation, documented: HtFLlib feeds the raw averaged logits as a target to CrossEntropyLoss; we
use the softmax of them as a proper soft target. Only logits cross the wire, so client models may differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.prototype_maths import class_mean_logits, distill_loss
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.config import positive
from raysim.messages import Message
from raysim.training import clone_state, device_accuracy, forward_all, train_epochs, TrainOptions


class FedDistill(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    uploads = frozenset({"class_logits"})

    name = "feddistill"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "personalised"}
    paper = ("Jeong et al., Communication-Efficient On-Device Machine Learning: Federated Distillation and "
             "Augmentation under Non-IID Private Data, arXiv:1811.11479, 2018 (HtFLlib's FD)")

    @dataclass(frozen=True)
    class Params:
        lam: float = 1.0
        temperature: float = 1.0

        def check(self, path):
            positive(f"{path}.lam", self.lam, allow_zero=True)
            positive(f"{path}.temperature", self.temperature)

    def init_server_state(self, ctx: Context):
        c = self.task.num_classes
        return {"logits": torch.zeros(c, c), "mask": torch.zeros(c, dtype=torch.bool)}

    def broadcast(self, server_state, ctx: Context):
        mask = server_state["mask"]
        if not bool(mask.any()):
            return {}
        classes = torch.nonzero(mask).flatten()
        return {"global_logits": Message("global_logits", {"logits": server_state["logits"][classes].clone(),
                                                           "classes": classes})}

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        c = self.task.num_classes
        num = torch.zeros(c, c, dtype=torch.float64)
        den = torch.zeros(c, dtype=torch.float64)
        for i in ids:
            m = uploads[i]["logits"]
            num.index_add_(0, m["classes"], m["logits"].to(torch.float64))
            den.index_add_(0, m["classes"], torch.ones(len(m["classes"]), dtype=torch.float64))
        got = den > 0
        logits = server_state["logits"].clone()
        logits[got] = (num[got] / den[got].unsqueeze(1)).to(logits.dtype)
        return {"logits": logits, "mask": server_state["mask"] | got}, {}

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.load_state_dict(state["model"])
        c = self.task.num_classes
        dev = data.y_train.device
        glob = torch.zeros(c, c, device=dev)
        mask = torch.zeros(c, dtype=torch.bool, device=dev)
        if "global_logits" in payload:
            cl = payload["global_logits"]["classes"].to(dev)
            glob[cl] = payload["global_logits"]["logits"].to(dev)
            mask[cl] = True
        sums = torch.zeros(c, c, dtype=torch.float64)
        counts = torch.zeros(c, dtype=torch.int64)
        lam, temp = self.params.lam, self.params.temperature

        def loss_fn(m, xb, yb, epoch):
            nonlocal sums, counts
            logits = m(xb)
            s, n = class_mean_logits(logits, yb, c)
            sums, counts = sums + s, counts + n
            ce = F.cross_entropy(logits, yb)
            if lam == 0 or not bool(mask.any()):
                return ce, {"ce": ce.detach(), "distill": 0.0}
            kd = distill_loss(logits, yb, glob, mask, temp)
            return ce + lam * kd, {"ce": ce.detach(), "distill": kd.detach()}

        metrics = train_epochs(model, data.x_train, data.y_train, TrainOptions(
            self.task.train, ctx.generator("batches"), ctx.generator("dropout", device=ctx.device)), loss_fn)
        classes = torch.nonzero(counts).flatten()
        means = (sums[classes] / counts[classes].unsqueeze(1).to(torch.float64)).to(torch.float32)
        upload = {"logits": Message("class_logits", {"logits": means, "classes": classes})}
        return ClientUpdate({"model": clone_state(model)}, upload, metrics)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        logits, _ = forward_all(model, data.x_test)
        return {"test_acc": device_accuracy(logits.argmax(1), data.y_test)}
