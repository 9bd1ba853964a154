"""FedMD — heterogeneous federated learning via model distillation (Li & Wang, arXiv 1910.03581), reference §4.5
[FMD:FedMD.py, conf/EMNIST_balance_conf.json], on MAFML's setting: the public dataset is every node's public share
(``data.local_split``), the private data each node's private + own public samples (``x_train``).

Setup (round -1, ``transfer``): transfer learning — each model trains on the public dataset, then on its private
data (``transfer_public_epochs`` / ``transfer_private_epochs`` epochs, the run's optimiser and batch size; FedMD's
25 epochs with early stopping are scaled down by these parameters and early stopping is not used). The seed that runs
FedMD (003, MAFML) gives no FedMD settings, so this stays the default; ``transfer_schedule: paper`` (issue 51) runs
FedMD's own schedule instead [FMD:FedMD.py]: up to ``transfer_max_epochs`` (25) epochs on the public data, then up to
25 on the private data, each phase stopped early on the node's own validation split (``data.x_val``) as Keras's
``EarlyStopping(monitor="val_accuracy", min_delta=0.001, patience=10)`` does it: stop once ``transfer_patience``
epochs in a row fail to beat the best validation accuracy by more than ``transfer_min_delta``; the weights of the last
epoch are kept (Keras's default, ``restore_best_weights=False``). The epochs each phase ran are the setup metrics
``transfer_public_epochs_run`` / ``transfer_private_epochs_run``.
Round t: (1) the server draws an alignment set of ``n_alignment`` public samples (stream (seed, t, server, "align");
all of them when the public dataset is smaller) and sends its indices; (2) ``logits``: each node uploads its logits on
it; the server averages them over the nodes (the consensus) and sends them back; (3) ``digest``: each node regresses
its logits to the consensus with the mean absolute error, ``digest_epochs`` epochs at batch ``digest_batch``
(FedMD: 1 epoch, 256); (4) revisit: training on its private data for ``train.local_steps`` steps (or
``local_epochs``; FedMD: 2 epochs at batch 5). The digest and revisit optimiser states persist in the client state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.mafml import require_public_shares
from algorithms.mutual_maths import public_shares
from algorithms.mutual_maths import domain_metrics, step_batches
from raysim import rng as rngmod
from raysim.algorithm import Algorithm, ClientUpdate, Context, ServerUpdate
from raysim.config import choice, positive
from raysim.messages import Message
from raysim.steps import ALL, ClientStep, ServerStep
from raysim.training import clone_state, make_optimizer, minibatches, optimizer_state


class FedMD(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "fedmd"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = "Li & Wang, FedMD: Heterogenous Federated Learning via Model Distillation, arXiv:1910.03581, 2019"
    uploads = frozenset({"logits"})

    @dataclass(frozen=True)
    class Params:
        n_alignment: int = 5000
        digest_epochs: int = 1
        digest_batch: int = 256
        transfer_public_epochs: int = 5
        transfer_private_epochs: int = 5
        transfer_schedule: str = "fixed"  # fixed: the epochs above; paper: FedMD's 25 with early stopping (issue 51)
        transfer_max_epochs: int = 25
        transfer_patience: int = 10
        transfer_min_delta: float = 0.001

        def check(self, path):
            for k in ("n_alignment", "digest_epochs", "digest_batch"):
                positive(f"{path}.{k}", getattr(self, k))
            for k in ("transfer_public_epochs", "transfer_private_epochs"):
                positive(f"{path}.{k}", getattr(self, k), allow_zero=True)
            choice(f"{path}.transfer_schedule", self.transfer_schedule, ("fixed", "paper"))
            for k in ("transfer_max_epochs", "transfer_patience"):
                positive(f"{path}.{k}", getattr(self, k))
            positive(f"{path}.transfer_min_delta", self.transfer_min_delta, allow_zero=True)

    def validate(self):
        require_public_shares(self, self.name)

    def setup_schedule(self):
        return (ClientStep("transfer", clients=ALL), ServerStep("setup_done"))

    def schedule(self):
        return (ClientStep("logits", clients=ALL), ServerStep("consensus"),
                ClientStep("digest", clients=ALL), ServerStep("next_round"))

    # -- server -------------------------------------------------------------------------------------------------
    def broadcast(self, server_state, ctx: Context):
        n = len(self.task.public)
        k = min(self.params.n_alignment, n)
        r = rngmod.numpy_rng(self.task.seed, ctx.round_idx, rngmod.SERVER, "align")
        idx = np.sort(r.choice(n, size=k, replace=False)) if k < n else np.arange(n)
        return {"align": Message("alignment_indices", {"idx": torch.as_tensor(idx, dtype=torch.int64)})}

    def setup_done(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        return ServerUpdate(server_state, None)

    def consensus(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        ids = sorted(uploads)
        if not ids:
            return ServerUpdate(server_state, {})
        mean = torch.stack([uploads[i]["logits"]["logits"].double() for i in ids]).mean(0).float()
        idx = uploads[ids[0]]["logits"]["idx"]
        return ServerUpdate(server_state, {"consensus": Message("consensus_logits", {"idx": idx, "logits": mean})})

    def next_round(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        return ServerUpdate(server_state, self.broadcast(server_state, ctx.next_round()))

    # -- client -------------------------------------------------------------------------------------------------
    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id)), "opt": {}, "opt_digest": {}}

    def _ce_epochs(self, model, opt, x, y, epochs, gen):
        cfg = self.task.train
        for _ in range(epochs):
            for idx in minibatches(int(y.shape[0]), cfg.batch_size, gen):
                idx = idx.to(y.device)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()

    def transfer(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg, p = self.task.train, self.params
        model = ctx.model()
        model.load_state_dict(state["model"])
        opt = make_optimizer(model.parameters(), cfg)
        px, py, _ = public_shares(self.task, ctx)
        model.train()
        gen = ctx.generator("batches")
        if p.transfer_schedule == "fixed":
            self._ce_epochs(model, opt, px, py, p.transfer_public_epochs, gen)
            self._ce_epochs(model, opt, data.x_train, data.y_train, p.transfer_private_epochs, gen)
            return ClientUpdate({**state, "model": clone_state(model)}, {})
        if data.y_val is None or int(data.y_val.shape[0]) == 0:
            raise ValueError("fedmd transfer_schedule: paper stops early on the node's validation split; the node has "
                             "none (data.local_split.val or data.val_fraction)")
        runs = {}
        for phase, (x, y) in (("public", (px, py)), ("private", (data.x_train, data.y_train))):
            best, wait, ran = float("-inf"), 0, 0
            for _ in range(p.transfer_max_epochs):
                self._ce_epochs(model, opt, x, y, 1, gen)
                ran += 1
                model.eval()
                with torch.no_grad():
                    acc = float((model(data.x_val).argmax(1) == data.y_val).double().mean())
                model.train()
                if acc - p.transfer_min_delta > best:
                    best, wait = acc, 0
                else:
                    wait += 1
                    if wait >= p.transfer_patience:
                        break
            runs[f"transfer_{phase}_epochs_run"] = float(ran)
        return ClientUpdate({**state, "model": clone_state(model)}, {}, runs)

    def logits(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.load_state_dict(state["model"])
        px, _, _ = public_shares(self.task, ctx)
        idx = payload["align"]["idx"]
        model.eval()
        with torch.no_grad():
            z = model(px[idx.to(px.device)])
        return ClientUpdate(state, {"logits": Message("logits", {"idx": idx.clone(), "logits": z.detach().cpu()})})

    def digest(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg, p = self.task.train, self.params
        model = ctx.model()
        model.load_state_dict(state["model"])
        keep = cfg.persist_optimizer
        model.train()
        metrics = {}
        opt_d = make_optimizer(model.parameters(), cfg, state=state["opt_digest"] if keep else None, model=model)
        if "consensus" in payload:
            px, _, _ = public_shares(self.task, ctx)
            x = px[payload["consensus"]["idx"].to(px.device)]
            target = payload["consensus"]["logits"].to(ctx.device)
            gen = ctx.generator("digest")
            tot, n = 0.0, 0
            for _ in range(p.digest_epochs):
                for idx in minibatches(int(target.shape[0]), p.digest_batch, gen):
                    idx = idx.to(target.device)
                    opt_d.zero_grad(set_to_none=True)
                    loss = F.l1_loss(model(x[idx]), target[idx])
                    loss.backward()
                    opt_d.step()
                    tot, n = tot + float(loss.detach()), n + 1
            metrics["train_digest_mae"] = tot / max(n, 1)
        opt = make_optimizer(model.parameters(), cfg, state=state["opt"] if keep else None, model=model)
        tot, n = 0.0, 0
        for idx in step_batches(data.num_train, cfg, ctx.generator("batches")):
            idx = idx.to(data.y_train.device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            opt.step()
            tot, n = tot + float(loss.detach()), n + 1
        metrics["train_loss"] = tot / max(n, 1)
        new = {"model": clone_state(model), "opt": optimizer_state(opt, model) if keep else {},
               "opt_digest": optimizer_state(opt_d, model) if keep else {}}
        return ClientUpdate(new, {}, metrics)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        return domain_metrics(model, data)
