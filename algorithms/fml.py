"""FML — Federated Mutual Learning (Shen et al., arXiv 2006.16765), in HtFLlib's form (reference §6.10,
[HT:clientfml.py, serverfml.py]).

Each client keeps a private model (its own architecture) and a shared "meme" model (one architecture for all: client
0's), trained together on each batch:
L_local = alpha CE(local) + (1 - alpha) KL(p_meme || p_local), L_meme = beta CE(meme) + (1 - beta) KL(p_local || p_meme)
(each KL against the other model's detached output, ``batchmean``; HtFLlib's ``nn.KLDivLoss()`` averages over
elements — the pitfall noted in the reference), gradient norms clipped at 10. Only the meme travels: the server
averages the uploaded memes with equal weights and sends the mean back. Defaults alpha = beta = 0.5 (HtFLlib's
total.sh). A round is ``train.local_steps`` steps (or ``local_epochs``) with the run's optimiser for both models (state
kept across rounds with ``train.persist_optimizer``); the private model is evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.mutual_maths import domain_metrics, step_batches
from raysim.algorithm import Algorithm, ClientUpdate, Context
from raysim.errors import ConfigError
from raysim.messages import state_message
from raysim.shared_maths import weighted_average_states
from raysim.training import clone_state, make_optimizer, optimizer_state


def kl(student_logits, teacher_logits):
    """KL(softmax(teacher) || softmax(student)), the teacher detached, averaged over the batch."""
    return F.kl_div(F.log_softmax(student_logits, dim=1), F.softmax(teacher_logits.detach(), dim=1),
                    reduction="batchmean")


def shared_model(task, ctx):
    """The runner's live module for the shared (meme / mentee) model (client 0's architecture), separate from the
    private model's."""
    return ctx.models.get("shared", lambda: task.build_model(0))


class FML(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "fml"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = "Shen et al., Federated Mutual Learning, arXiv:2006.16765, 2020 (HtFLlib's FML)"
    uploads = frozenset({"weights"})

    @dataclass(frozen=True)
    class Params:
        alpha: float = 0.5
        beta: float = 0.5
        clip: float = 10.0

        def check(self, path):
            for k in ("alpha", "beta"):
                v = getattr(self, k)
                if not 0.0 <= v <= 1.0:
                    raise ConfigError(f"{path}.{k}", f"must be in [0, 1], got {v}")
            if self.clip <= 0:
                raise ConfigError(f"{path}.clip", f"must be > 0, got {self.clip}")

    def init_server_state(self, ctx: Context):
        return {"meme": clone_state(self.task.build_model(0))}

    def broadcast(self, server_state, ctx: Context):
        return {"meme": state_message("weights", server_state["meme"])}

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        return {"meme": weighted_average_states([uploads[i]["meme"].tensors for i in ids], [1] * len(ids))}, {}

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id)), "opt": {}, "opt_meme": {}}

    def client_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg, p = self.task.train, self.params
        model = ctx.model()
        model.load_state_dict(state["model"])
        meme = shared_model(self.task, ctx)
        meme.load_state_dict(payload["meme"].tensors)
        keep = cfg.persist_optimizer
        opt = make_optimizer(model.parameters(), cfg, state=state["opt"] if keep else None, model=model)
        opt_m = make_optimizer(meme.parameters(), cfg, state=state["opt_meme"] if keep else None, model=meme)
        model.train()
        meme.train()
        tot, steps = {"loss": 0.0, "loss_meme": 0.0}, 0
        for idx in step_batches(data.num_train, cfg, ctx.generator("batches")):
            idx = idx.to(data.y_train.device)
            xb, yb = data.x_train[idx], data.y_train[idx]
            out, out_m = model(xb), meme(xb)
            loss = p.alpha * F.cross_entropy(out, yb) + (1 - p.alpha) * kl(out, out_m)
            loss_m = p.beta * F.cross_entropy(out_m, yb) + (1 - p.beta) * kl(out_m, out)
            opt.zero_grad(set_to_none=True)
            opt_m.zero_grad(set_to_none=True)
            loss.backward()
            loss_m.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), p.clip)
            torch.nn.utils.clip_grad_norm_(meme.parameters(), p.clip)
            opt.step()
            opt_m.step()
            tot["loss"] += float(loss.detach())
            tot["loss_meme"] += float(loss_m.detach())
            steps += 1
        new = {"model": clone_state(model), "opt": optimizer_state(opt, model) if keep else {},
               "opt_meme": optimizer_state(opt_m, meme) if keep else {}}
        return ClientUpdate(new, {"meme": state_message("weights", meme.state_dict(keep_vars=True))},
                            {f"train_{k}": v / max(steps, 1) for k, v in tot.items()})

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        return domain_metrics(model, data)
