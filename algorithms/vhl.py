"""VHL — virtual homogeneity learning (Tang et al., "Virtual Homogeneity Learning: Defending against Data
Heterogeneity in Federated Learning", ICML 2022; reference §6.12, after wizard1203/VHL).

Setup (``setup_schedule``, once): the server draws an *untrained* generator from the shared seed
(``generators.VirtualGenerator``; the official code uses an untrained StyleGAN-v2) and every device downloads it once
(accounted once) and generates the same virtual dataset, ``virtual_per_class`` images for each of C_v = C virtual
classes, from the common stream (seed, -1, server, "vhl_virtual"); it stays in the device's state. Noise-like images,
no real data.

Model: C + C_v outputs. Local loss per batch (with a virtual batch of the same size drawn from the device's stream):
CE(real) + alpha * CE(virtual, C + y_v) + lam_cls * SupCon(real and virtual embeddings, virtual labels mapped back
to 0..C-1 so virtual class k pairs with real class k, virtual embeddings detached) + lam_noise * SupCon(virtual only),
SupCon temperature 0.07; the two contrastive terms only in local epochs < ``align_epochs`` (official: 5). Embeddings
are L2-normalised before SupCon (no projection head). Server: FedAvg. Evaluation: argmax over all C + C_v outputs
(``test_acc``) and over the first C (``test_acc_c``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms.fedavg import model_uploads, sample_weighted_average
from algorithms.generators import VirtualGenerator
from raysim import rng as rngmod
from raysim.algorithm import ClientUpdate, Context, LocalStart, LocalTraining, ServerUpdate, StepDraws
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.messages import Message, state_message
from raysim.models import arch_key, build_model
from raysim.steps import ALL, ClientStep, ServerStep
from raysim.training import accuracy, clone_state, forward_all


def supcon(z: torch.Tensor, y: torch.Tensor, temperature: float, anchors: int = None) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) on L2-normalised rows: for each anchor i with positives
    P(i) = {p != i: y_p = y_i}, -1/|P(i)| sum_p log(exp(s_ip / T) / sum_{a != i} exp(s_ia / T)); mean over anchors
    with positives (the first ``anchors`` rows only, when given). 0 when no anchor has a positive."""
    z = F.normalize(z, dim=1)
    s = z @ z.t() / temperature
    n = z.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=z.device)
    s = s.masked_fill(eye, float("-inf"))
    logp = s - torch.logsumexp(s, dim=1, keepdim=True)
    pos = (y.unsqueeze(0) == y.unsqueeze(1)) & ~eye
    if anchors is not None:
        logp, pos = logp[:anchors], pos[:anchors]
    npos = pos.sum(1)
    has = npos > 0
    # without data-dependent control flow or selection (no host read per step; traceable by vmap): anchors without
    # a positive contribute 0 and are not counted; no anchor with one: 0
    per = (-(logp.masked_fill(~pos, 0.0).sum(1) / npos.clamp_min(1))).masked_fill(~has, 0.0)
    return per.sum() / has.sum().clamp_min(1)


class VHL(LocalTraining):
    name = "vhl"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "global", "test_acc_c": "global_real_classes", "global_test_acc": "global",
                "global_test_acc_c": "global_real_classes"}
    paper = ("Tang et al., Virtual Homogeneity Learning: Defending against Data Heterogeneity in Federated Learning, "
             "ICML 2022")
    uploads = frozenset({"weights", "num_samples"})

    @dataclass(frozen=True)
    class Params:
        alpha: float = 1.0  # weight of the virtual CE (alignNoiseContrast script)
        lam_cls: float = 1.0
        lam_noise: float = 0.1
        temperature: float = 0.07
        align_epochs: int = 5
        virtual_per_class: int = 50
        gen_channels: int = 32
        gen_noise: int = 64

        def check(self, path):
            for k in ("alpha", "lam_cls", "lam_noise"):
                positive(f"{path}.{k}", getattr(self, k), allow_zero=True)
            for k in ("temperature", "virtual_per_class", "gen_channels", "gen_noise"):
                positive(f"{path}.{k}", getattr(self, k))
            positive(f"{path}.align_epochs", self.align_epochs, allow_zero=True)

    def validate(self):
        self.require_homogeneous()
        if len(self.task.input_shape) != 3:
            raise ConfigError("data.dataset", f"vhl's virtual data are images (C, H, W); the input shape is "
                                              f"{self.task.input_shape}")

    def outputs(self) -> int:
        return 2 * self.task.num_classes

    def live_model(self, ctx: Context):
        spec = self.task.archs[ctx.client_id]
        return ctx.models.get(("model", arch_key(spec)), lambda: build_model(spec, self.task.input_shape, self.outputs()))

    def make_generator(self):
        p = self.params
        return VirtualGenerator(self.task.num_classes, self.task.input_shape, p.gen_channels, p.gen_noise)

    # -- setup ------------------------------------------------------------------------------------------------------
    def setup_schedule(self):
        return (ServerStep("vhl_share"), ClientStep("vhl_receive", clients=ALL))

    def vhl_share(self, state, uploads, ctx: Context):
        return ServerUpdate(state, {"generator": state_message("generator", state["generator"])})

    def vhl_receive(self, payload, state, data, ctx: Context):
        c, per = self.task.num_classes, self.params.virtual_per_class
        gen = ctx.models.get("gen", self.make_generator)
        gen.load_state_dict(payload["generator"].tensors)
        gen.eval()
        y = torch.arange(c, device=ctx.device).repeat_interleave(per)
        g = rngmod.torch_generator(self.task.seed, rngmod.NO_ROUND, rngmod.SERVER, "vhl_virtual", device=ctx.device)
        z = torch.randn(len(y), self.params.gen_noise, generator=g, device=ctx.device)
        x = gen(z, y)  # tanh output: noise-like images, used as they are
        return ClientUpdate({"vx": x.cpu(), "vy": y.cpu()}, {}, {"virtual_samples": float(len(y))})

    # -- server -----------------------------------------------------------------------------------------------------
    def init_server_state(self, ctx: Context):
        with rngmod.init_seed(self.task.seed, "vhl_generator"):
            gen = self.make_generator()
        model = build_model(self.task.archs[0], self.task.input_shape, self.outputs())
        return {"model": clone_state(model), "generator": clone_state(gen)}

    def broadcast(self, server_state, ctx: Context):
        return {"model": state_message("weights", server_state["model"])}

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        model = sample_weighted_average(uploads, ids)
        return {**server_state, "model": model}, {}

    # -- client -----------------------------------------------------------------------------------------------------
    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        vx, vy = (state or {}).get("vx"), (state or {}).get("vy")
        aux = {"vx": None if vx is None else vx.to(ctx.device), "vy": None if vy is None else vy.to(ctx.device)}
        draws = None
        if vx is not None:  # each step's virtual batch: counter-based indices of the client's own stream
            n, dev = len(vy), ctx.device

            def draw(b: int, g) -> dict:
                return {"vidx": g.integers(n, (b,), dev)}

            def stacked(b: int, group: list, cache: dict) -> dict:  # the group's at once: the same bits
                if not cache:
                    cache["bases"] = rngmod.stacked_bases([d.generator for d in group], dev)
                c = group[0].generator.drawn
                for d in group:
                    d.generator.drawn += 1
                return {"vidx": rngmod.integers(cache["bases"], c, b, n, dev)}

            draws = StepDraws(draw, ctx.stream("virtual_batches"), stacked=stacked)
        return LocalStart(aux=aux, weights=payload["model"].tensors, draws=draws)

    def vectorizable(self, start: LocalStart) -> bool:
        """Always: the virtual data set is the same on every client (one server stream); each step's virtual batch
        is the objective's draw (StepDraws), handed to a vectorised group in the clients' rows."""
        return True

    def _loss(self, aux: dict):
        """The local objective given a step's virtual indices: ``loss_fn(model, xb, yb, epoch, vidx)``."""
        p, c = self.params, self.task.num_classes

        def loss_fn(model, xb, yb, epoch, vidx):
            if aux["vx"] is None:
                logits = model(xb)
                ce = F.cross_entropy(logits, yb)
                return ce, {"ce": ce.detach()}
            vx, vy = aux["vx"][vidx], aux["vy"][vidx]
            n = yb.shape[0]
            logits, z = model(torch.cat([xb, vx]), return_embedding=True)
            ce = F.cross_entropy(logits[:n], yb)
            ce_v = F.cross_entropy(logits[n:], vy + c)
            loss = ce + p.alpha * ce_v
            parts = {"ce": ce.detach(), "ce_virtual": ce_v.detach()}
            if epoch < p.align_epochs:
                l_cls = supcon(torch.cat([z[:n], z[n:].detach()]), torch.cat([yb, vy]), p.temperature, anchors=n)
                l_noise = supcon(z[n:], vy, p.temperature)
                loss = loss + p.lam_cls * l_cls + p.lam_noise * l_noise
                parts.update(con_cls=l_cls.detach(), con_noise=l_noise.detach())
            return loss, parts

        return loss_fn

    def objective(self, start: LocalStart):
        loss, draw = self._loss(start.aux), start.draws

        def loss_fn(model, xb, yb, epoch):
            return loss(model, xb, yb, epoch, None if draw is None else draw.fn(yb.shape[0], draw.generator)["vidx"])

        return loss_fn

    def row_objective(self, start: LocalStart):
        """The objective of a vectorised group: each step's virtual indices come in the client's rows."""
        loss = self._loss(start.aux)

        def loss_fn(model, xb, yb, epoch, rows):
            return loss(model, xb, yb, epoch, rows.get("vidx"))

        return loss_fn

    def client_final(self, model, start, payload, state, data, ctx: Context):
        upload = {"model": state_message("weights", model.state_dict(keep_vars=True)),
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return state, upload

    def client_final_group(self, group):
        """client_final for a vectorised group: the uploads' models rows of the trained stacks (FedAvg's form)."""
        return model_uploads(group) if type(self).client_final is VHL.client_final else None

    def _eval(self, sd, x, y, ctx):
        model = self.live_model(ctx)
        model.load_state_dict(sd)
        logits, _ = forward_all(model, x)
        return accuracy(logits.argmax(1), y), accuracy(logits[:, :self.task.num_classes].argmax(1), y)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        a, ac = self._eval(payload["model"].tensors, data.x_test, data.y_test, ctx)
        return {"test_acc": a, "test_acc_c": ac}

    def evaluate_server(self, server_state, test, ctx: Context) -> dict:
        a, ac = self._eval(server_state["model"], test.x.to(ctx.device), test.y.to(ctx.device), ctx)
        return {"global_test_acc": a, "global_test_acc_c": ac}
