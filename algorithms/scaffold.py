"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020;
reference §6.6, option II of the paper as in PFLlib's clientscaffold.py / serverscaffold.py).

Server state: global model x and server control variate c. Client state: its control variate c_i (zeros before its
first round). Local step: y <- y - lr * (g + c - c_i); realised as the gradient of the linear term <c - c_i, y>
added to the loss, so momentum and weight decay act on the corrected gradient as in PFLlib's SCAFFOLDOptimizer.
After local training (option II):

    c_i+ = c_i - c + (x - y) / (K_eff * lr),   delta_y = y - x,   delta_c = c_i+ - c_i

K_eff is the number of local steps K, corrected for momentum m: the displacement of K momentum-SGD steps under a
constant gradient g is lr * g * sum_{j=1..K} (1 - m^j) / (1 - m), so K_eff = sum_{j=1..K} (1 - m^j) / (1 - m)
(= K for m = 0; with ``train.persist_optimizer`` the carried momentum makes this approximate). Server:
x <- x + lr_g * mean_i delta_y_i (plain mean over the uploads), c <- c + (1/N) sum_i delta_c_i (N = all clients).
Accounting: the download is model + c, the upload delta_y + delta_c: twice FedAvg's traffic each way (models
without buffers; float buffers such as BatchNorm statistics travel in the model messages only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algorithms.fedavg import FedAvg
from algorithms.local import ce_loss
from raysim.algorithm import Context, LocalStart
from raysim.config import positive
from raysim.messages import state_message
from raysim.training import clone_state


def effective_steps(steps: int, momentum: float) -> float:
    """K_eff = sum_{j=1..K} (1 - m^j) / (1 - m): the displacement of K heavy-ball steps under a constant gradient, in
    units of lr * g (K when m = 0)."""
    if momentum == 0.0:
        return float(steps)
    return sum((1.0 - momentum ** j) / (1.0 - momentum) for j in range(1, steps + 1))


def control_update(c_i: dict, c: dict, x: dict, y: dict, k_eff: float, lr: float) -> dict:
    """Option II: c_i+ = c_i - c + (x - y) / (K_eff * lr), per parameter."""
    return {n: c_i[n] - c[n] + (x[n] - y[n]) / (k_eff * lr) for n in c}


def server_update(x: dict, c: dict, delta_y: list, delta_c: list, num_clients: int, server_lr: float):
    """x + lr_g * mean(delta_y) (float entries of x); c + sum(delta_c) / N. Returns (x, c) as new dicts."""
    new_x = {}
    for n, v in x.items():
        if v.is_floating_point() and n in delta_y[0]:
            acc = torch.zeros_like(v, dtype=torch.float64)
            for d in delta_y:
                acc += d[n].to(torch.float64)
            new_x[n] = (v.to(torch.float64) + server_lr * acc / len(delta_y)).to(v.dtype)
        else:
            new_x[n] = v.clone()
    new_c = {}
    for n, v in c.items():
        acc = torch.zeros_like(v, dtype=torch.float64)
        for d in delta_c:
            acc += d[n].to(torch.float64)
        new_c[n] = (v.to(torch.float64) + acc / num_clients).to(v.dtype)
    return new_x, new_c


class Scaffold(FedAvg):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "scaffold"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"

    def declared_uploads(self):
        return {"model_delta", "control_delta"}

    @dataclass(frozen=True)
    class Params:
        server_lr: float = 1.0  # eta_g (PFLlib default 1.0)

        def check(self, path):
            positive(f"{path}.server_lr", self.server_lr)

    def pu_view(self, data):
        return None

    def init_server_state(self, ctx: Context):
        model = self.task.build_model(0)
        return {"model": clone_state(model),
                "control": {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}}

    def broadcast(self, server_state, ctx: Context):
        return {"model": state_message("weights", server_state["model"]),
                "control": state_message("control_variate", server_state["control"])}

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(payload["model"].tensors)
        c = {n: v.to(ctx.device) for n, v in payload["control"].tensors.items()}
        c_i = (state or {}).get("control")
        c_i = {n: torch.zeros_like(v) for n, v in c.items()} if c_i is None else {n: v.to(ctx.device) for n, v in c_i.items()}
        return LocalStart(aux={"c": c, "c_i": c_i, "correction": {n: c[n] - c_i[n] for n in c}})

    def objective(self, start: LocalStart):
        corr = start.aux["correction"]

        def loss_fn(model, xb, yb, epoch):
            loss, parts = ce_loss(model, xb, yb, epoch)
            # d/dy <c - c_i, y> = c - c_i: the corrected gradient g + c - c_i (the term itself is not a loss value)
            lin = sum((corr[n].detach() * p).sum() for n, p in model.named_parameters())
            return loss + lin - lin.detach(), parts  # the value stays the CE loss

        return loss_fn

    def vectorizable(self, start: LocalStart) -> bool:
        return False  # the correction c - c_i is per client

    def client_final(self, model, start, payload, state, data, ctx: Context):
        cfg = self.task.train
        steps = cfg.local_epochs * math.ceil(data.num_train / cfg.batch_size)
        k_eff = effective_steps(steps, cfg.momentum if cfg.optimizer == "sgd" else 0.0)
        x = {n: v.to(ctx.device) for n, v in payload["model"].tensors.items()}
        y = {n: v.detach() for n, v in model.state_dict().items()}
        c_new = control_update(start.aux["c_i"], start.aux["c"], x, y, k_eff, cfg.lr)
        delta_y = {n: y[n] - x[n] for n in y if y[n].is_floating_point()}
        delta_c = {n: c_new[n] - start.aux["c_i"][n] for n in c_new}
        new_state = {**(state or {}), "control": {n: v.detach().cpu().clone() for n, v in c_new.items()}}
        upload = {"delta_y": state_message("model_delta", delta_y),
                  "delta_c": state_message("control_delta", delta_c)}
        return new_state, upload

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        x, c = server_update(server_state["model"], server_state["control"],
                             [uploads[i]["delta_y"].tensors for i in ids], [uploads[i]["delta_c"].tensors for i in ids],
                             self.task.num_clients, self.params.server_lr)
        cnorm = math.sqrt(sum(float((v.to(torch.float64) ** 2).sum()) for v in c.values()))
        return {"model": x, "control": c}, {"control_norm": cnorm}
