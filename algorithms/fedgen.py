"""FedGen (Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021;
reference §6.8, after the official zhuangdizhu/FedGen code: serverpFedGen.py, userpFedGen.py, generator.py).

Server (on the server runner, in ``aggregate``): FedAvg of the uploaded models (sample-count weights), then
``gen_steps`` Adam steps on a label-conditioned generator G(eps, y) -> latent z (the model's embedding, size d;
eps ~ U[0, 1) as the official code draws it; MLP noise+one-hot -> hidden -> BN -> ReLU -> d) with

    L_G = mean_batch sum_k w_{y,k} CE(h_k(G(eps, y)), y) + eta * exp(-mean_{a,b} ||eps_a - eps_b||^2 * |z_a - z_b|_1)

h_k the classifier head of client k's uploaded model, w_{y,k} = n_{k,y} / sum_k' n_{k',y} (label counts uploaded as
int64), labels drawn uniformly from those some uploader holds. The generator persists in the server state and is
broadcast every round with the model (downloaded each round, accounted each round).

Client (from the second round, once a generator exists): CE(x, y) + (B_gen / B) * alpha * CE(h(G(eps, y_hat)), y_hat)
+ beta * KL(softmax(h(G(eps, y))) || p(x)) with y_hat drawn from the client's own labels (official
``available_labels``), G frozen in eval mode; alpha = beta = 10 decayed by 0.98 per round (official MNIST settings).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms import generative_maths
from algorithms.fedavg import FedAvg, sample_weighted_average
from algorithms.generators import FeatureGenerator
from raysim import rng as rngmod
from raysim.algorithm import Context, LocalStart
from raysim.config import positive
from raysim.messages import state_message
from raysim.training import OptimizerSpec, clone_state, make_optimizer


def fedgen_diversity(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """exp(-mean over pairs (a, b) of mean((eps_a - eps_b)^2) * mean(|z_a - z_b|)) (official DiversityLoss, l1 on
    the layer, l2 on the noise)."""
    nd = ((eps.unsqueeze(1) - eps.unsqueeze(0)) ** 2).mean(dim=2)
    zd = (z.unsqueeze(1) - z.unsqueeze(0)).abs().mean(dim=2)
    return torch.exp(-(nd * zd).mean())


def ensemble_loss(logits_per_client: list, weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """mean over the batch of sum_k w_{y,k} CE(logits_k, y); weights (K x C) with columns summing to 1."""
    total = torch.zeros(y.shape[0], device=y.device)
    for k, logits in enumerate(logits_per_client):
        total = total + weights[k, y] * F.cross_entropy(logits, y, reduction="none")
    return total.mean()


class ServerGenerator:
    """What both FedGens (this module's and :mod:`algorithms.fedgen_ht`) share, written once: the server's
    label-conditioned feature generator G(eps, y) -> z (z of the embedding's size; the method's ``hidden`` and
    ``noise_dim``), its seeded initial weights, its training round on the server, and the clients' training-label
    counts uploaded beside their weights. Put before the method's base class."""

    def make_generator(self) -> FeatureGenerator:
        p = self.params
        return FeatureGenerator(self.task.num_classes, self.task.build_model(0).embed_dim, p.hidden, p.noise_dim)

    def initial_generator(self) -> dict:
        with rngmod.init_seed(self.task.seed, "fedgen_init"):
            return clone_state(self.make_generator())

    def client_final(self, model, start, payload, state, data, ctx: Context):
        state, upload = super().client_final(model, start, payload, state, data, ctx)
        upload["label_counts"] = generative_maths.label_counts_message(data, self.task.num_classes)
        return state, upload

    def train_generator(self, generator: dict, ctx: Context, batch_loss) -> tuple[dict, float]:
        """From the server state's ``generator`` weights, ``gen_steps`` Adam steps (lr ``gen_lr``, a fresh Adam every
        round) on ``batch_loss(gen, g)``, the loss of one generated batch drawn with ``g`` (stream
        ``fedgen_server``). Returns the trained weights and the last step's loss."""
        gen = ctx.models.get("server_gen", self.make_generator)
        gen.load_state_dict(generator)
        gen.train()
        p = self.params
        opt = make_optimizer(gen.parameters(), OptimizerSpec("adam", p.gen_lr))
        g = ctx.generator("fedgen_server", ctx.device)
        last = 0.0
        for _ in range(p.gen_steps):
            loss = batch_loss(gen, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = float(loss.detach())
        return clone_state(gen), last


class FedGen(ServerGenerator, FedAvg):
    needs_embedding = True  # (FedAvg's subclass) reads the embedding / the head
    name = "fedgen"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = "Zhu, Hong and Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning, ICML 2021"
    uploads = frozenset({"weights", "num_samples", "class_counts"})

    @dataclass(frozen=True)
    class Params:
        alpha: float = 10.0  # generative_alpha (official MNIST)
        beta: float = 10.0  # generative_beta
        decay: float = 0.98  # per-round decay of alpha and beta
        gen_batch: int = 32  # B_gen (official gen_batch_size)
        gen_steps: int = 50  # official: 5 teacher iterations x ensemble_epochs / 5
        gen_lr: float = 3e-4
        noise_dim: int = 32
        hidden: int = 256
        eta: float = 1.0  # diversity weight (official ensemble_eta)

        def check(self, path):
            for k in ("alpha", "beta", "eta"):
                positive(f"{path}.{k}", getattr(self, k), allow_zero=True)
            for k in ("gen_batch", "gen_steps", "gen_lr", "noise_dim", "hidden"):
                positive(f"{path}.{k}", getattr(self, k))
            if not 0.0 < self.decay <= 1.0:
                from raysim.errors import ConfigError
                raise ConfigError(f"{path}.decay", f"must be in (0, 1], got {self.decay}")

    def pu_view(self, data):
        return None

    def init_server_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(0)), "generator": self.initial_generator(),
                "trained": torch.zeros((), dtype=torch.bool)}

    def broadcast(self, server_state, ctx: Context):
        out = {"model": state_message("weights", server_state["model"])}
        if bool(server_state["trained"]):
            out["generator"] = state_message("generator", server_state["generator"])
        return out

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(payload["model"].tensors)
        aux = {"gen": None}
        if "generator" in payload:
            gen = generative_maths.frozen(ctx.models.get("gen", self.make_generator), payload["generator"].tensors)
            factor = self.params.decay ** max(ctx.round_idx, 0)
            aux = {"gen": gen, "labels": torch.unique(data.y_train), "alpha": self.params.alpha * factor,
                   "beta": self.params.beta * factor, "rng": ctx.generator("fedgen", ctx.device)}
        return LocalStart(aux=aux)

    def vectorizable(self, start: LocalStart) -> bool:
        """Only before the generator exists: its loss then draws from the client's own "fedgen" stream (not pure)."""
        return start.aux["gen"] is None

    def objective(self, start: LocalStart):
        aux = start.aux
        gen = aux["gen"]
        p, bsz = self.params, self.task.train.batch_size

        def loss_fn(model, xb, yb, epoch):
            logits, _ = model(xb, return_embedding=True)
            ce = F.cross_entropy(logits, yb)
            if gen is None:
                return ce, {"ce": ce.detach()}
            g = aux["rng"]
            eps = torch.rand(yb.shape[0], p.noise_dim, generator=g, device=yb.device)
            with torch.no_grad():
                target_p = F.softmax(model.head(gen(eps, yb)), dim=1)
            latent = F.kl_div(F.log_softmax(logits, dim=1), target_p, reduction="batchmean")
            labels = aux["labels"]
            y_hat = labels[torch.randint(len(labels), (p.gen_batch,), generator=g, device=yb.device)]
            eps2 = torch.rand(p.gen_batch, p.noise_dim, generator=g, device=yb.device)
            with torch.no_grad():
                z_hat = gen(eps2, y_hat)
            teacher = F.cross_entropy(model.head(z_hat), y_hat)
            loss = ce + (p.gen_batch / bsz) * aux["alpha"] * teacher + aux["beta"] * latent
            return loss, {"ce": ce.detach(), "teacher": teacher.detach(), "latent": latent.detach()}

        return loss_fn

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        model = sample_weighted_average(uploads, ids)
        counts = torch.stack([uploads[i]["label_counts"]["counts"] for i in ids]).to(torch.float64)
        held = counts.sum(0)
        weights = (counts / held.clamp(min=1)).to(torch.float32).to(ctx.device)
        classes = torch.nonzero(held > 0, as_tuple=False).flatten().to(ctx.device)
        heads = [generative_maths.frozen(ctx.models.get(("client", j), lambda: self.task.build_model(0)),
                                uploads[i]["model"].tensors).head for j, i in enumerate(ids)]
        p = self.params

        def batch_loss(gen, g):
            y = classes[torch.randint(len(classes), (p.gen_batch,), generator=g, device=ctx.device)]
            eps = torch.rand(p.gen_batch, p.noise_dim, generator=g, device=ctx.device)
            z = gen(eps, y)
            return ensemble_loss([h(z) for h in heads], weights, y) + p.eta * fedgen_diversity(eps, z)

        gen, last = self.train_generator(server_state["generator"], ctx, batch_loss)
        new = {"model": model, "generator": gen, "trained": torch.ones((), dtype=torch.bool)}
        return new, {"gen_loss": last}
