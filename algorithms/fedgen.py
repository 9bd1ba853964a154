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
from raysim.algorithm import Context, LocalStart, StepDraws
from raysim.config import positive
from raysim.messages import Message, rows_of, state_message
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
        aux = {"gen": None}
        draws = None
        if "generator" in payload:
            gen = ctx.models.get("gen", self.make_generator)
            tensors = payload["generator"].tensors
            if getattr(gen, "_loaded_from", None) is not tensors:  # this broadcast's generator is loaded once per
                gen.load_state_dict(tensors)  # runner (frozen: nothing changes it between its clients)
                gen._loaded_from = tensors
            gen.eval()
            gen.requires_grad_(False)
            factor = self.params.decay ** max(ctx.round_idx, 0)
            aux = {"gen": gen, "labels": torch.unique(data.y_train), "alpha": self.params.alpha * factor,
                   "beta": self.params.beta * factor, "rng": ctx.stream("fedgen")}
            # each step's noise and sampled labels, counter-based draws of the client's own stream (a vectorised
            # group draws them for all its clients at once before each step and hands them to row_objective)
            draws = StepDraws(self._draws(aux["labels"]), aux["rng"], self._generated(gen), self._stacked_draws,
                              aux["labels"])
        # the global weights are the start (loaded by whoever runs the step: LocalStart.weights)
        return LocalStart(aux=aux, weights=payload["model"].tensors, draws=draws)

    def vectorizable(self, start: LocalStart) -> bool:
        """Always: once the generator exists, each step's random inputs are the objective's draws (StepDraws)."""
        return True

    def _draws(self, labels: torch.Tensor):
        """A step's random inputs, drawn from ``g`` in the objective's order: the latent term's noise (one row per
        sample), the teacher term's labels (drawn among the client's own) and noise."""
        p = self.params

        def draw(b: int, g) -> dict:
            dev = labels.device
            eps = g.uniform((b, p.noise_dim), dev)
            y_hat = labels[g.integers(len(labels), (p.gen_batch,), dev)]
            eps2 = g.uniform((p.gen_batch, p.noise_dim), dev)
            return {"eps": eps, "y_hat": y_hat, "eps2": eps2}

        return draw

    def _stacked_draws(self, b: int, draws: list, cache: dict) -> dict:
        """:meth:`_draws` for a whole vectorised group at once (its clients' streams at one counter): the same bits,
        each stream advanced by the three draws; the streams' keys and the clients' labels stacked once."""
        p, k = self.params, len(draws)
        if not cache:
            labels = [d.inputs for d in draws]
            dev = labels[0].device
            cache.update(bases=rngmod.stacked_bases([d.generator for d in draws], dev), dev=dev,
                         sizes=torch.tensor([[len(x)] for x in labels], dtype=torch.int64, device=dev),
                         padded=torch.nn.utils.rnn.pad_sequence(labels, batch_first=True))
        bases, dev, sizes, padded = cache["bases"], cache["dev"], cache["sizes"], cache["padded"]
        c = draws[0].generator.drawn
        eps = rngmod.uniforms(bases, c, b * p.noise_dim, dev).view(k, b, p.noise_dim)
        y_hat = padded.gather(1, rngmod.integers(bases, c + 1, p.gen_batch, sizes, dev))
        eps2 = rngmod.uniforms(bases, c + 2, p.gen_batch * p.noise_dim, dev).view(k, p.gen_batch, p.noise_dim)
        for d in draws:
            d.generator.drawn += 3
        return {"eps": eps, "y_hat": y_hat, "eps2": eps2}

    @staticmethod
    def _generated(gen):
        """A vectorised group's generator outputs of a step, from its stacked draws and labels ([K, ...]): the
        frozen generator once over all clients' rows (it maps each row on its own: eval mode)."""

        def group(d: dict, yb: torch.Tensor) -> dict:
            k = yb.shape[0]
            z = gen(d["eps"].flatten(0, 1), yb.flatten(0, 1))
            z_hat = gen(d["eps2"].flatten(0, 1), d["y_hat"].flatten(0, 1))
            return {"z": z.view(k, -1, z.shape[-1]), "z_hat": z_hat.view(k, -1, z_hat.shape[-1])}

        return group

    def _loss(self, aux: dict):
        """The local objective given a step's draws: ``loss_fn(model, xb, yb, draws)``."""
        gen = aux["gen"]
        p, bsz = self.params, self.task.train.batch_size

        def loss_fn(model, xb, yb, d):
            logits, _ = model(xb, return_embedding=True)
            ce = F.cross_entropy(logits, yb)
            if gen is None:
                return ce, {"ce": ce.detach()}
            with torch.no_grad():
                target_p = F.softmax(model.head(d["z"] if "z" in d else gen(d["eps"], yb)), dim=1)
            latent = F.kl_div(F.log_softmax(logits, dim=1), target_p, reduction="batchmean")
            y_hat = d["y_hat"]
            with torch.no_grad():
                z_hat = d["z_hat"] if "z_hat" in d else gen(d["eps2"], y_hat)
            teacher = F.cross_entropy(model.head(z_hat), y_hat)
            loss = ce + (p.gen_batch / bsz) * aux["alpha"] * teacher + aux["beta"] * latent
            return loss, {"ce": ce.detach(), "teacher": teacher.detach(), "latent": latent.detach()}

        return loss_fn

    def objective(self, start: LocalStart):
        aux = start.aux
        loss, draw = self._loss(aux), start.draws

        def loss_fn(model, xb, yb, epoch):
            return loss(model, xb, yb, None if draw is None else draw.fn(yb.shape[0], draw.generator))

        return loss_fn

    def row_objective(self, start: LocalStart):
        """The objective of a vectorised group: each step's draws come in the client's rows."""
        loss = self._loss(start.aux)

        def loss_fn(model, xb, yb, epoch, rows):
            return loss(model, xb, yb, rows)

        return loss_fn

    def client_final_group(self, group):
        """client_final for a vectorised group: the uploads' models rows of the trained stacks (FedAvg's), the sample
        and label counts one stacked tensor each (the label counts by one scatter over the group's labels when they
        have one shape)."""
        if type(self).client_final is not FedGen.client_final:
            return None
        counts = torch.tensor([[d.num_train] for d in group.datas], dtype=torch.int64)
        ys = [d.y_train.cpu() for d in group.datas]
        c = self.task.num_classes
        if len({tuple(y.shape) for y in ys}) == 1:
            y = torch.stack(ys)
            labels = torch.zeros(y.shape[0], c, dtype=torch.int64).scatter_add_(1, y, torch.ones_like(y))
        else:
            labels = torch.stack([torch.bincount(y, minlength=c).to(torch.int64) for y in ys])
        return [(state, {"model": Message("weights", w), "num_samples": Message("num_samples", n),
                         "label_counts": Message("class_counts", lc)})
                for state, w, n, lc in zip(group.states, rows_of(group.state_stacks()), rows_of({"n": counts}),
                                           rows_of({"counts": labels}))]

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
