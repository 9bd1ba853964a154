"""FedKD — communication-efficient federated learning via knowledge distillation (Wu et al., Nature Communications
2022), in HtFLlib's form (reference §6.11, [HT:clientkd.py, serverkd.py]).

Each client keeps a private mentor (its own architecture), a shared mentee (one architecture for all: client 0's)
and a linear map W_h (mentee embedding -> mentor embedding, no bias). Per batch, with h / h_g the mentor / mentee
embeddings and z / z_g their logits:
  L_mentor = CE(z) + KL(p_g || p)/(CE + CE_g) + MSE(h, W_h h_g)/(CE + CE_g)
  L_mentee = CE_g + KL(p || p_g)/(CE + CE_g) + MSE(h, W_h h_g)/(CE + CE_g)
and, as HtFLlib, the gradient of L_mentor + L_mentee reaches all three parts (no detaching), each clipped at norm 10,
one optimiser step each (KL ``batchmean``). Only the mentee travels, compressed: each weight matrix (conv kernels
flattened to out x rest) by truncated SVD keeping the fewest singular values whose energy sum sigma^2 exceeds the
fraction T(t) = T_start + (t / R)(T_end - T_start) (R = ``ramp_rounds``, default the run's rounds) (at least one; biases and vectors raw). The server reconstructs
the uploads, averages them with sample-count weights and sends the average back compressed the same way.
Deviations, stated: HtFLlib runs np.linalg.svd on 4-d conv weights directly (a batched SVD over the kernel's last two
axes) and can keep zero singular values; we flatten kernels to matrices and keep at least one. Optimiser: the run's
(``train``) for all three parts (HtFLlib: SGD, mentee lr 0.01 — ``mentee_lr`` sets it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from algorithms.fedavg import sample_counts
from algorithms.fml import shared_model
from algorithms.mutual_maths import domain_metrics, step_batches
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.messages import Message
from raysim.shared_maths import weighted_average_states
from raysim.training import clone_state, make_optimizer, optimizer_state


def svd_keep(s: torch.Tensor, energy: float) -> int:
    """The fewest leading singular values whose squared sum exceeds ``energy`` x the total (at least 1)."""
    sq = s.double() ** 2
    total = float(sq.sum())
    if total == 0.0:
        return 1
    cum = torch.cumsum(sq, 0)
    hit = torch.nonzero(cum > energy * total).flatten()
    return max(1, int(hit[0]) + 1) if len(hit) else len(s)


def compress(state: dict, energy: float) -> Message:
    """A state dict as a message: matrices (kernels flattened) as truncated SVD factors u*s, v; the rest raw."""
    t = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() > 1 and v.shape[0] > 1:
            m = v.detach().reshape(v.shape[0], -1).double()
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            r = svd_keep(s, energy)
            t[f"{k}|us"] = (u[:, :r] * s[:r]).float().cpu()
            t[f"{k}|v"] = vh[:r].float().cpu()
        else:
            t[k] = v.detach().clone().cpu()
    return Message("compressed_weights", t)


def decompress(msg: Message, like: dict) -> dict:
    out = {}
    for k, v in like.items():
        if f"{k}|us" in msg.tensors:
            out[k] = (msg[f"{k}|us"].double() @ msg[f"{k}|v"].double()).to(v.dtype).reshape(v.shape)
        else:
            out[k] = msg[k].clone()
    return out


class FedKD(Algorithm):
    name = "fedkd"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = ("Wu et al., Communication-efficient federated learning via knowledge distillation, Nature "
             "Communications 2022 (HtFLlib's FedKD)")
    uploads = frozenset({"compressed_weights", "num_samples"})

    @dataclass(frozen=True)
    class Params:
        t_start: float = 0.95
        t_end: float = 0.98
        mentee_lr: Optional[float] = None  # None: train.lr
        clip: float = 10.0
        ramp_rounds: Optional[int] = None  # R of the energy schedule; None: the run's rounds (then extending a
        #                                    finished run by resume changes the schedule of its earlier rounds)

        def check(self, path):
            if self.ramp_rounds is not None:
                positive(f"{path}.ramp_rounds", self.ramp_rounds)
            for k in ("t_start", "t_end"):
                v = getattr(self, k)
                if not 0.0 < v <= 1.0:
                    raise ConfigError(f"{path}.{k}", f"must be in (0, 1], got {v}")
            if self.mentee_lr is not None:
                positive(f"{path}.mentee_lr", self.mentee_lr)
            positive(f"{path}.clip", self.clip)

    def energy(self, round_idx: int) -> float:
        p = self.params
        r = p.ramp_rounds or self.task.rounds
        return p.t_start + (min(max(round_idx, 0), r) / max(r, 1)) * (p.t_end - p.t_start)

    def init_server_state(self, ctx: Context):
        return {"mentee": clone_state(self.task.build_model(0))}

    def broadcast(self, server_state, ctx: Context):
        return {"mentee": compress(server_state["mentee"], self.energy(ctx.round_idx))}

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        like = server_state["mentee"]
        states = [decompress(uploads[i]["mentee"], like) for i in ids]
        return {"mentee": weighted_average_states(states, sample_counts(uploads, ids))}, {"energy": self.energy(ctx.round_idx)}

    def init_client_state(self, ctx: Context):
        model = self.task.build_model(ctx.client_id)
        g = self.task.build_model(0)
        w = nn.Linear(g.embed_dim, model.embed_dim, bias=False)
        return {"model": clone_state(model), "w_h": clone_state(w), "opt": {}, "opt_g": {}, "opt_w": {}}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg, p = self.task.train, self.params
        model = ctx.model()
        model.load_state_dict(state["model"])
        mentee = shared_model(self.task, ctx)
        mentee.load_state_dict(decompress(payload["mentee"], mentee.state_dict()))
        with rngmod.keep_global_rng():  # its weights are loaded below
            w_h = nn.Linear(mentee.embed_dim, model.embed_dim, bias=False).to(ctx.device)
        w_h.load_state_dict(state["w_h"])
        keep = cfg.persist_optimizer
        opt = make_optimizer(model.parameters(), cfg, state=state["opt"] if keep else None, model=model)
        opt_g = make_optimizer(mentee.parameters(), cfg, p.mentee_lr, state["opt_g"] if keep else None, mentee)
        opt_w = make_optimizer(w_h.parameters(), cfg, state=state["opt_w"] if keep else None, model=w_h)
        for m in (model, mentee):
            m.train()
        tot, steps = {"loss": 0.0, "loss_mentee": 0.0}, 0
        for idx in step_batches(data.num_train, cfg, ctx.generator("batches")):
            idx = idx.to(data.y_train.device)
            xb, yb = data.x_train[idx], data.y_train[idx]
            z, h = model(xb, return_embedding=True)
            z_g, h_g = mentee(xb, return_embedding=True)
            ce, ce_g = F.cross_entropy(z, yb), F.cross_entropy(z_g, yb)
            norm = ce + ce_g
            l_h = F.mse_loss(h, w_h(h_g)) / norm
            loss = ce + F.kl_div(F.log_softmax(z, 1), F.softmax(z_g, 1), reduction="batchmean") / norm + l_h
            loss_g = ce_g + F.kl_div(F.log_softmax(z_g, 1), F.softmax(z, 1), reduction="batchmean") / norm + l_h
            for o in (opt, opt_g, opt_w):
                o.zero_grad(set_to_none=True)
            (loss + loss_g).backward()
            for m in (model, mentee, w_h):
                torch.nn.utils.clip_grad_norm_(m.parameters(), p.clip)
            for o in (opt, opt_g, opt_w):
                o.step()
            tot["loss"] += float(loss.detach())
            tot["loss_mentee"] += float(loss_g.detach())
            steps += 1
        new = {"model": clone_state(model), "w_h": clone_state(w_h),
               "opt": optimizer_state(opt, model) if keep else {}, "opt_g": optimizer_state(opt_g, mentee) if keep else {},
               "opt_w": optimizer_state(opt_w, w_h) if keep else {}}
        up = {"mentee": compress(mentee.state_dict(), self.energy(ctx.round_idx)),
              "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return ClientUpdate(new, up, {f"train_{k}": v / max(steps, 1) for k, v in tot.items()})

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        return domain_metrics(model, data)
