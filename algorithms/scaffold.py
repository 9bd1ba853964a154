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
from raysim.messages import Message, Rows, rows_of, stacked_segments, state_message
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


def sum64(trees: list, name: str, like: torch.Tensor) -> torch.Tensor:
    """sum_i trees[i][name] in float64: one client after another, or, for a vectorised group's uploads (rows of its
    stacks, :class:`raysim.messages.Rows`), one reduction per stack (the same sum, its terms added in another order)."""
    segments = stacked_segments(trees)
    if segments is None:
        acc = torch.zeros_like(like, dtype=torch.float64)
        for d in trees:
            acc += d[name].to(torch.float64)
        return acc
    acc = None
    for stacks, rows in segments:
        t = stacks[name]
        t = t if rows == list(range(t.shape[0])) else t[torch.as_tensor(rows, device=t.device)]
        part = t.to(torch.float64).sum(0)
        acc = part if acc is None else acc + part
    return acc


def server_update(x: dict, c: dict, delta_y: list, delta_c: list, num_clients: int, server_lr: float):
    """x + lr_g * mean(delta_y) (float entries of x); c + sum(delta_c) / N. Returns (x, c) as new dicts."""
    new_x = {}
    for n, v in x.items():
        if v.is_floating_point() and n in delta_y[0]:
            acc = sum64(delta_y, n, v)
            new_x[n] = (v.to(torch.float64) + server_lr * acc / len(delta_y)).to(v.dtype)
        else:
            new_x[n] = v.clone()
    new_c = {}
    for n, v in c.items():
        acc = sum64(delta_c, n, v)
        new_c[n] = (v.to(torch.float64) + acc / num_clients).to(v.dtype)
    return new_x, new_c


def corrected(loss: torch.Tensor, model, correction) -> torch.Tensor:
    """``loss`` whose gradient is corrected by ``correction`` (c - c_i, per parameter name) and whose value is
    ``loss``'s: d/dy <c - c_i, y> = c - c_i (the linear term is not a loss value)."""
    lin = sum((correction(n).detach() * p).sum() for n, p in model.named_parameters())
    return loss + lin - lin.detach()


class Scaffold(FedAvg):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "scaffold"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"

    uploads = frozenset({"model_delta", "control_delta"})

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
        c = {n: v.to(ctx.device) for n, v in payload["control"].tensors.items()}
        c_i = (state or {}).get("control")
        if c_i is None:
            c_i = {n: torch.zeros_like(v) for n, v in c.items()}
        elif not (isinstance(c_i, Rows) and all(t.device == torch.device(ctx.device) for t in c_i.stacks.values())):
            c_i = {n: v.to(ctx.device) for n, v in c_i.items()}  # (rows of a vectorised group's stacks stay rows)
        # the global weights are the start (loaded by whoever runs the step: LocalStart.weights); c_i is the
        # objective's per-client input (the vectorised executor stacks a group's)
        return LocalStart(aux={"c": c, "c_i": c_i}, weights=payload["model"].tensors, rows={"c_i": c_i})

    def objective(self, start: LocalStart):
        c, c_i = start.aux["c"], start.aux["c_i"]
        corr = {n: c[n] - c_i[n] for n in c}

        def loss_fn(model, xb, yb, epoch):
            loss, parts = ce_loss(model, xb, yb, epoch)
            # the corrected gradient g + c - c_i; the value stays the CE loss
            return corrected(loss, model, corr.__getitem__), parts

        return loss_fn

    def row_objective(self, start: LocalStart):
        """The objective with the client's c_i as its rows (a vectorised group): c - c_i per parameter on each
        call, the same element-wise difference the per-client objective takes once."""
        c = start.aux["c"]

        def loss_fn(model, xb, yb, epoch, rows):
            c_i = rows["c_i"]
            loss, parts = ce_loss(model, xb, yb, epoch)
            return corrected(loss, model, lambda n: c[n] - c_i[n]), parts

        return loss_fn

    def vectorizable(self, start: LocalStart) -> bool:
        return True  # the correction's per-client part, c_i, is the objective's rows

    def client_final_group(self, group):
        """client_final for a vectorised group trained from one broadcast: the control update, both deltas and the
        new c_i as [K, ...] stacks (the per-client arithmetic, element for element), each client's state and upload
        rows of them."""
        if type(self).client_final is not Scaffold.client_final or "c_i" not in group.rows:
            return None
        first = group.payloads[0]
        if any(p["model"] is not first["model"] or p["control"] is not first["control"] for p in group.payloads):
            return None
        cfg = self.task.train
        m = cfg.momentum if cfg.optimizer == "sgd" else 0.0
        divs = [effective_steps(cfg.local_epochs * math.ceil(d.num_train / cfg.batch_size), m) * cfg.lr
                for d in group.datas]
        y = group.state_stacks()
        x = {n: v.to(next(iter(y.values())).device) for n, v in first["model"].tensors.items()}
        c, c_i = group.starts[0].aux["c"], group.rows["c_i"]

        def scaled(t):  # t / (K_eff * lr) per client: one Python divisor when all are equal (as the loop divides)
            if len(set(divs)) == 1:
                return t / divs[0]
            return t / torch.tensor(divs, dtype=t.dtype, device=t.device).view(-1, *([1] * (t.dim() - 1)))

        c_new = {n: c_i[n] - c[n] + scaled(x[n] - y[n]) for n in c}
        delta_y = {n: y[n] - x[n] for n in y if y[n].is_floating_point()}
        delta_c = {n: c_new[n] - c_i[n] for n in c_new}
        return [({**(state or {}), "control": cn}, {"delta_y": Message("model_delta", dy),
                                                    "delta_c": Message("control_delta", dc)})
                for state, cn, dy, dc in zip(group.states, rows_of(c_new), rows_of(delta_y), rows_of(delta_c))]

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
