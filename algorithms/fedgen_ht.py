"""FedGen in HtFLlib's heterogeneous-model form (reference §6.8, "HtFLlib (HtFL) variant"; HtFLlib
system/flcore/{servers/servergen.py, clients/clientgen.py}), the FedGen that the FedTGP seed (002) compares against:
bodies stay local and may differ between clients, the classifier heads (one shape across the zoo) are averaged with
sample-count weights as in LG-FedAvg, and the server learns a label-conditioned feature generator
G(eps, y) -> z (the embedding, size d) from the uploaded heads.

Server, every round, on the uploaded heads h_k with sample-count weights w_k (sum 1), a fresh Adam (lr ``gen_lr``,
as HtFLlib builds one per round), ``gen_steps`` steps of

    L_G = CE( sum_k w_k h_k(G(eps, y)), y ),   y ~ the label frequencies of every client's training data, eps ~ U[0, 1)

(no diversity term, no per-label weights: those are the official FedGen's, ``algorithms/fedgen.py``). Client, from
the first round: CE(x, y) + ``weight`` * CE(h(G(eps, y_hat)), y_hat) with a batch of y_hat drawn from the same label
frequencies (HtFLlib's ``qualified_labels``), G not updated and, as HtFLlib calls it, in training mode (its
BatchNorm normalises each generated batch by its own statistics).

Where this differs from HtFLlib's code: the label frequencies are the label counts the clients upload with their
heads (kept per client in the server state), not read from every client's data before training; with every client
in every round (the seed's setting) they are the same from the first round on, and in the first round the clients
draw uniformly over the classes. HtFLlib saves the generator only once, before any training, so its clients always
see the untrained generator; here they get the generator the server trained.

Why a second FedGen: the official form (diversity loss, alpha = beta = 10, B_gen / B = 3.2 at the seed's batch 10)
diverges on the seed-002 stand-in: the diversity term exp(-mean ||eps_a - eps_b||^2 |z_a - z_b|_1) is lowest when
generated features spread without bound, and their norm grows from 3 to 177 by round 21 (real embeddings ~16),
until the teacher term's gradients on the head overflow (REPRODUCTION_seed000_002.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms import generative_maths
from algorithms.fedavg import sample_counts
from algorithms.fedgen import ServerGenerator
from algorithms.lgfedavg import LGFedAvg
from raysim.algorithm import Context, LocalStart
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.messages import Message, state_message


def ensemble_logits(heads: list, weights: list, z: torch.Tensor) -> torch.Tensor:
    """sum_k w_k h_k(z)."""
    out = None
    for h, w in zip(heads, weights):
        out = h(z) * w if out is None else out + h(z) * w
    return out


class FedGenHt(ServerGenerator, LGFedAvg):
    needs_embedding = True
    name = "fedgen_ht"
    asynchronous = False  # server.mode: async not supported (not tested with buffered / staleness-weighted aggregation)
    paper = ("Zhu, Hong and Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning, ICML 2021 "
             "(HtFLlib's heterogeneous form, as the FedTGP paper runs it)")
    uploads = frozenset({"head_weights", "num_samples", "class_counts"})

    @dataclass(frozen=True)
    class Params:
        gen_lr: float = 0.1  # HtFLlib total.sh -glr 0.1 (a fresh Adam every round)
        gen_steps: int = 100  # HtFLlib server_epochs
        gen_batch: int = 0  # generated batch on the server and the client (>= 2: BatchNorm); 0 = train.batch_size
        noise_dim: int = 32
        hidden: int = 512  # HtFLlib hidden_dim
        weight: float = 1.0  # weight of the client's CE on generated features (HtFLlib: 1)

        def check(self, path):
            positive(f"{path}.weight", self.weight, allow_zero=True)
            positive(f"{path}.gen_batch", self.gen_batch, allow_zero=True)
            for k in ("gen_steps", "gen_lr", "noise_dim", "hidden"):
                positive(f"{path}.{k}", getattr(self, k))

    def validate(self):
        super().validate()
        if self._batch() < 2:
            field = "algorithm.params.gen_batch" if self.params.gen_batch else "train.batch_size"
            raise ConfigError(field, f"FedGen's generator normalises each generated batch (BatchNorm): it needs at "
                                     f"least 2 samples, got {self._batch()}; set algorithm.params.gen_batch >= 2")

    def _batch(self) -> int:
        return self.params.gen_batch or self.task.train.batch_size

    def init_server_state(self, ctx: Context):
        state = super().init_server_state(ctx)
        state.update({"generator": self.initial_generator(),
                      # per client, the label counts it uploaded (rows of clients not heard from yet stay 0)
                      "label_counts": torch.zeros(self.task.num_clients, self.task.num_classes, dtype=torch.int64)})
        return state

    def label_freq(self, server_state) -> torch.Tensor:
        """The label counts of every client heard from (uniform over the classes before any upload)."""
        counts = server_state["label_counts"].sum(0)
        return counts if int(counts.sum()) > 0 else torch.ones(self.task.num_classes, dtype=torch.int64)

    def broadcast(self, server_state, ctx: Context):
        out = super().broadcast(server_state, ctx)
        out["generator"] = state_message("generator", server_state["generator"])
        out["label_freq"] = Message("class_counts", {"counts": self.label_freq(server_state)})
        return out

    def vectorizable(self, start: LocalStart) -> bool:
        return False  # the generated batch and its BatchNorm statistics are drawn per client step

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        self.load(model, payload, state)
        if "generator" not in payload:
            return LocalStart(aux={"gen": None})
        gen = ctx.models.get("gen", self.make_generator)
        gen.load_state_dict(payload["generator"].tensors)  # every step: its BatchNorm's running stats move below
        gen.train()  # as HtFLlib calls it: each generated batch normalised by its own statistics
        gen.requires_grad_(False)
        freq = payload["label_freq"]["counts"].to(torch.float64)
        return LocalStart(aux={"gen": gen, "freq": (freq / freq.sum()).to(torch.float32).to(ctx.device),
                               "rng": ctx.generator("fedgen", ctx.device)})

    def objective(self, start: LocalStart):
        aux = start.aux or {"gen": None}
        gen = aux["gen"]
        p, nb = self.params, self._batch()

        def loss_fn(model, xb, yb, epoch):
            ce = F.cross_entropy(model(xb), yb)
            if gen is None:
                return ce, {"ce": ce.detach()}
            g = aux["rng"]
            y_hat = torch.multinomial(aux["freq"], nb, replacement=True, generator=g)
            eps = torch.rand(nb, p.noise_dim, generator=g, device=yb.device)
            with torch.no_grad():
                z = gen(eps, y_hat)
            teacher = F.cross_entropy(model.head(z), y_hat)
            return ce + p.weight * teacher, {"ce": ce.detach(), "teacher": teacher.detach()}

        return loss_fn

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        new, _ = super().aggregate(server_state, uploads, ctx)
        counts = server_state["label_counts"].clone()
        for i in ids:
            counts[i] = uploads[i]["label_counts"]["counts"]
        n = sample_counts(uploads, ids)
        weights = [c / sum(n) for c in n]
        heads = [generative_maths.frozen(ctx.models.get(("head", j), lambda: self.task.build_model(0).head),
                                {k[len("head."):]: v for k, v in uploads[i]["shared"].tensors.items()})
                 for j, i in enumerate(ids)]
        p = self.params
        freq = self.label_freq({"label_counts": counts}).to(torch.float32).to(ctx.device)

        def batch_loss(gen, g):
            y = torch.multinomial(freq, self._batch(), replacement=True, generator=g)
            eps = torch.rand(len(y), p.noise_dim, generator=g, device=ctx.device)
            return F.cross_entropy(ensemble_logits(heads, weights, gen(eps, y)), y)

        gen, last = self.train_generator(server_state["generator"], ctx, batch_loss)
        new.update({"generator": gen, "label_counts": counts})
        return new, {"gen_loss": last}
