"""MAFML — model-agnostic federated mutual learning (Zhou et al. 2023; the seed 003_dc806479afc0b3e0.txt,
Algorithm 1 and equations (1)-(7); reference §4). No public code exists; this follows the seed.

Cross-silo: N nodes (one domain each, any architectures), every node in every iteration, no global model. Each node's
samples are split private / public / val / test (``data.local_split``; the public shares of all nodes form the public
dataset, which every node may read, labels included). One round = ``iterations`` iterations (default 50, the seed's
validation interval), each a schedule of two exchanges:

1. ``local`` (every node i): a batch d_loc of ``train.batch_size`` drawn at random from D_pri ∪ D_pub^i (the client's
   ``x_train``); g_loc = ∇ CE (eq. 1-2); Adam step with lr β = ``train.lr``. Then a batch d_pub^i of its own public
   share: soft labels p^i = softmax(f_i(x)) and the batch accuracy A_i (eq. before 3), uploaded as
   (public indices, soft labels, A_i) — never the samples;
2. ``relay`` (server): forwards every upload as one :class:`Teachers` message (node id -> soft labels); in the global
   step node i downloads the other nodes' (``downlink``: ``Teachers.without(i)``), in the local step nothing;
3. ``global`` (every node i as student of every j ≠ i): KL term (1/(N-1)) Σ_j A_j KL(p^j ‖ softmax(f_i(x_pub^j)))
   (eq. 3-4) + CE term (1/(N-1)) Σ_j CE(f_i(x_pub^j), y_pub^j) (eq. 5); g_pub = ∇(KL + CE) (eq. 6); if
   cos(g_pub, g_loc) < 0 the projection g~ = g_pub − (g_loc·g_pub/‖g_loc‖²) g_loc (eq. 7), else g~ = g_pub; Adam step
   with lr η = ``public_lr`` (default β). ``per_teacher: true``: Algorithm 1's loop form instead — for each teacher j
   in id order, g_pub = ∇(A_j KL_j + CE_j), the same check and projection against g_loc, one Adam step each.

The relay's teachers stay the current payload until the next relay, through the next iteration's local step and the
round's end; since only the global step downloads them, a round (or a resumed run, which starts from
``initial_payload``'s empty payload) downloads exactly what the seed's exchange sends.

Choices the seed leaves open [INFERRED]: one Adam state per node serves both updates (β and η are its step sizes;
weight decay ``train.weight_decay`` in both) and persists across iterations and rounds in the client state; batches
are drawn at random each iteration (``torch.randperm(n)[:B]``, stream (seed, round, client, "batches@local#k")); the
public batch size is ``public_batch`` (default ``train.batch_size``); soft labels and A_i come from the model in eval
mode right after the local step. Metric ``projected``: the share of the round's iterations (per teacher in the
per-teacher form) in which the projection fired.

Traffic per node and iteration (B = public batch, C = classes, N nodes): up B·C + 1 floats and B int64 indices;
down (N−1)(B·C + 1) floats and (N−1)·B indices. LeNet on Rotated MNIST (B = 32, C = 10, N = 4): up 321 floats,
down 963 floats per iteration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from algorithms import mafml_group
from algorithms.mutual_ops import (WarmClients, domain_metrics, flat_grad, project_conflicting, public_shares,
                                   random_batch, set_flat_grad, weighted_kl)
from raysim.algorithm import Algorithm, ClientUpdate, Context, ServerUpdate
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.messages import Message, payload_sizes
from raysim.steps import ALL, ClientStep, Repeat, ServerStep
from raysim.training import clone_state


def require_public_shares(algo, what: str) -> None:
    """Every node must hold a public share (``data.local_split.public`` > 0)."""
    pub = algo.task.public
    if pub is None or pub.owner is None:
        raise ConfigError("data.local_split", f"{what} needs each node's public share: set data.local_split "
                                              f"{{public: 0.1, val: 0.1, test: 0.15}}")
    counts = torch.bincount(pub.owner, minlength=algo.task.num_clients)
    if int(counts.min()) == 0:
        raise ConfigError("data.local_split.public", f"{what}: node {int(counts.argmin())} has no public sample; "
                                                     f"raise the public share")


@dataclass(frozen=True)
class Teachers(Message):
    """The relay's message: every node's soft-label upload (``soft_labels``: public indices ``idx``, softmax outputs
    ``p``, batch accuracy ``acc`` = A_j) by node id. Node i's global step downloads :meth:`without` i, its teachers.
    Accounted as the uploads it carries, so relaying them costs the floats and bytes of sending each one."""

    kind: str = "soft_labels"
    teachers: Mapping[int, Message] = field(default_factory=dict)

    @property
    def num_floats(self) -> int:
        return sum(m.num_floats for m in self.teachers.values())

    @property
    def num_bytes(self) -> int:
        return sum(m.num_bytes for m in self.teachers.values())

    def without(self, node: int) -> "Teachers":
        return Teachers(self.kind, teachers={j: m for j, m in self.teachers.items() if j != node})

    def to(self, device) -> "Teachers":
        return Teachers(self.kind, teachers={j: m.to(device) for j, m in self.teachers.items()})


def floats_per_iteration(num_clients: int, num_classes: int, public_batch: int) -> int:
    """MAFML's floats per iteration over all nodes, up and down, as the accounting counts them: the messages of
    :meth:`MAFML.local` built at their shapes (N uploads; each node downloads the other N - 1), i.e. N^2 (B*C + 1)."""
    b, c, n = int(public_batch), int(num_classes), int(num_clients)
    msg = Message("soft_labels", {"idx": torch.zeros(b, dtype=torch.int64), "p": torch.zeros(b, c),
                                  "acc": torch.zeros(1)})
    up = payload_sizes({"soft": msg})["soft_labels"][0]
    down = payload_sizes({"teachers": Teachers(teachers={j: msg for j in range(n - 1)})})["soft_labels"][0]
    return n * (up + down)


LOCAL = ClientStep("local", clients=ALL)
GLOBAL = ClientStep("global", fn="step_global", clients=ALL)


class MAFML(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    name = "mafml"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = ("Zhou et al., Model-agnostic federated mutual learning (MAFML), 2023 — seed 003, Algorithm 1, "
             "eq. (1)-(7)")

    def declared_uploads(self):
        return {"soft_labels"}

    @dataclass(frozen=True)
    class Params:
        iterations: int = 50  # iterations per round (the seed validates every 50)
        public_lr: Optional[float] = None  # eta of the global step; None: train.lr (beta)
        public_batch: Optional[int] = None  # B of d_pub; None: train.batch_size
        per_teacher: bool = False  # Algorithm 1's per-teacher updates instead of the summed eq. (3)-(6)
        project: bool = True  # the conflict projection (eq. 7); False: always g_pub (ablation)

        def check(self, path):
            positive(f"{path}.iterations", self.iterations)
            if self.public_lr is not None:
                positive(f"{path}.public_lr", self.public_lr)
            if self.public_batch is not None:
                positive(f"{path}.public_batch", self.public_batch)

    def __init__(self, params, task):
        super().__init__(params, task)
        self.live = WarmClients(task)  # each node's model and Adam kept warm across its steps (same numbers)

    def validate(self):
        require_public_shares(self, self.name)
        if self.task.train.optimizer != "adam":
            raise ConfigError("train.optimizer", f"{self.name} updates with Adam (seed §4.1.1); set train.optimizer: "
                                                 f"adam")

    def schedule(self):
        return (Repeat(self.params.iterations, (LOCAL, ServerStep("relay"), GLOBAL)),)

    # -- server: a relay ----------------------------------------------------------------------------------------
    def relay(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        relayed = Teachers(teachers={j: uploads[j]["soft"] for j in sorted(uploads)})
        return ServerUpdate(server_state, {"teachers": relayed})

    def downlink(self, payload, client_id, ctx=None):
        """The global step downloads the other nodes' soft labels; the local step (and evaluation) nothing."""
        relayed = payload.get("teachers")
        if relayed is None or ctx is None or ctx.step != GLOBAL.name:
            return {}
        return {"teachers": relayed.without(client_id)}

    # -- client -------------------------------------------------------------------------------------------------
    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id)), "opt": {}, "g_loc": torch.zeros(0)}

    def _load(self, state, ctx):
        model = ctx.model()
        model.load_state_dict(state["model"])
        return model

    def local(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg = self.task.train
        model, opt = self.live.get(state, ctx, cfg.lr)
        gen = ctx.generator("batches")
        idx = random_batch(data.num_train, cfg.batch_size, gen).to(data.y_train.device)
        self.live.mode(ctx, True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        g_loc = flat_grad(model).detach().clone()
        opt.step()
        # soft labels and batch accuracy on a batch of the node's own public share
        px, py, own = public_shares(self.task, ctx)
        mine = own[ctx.client_id]
        pick = mine[random_batch(len(mine), self.params.public_batch or cfg.batch_size, gen).to(mine.device)]
        self.live.mode(ctx, False)
        with torch.no_grad():
            logits = model(px[pick])
        p = F.softmax(logits, dim=1)
        acc = (logits.argmax(1) == py[pick]).float().mean()
        up = {"soft": Message("soft_labels", {"idx": pick.cpu(), "p": p.detach().cpu(), "acc": acc.reshape(1).cpu()})}
        weights, opt_state = self.live.snapshot(ctx)
        new = {"model": weights, "opt": opt_state, "g_loc": g_loc}
        self.live.done(ctx, new)
        return ClientUpdate(new, up, {"train_loss": float(loss.detach()), "public_batch_acc": float(acc)})

    def _public_loss(self, model, teachers, px, py):
        """(KL term, CE term) of eq. (3) and (5) over the given teachers [(A_j, idx_j, p_j)]."""
        logits = [model(px[idx]) for _, idx, _ in teachers]
        kl = weighted_kl(logits, [p for _, _, p in teachers], [a for a, _, _ in teachers])
        ce = torch.stack([F.cross_entropy(s, py[idx]) for s, (_, idx, _) in zip(logits, teachers)]).mean()
        return kl, ce

    def teachers(self, payload, device):
        """[(A_j, idx_j, p_j)] of the downloaded teachers, in node order."""
        relayed = payload.get("teachers")
        if relayed is None:
            return []
        return [(float(m["acc"][0]), m["idx"].to(device), m["p"].to(device))
                for _, m in sorted(relayed.teachers.items())]

    def step_global(self, payload, state, data, ctx: Context) -> ClientUpdate:
        cfg = self.task.train
        teachers = self.teachers(payload, ctx.device)
        if not teachers:
            return ClientUpdate(state, {}, {})
        model, opt = self.live.get(state, ctx, self.params.public_lr or cfg.lr)
        px, py, _ = public_shares(self.task, ctx)
        g_loc = state["g_loc"].to(ctx.device)
        groups = [[t] for t in teachers] if self.params.per_teacher else [teachers]
        fired, kls, ces = [], [], []
        self.live.mode(ctx, True)
        for group in groups:
            opt.zero_grad(set_to_none=True)
            kl, ce = self._public_loss(model, group, px, py)
            (kl + ce).backward()
            g_pub = flat_grad(model)
            g, hit = project_conflicting(g_pub, g_loc) if self.params.project else (g_pub, False)
            set_flat_grad(model, g)
            opt.step()
            fired.append(float(hit))
            kls.append(float(kl.detach()))
            ces.append(float(ce.detach()))
        weights, opt_state = self.live.snapshot(ctx)
        new = {"model": weights, "opt": opt_state, "g_loc": torch.zeros(0)}
        self.live.done(ctx, new)
        n = len(groups)
        return ClientUpdate(new, {}, {"projected": sum(fired) / n, "train_kl": sum(kls) / n,
                                      "train_ce_public": sum(ces) / n})

    # the group forms of the two client steps (backend.vectorize: the nodes' models as one grouped network)
    def local_group(self, payloads, states, datas, ctxs):
        return mafml_group.local(self, payloads, states, datas, ctxs)

    def step_global_group(self, payloads, states, datas, ctxs):
        return mafml_group.step_global(self, payloads, states, datas, ctxs)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        return domain_metrics(self._load(state, ctx), data)
