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

Two forms of each client step, side by side and built from the same pieces (the batch draws, the soft-label upload,
the KL + CE terms, the projection, the metrics): the per-node steps (:meth:`MAFML.local`, :meth:`MAFML.step_global`)
and their group forms (``backend.vectorize``: true, or auto, its default on a CPU as on a GPU — the per-node steps
are many small ones, 1.8x a plain loop on a CPU, the group forms 0.85x: :meth:`MAFML.local_group`,
:meth:`MAFML.step_global_group`), one
MAFML iteration's client step for every node a runner hosts at once, the nodes' models as one grouped network
(:mod:`raysim.runner.grouped`: grouped channels-last convolutions, batched linear layers, Adam over the stacked
parameters). The group forms draw the same batches per node and give the same states, uploads and metrics; their
sums are ordered differently, so the numbers agree within the vectorised executor's stated tolerance, not bit for
bit. A group is taken when its nodes share one architecture of standard layers without dropout, draw batches of one
size, hold a local gradient of the model's size (the global step), and ``per_teacher`` is off; otherwise the group
forms return None and the runner runs the per-node steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from algorithms.mutual_maths import (WarmClients, domain_metrics, flat_grad, project_conflicting, public_shares,
                                     random_batch, set_flat_grad, weighted_kl)
import raysim.runner.grouped as grouped
from raysim.algorithm import Algorithm, ClientUpdate, Context, ServerUpdate
from raysim.config import positive
from raysim.errors import ConfigError
from raysim.layers import Dropout
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


def soft_labels(logits: torch.Tensor, pick: torch.Tensor, py: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The local step's upload from a node's logits on its public batch ``pick``: soft labels p^i = softmax(f_i(x))
    and the batch accuracy A_i (eq. before 3), with the public indices (never the samples); and A_i."""
    p = F.softmax(logits, dim=1)
    acc = (logits.argmax(1) == py[pick]).float().mean()
    up = Message("soft_labels", {"idx": pick.cpu(), "p": p.detach().cpu(), "acc": acc.reshape(1).cpu()})
    return {"soft": up}, acc


def local_metrics(loss: torch.Tensor, acc: torch.Tensor) -> dict:
    return {"train_loss": float(loss.detach()), "public_batch_acc": float(acc)}


def public_loss(logits: list, teachers: list, py: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL term, CE term) of eq. (3) and (5): the student's ``logits`` on each teacher's public batch against the
    teachers [(A_j, idx_j, p_j)]."""
    kl = weighted_kl(logits, [p for _, _, p in teachers], [a for a, _, _ in teachers])
    ce = torch.stack([F.cross_entropy(s, py[idx]) for s, (_, idx, _) in zip(logits, teachers)]).mean()
    return kl, ce


def global_metrics(fired: list, kls: list, ces: list) -> dict:
    """The global step's metrics, each the mean over its updates (one, or one per teacher with ``per_teacher``)."""
    n = len(fired)
    return {"projected": sum(fired) / n, "train_kl": sum(kls) / n, "train_ce_public": sum(ces) / n}


class _Group:
    """The group forms' nodes' models stacked: parameters {name: [K, ...]} and their Adam
    (:class:`raysim.runner.grouped.StackedOptimizer`), built from the nodes' states (which stay the source of
    truth)."""

    def __init__(self, model, names, states, cfg, lr, device):
        self.model, self.names = model, names
        self.params = {n: torch.stack([st["model"][n].to(device) for st in states]) for n in names}
        self.opt = grouped.StackedOptimizer(cfg, self.params, [st["opt"] for st in states], lr)
        self.rows = torch.arange(len(states))

    def forward(self, params, x, training: bool):
        self.model.train(training)
        return grouped.grouped_forward(self.model, params, x, False, iter(()))

    def step(self, grads: dict) -> None:
        self.opt.step(self.params, grads, self.rows, whole=True)

    def flat(self, grads: dict, i: int) -> torch.Tensor:
        return torch.cat([grads[n][i].reshape(-1) for n in self.names])

    def unflat(self, grads: dict, i: int, g: torch.Tensor) -> None:
        off = 0
        for n in self.names:
            t = grads[n][i]
            t.copy_(g[off:off + t.numel()].view_as(t))
            off += t.numel()

    def state(self, i: int, g_loc: torch.Tensor) -> dict:
        return {"model": {n: self.params[n][i].clone() for n in self.names},
                "opt": self.opt.state_of(i, self.names), "g_loc": g_loc}


def _group(alg, states, ctxs, lr) -> Optional[_Group]:
    """The nodes as one :class:`_Group`, or None when they cannot be one (module docstring)."""
    model = ctxs[0].model()
    if any(ctx.model() is not model for ctx in ctxs[1:]) or not grouped.supported(model):
        return None
    if any(isinstance(m, Dropout) and m.p > 0 for m in model.modules()):
        return None
    names = [n for n, _ in model.named_parameters()]
    if any(set(st["model"]) != set(names) for st in states):
        return None
    return _Group(model, names, states, alg.task.train, lr, ctxs[0].device)


LOCAL = ClientStep("local", clients=ALL)
GLOBAL = ClientStep("global", fn="step_global", clients=ALL)


class MAFML(Algorithm):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    vectorize_on_cpu = True  # vectorize: auto runs the group forms on a CPU too (module docstring)
    name = "mafml"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = ("Zhou et al., Model-agnostic federated mutual learning (MAFML), 2023 — seed 003, Algorithm 1, "
             "eq. (1)-(7)")
    uploads = frozenset({"soft_labels"})

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

    # the pieces both forms of the two client steps are built from
    def _private_batch(self, data, gen) -> torch.Tensor:
        """d_loc: a batch of ``train.batch_size`` indices into the node's private + public data (``x_train``)."""
        return random_batch(data.num_train, self.task.train.batch_size, gen).to(data.y_train.device)

    def _public_batch(self, own, ctx, gen) -> torch.Tensor:
        """d_pub^i: a batch of ``public_batch`` indices into the public dataset, drawn from the node's own share."""
        mine = own[ctx.client_id]
        size = self.params.public_batch or self.task.train.batch_size
        return mine[random_batch(len(mine), size, gen).to(mine.device)]

    def _project(self, g_pub, g_loc) -> tuple[torch.Tensor, bool]:
        """g~ of eq. (7) and whether the projection fired (never with ``project: false``, the ablation)."""
        return project_conflicting(g_pub, g_loc) if self.params.project else (g_pub, False)

    # -- client: the local step (eq. 1-2, then the soft labels of a public batch) ---------------------------------
    def local(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model, opt = self.live.get(state, ctx, self.task.train.lr)
        gen = ctx.generator("batches")
        idx = self._private_batch(data, gen)
        self.live.mode(ctx, True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        g_loc = flat_grad(model).detach().clone()
        opt.step()
        # soft labels and batch accuracy on a batch of the node's own public share
        px, py, own = public_shares(self.task, ctx)
        pick = self._public_batch(own, ctx, gen)
        self.live.mode(ctx, False)
        with torch.no_grad():
            logits = model(px[pick])
        up, acc = soft_labels(logits, pick, py)
        weights, opt_state = self.live.snapshot(ctx)
        new = {"model": weights, "opt": opt_state, "g_loc": g_loc}
        self.live.done(ctx, new)
        return ClientUpdate(new, up, local_metrics(loss, acc))

    def local_group(self, payloads, states, datas, ctxs) -> Optional[list]:
        """:meth:`local` for every node of a group (module docstring): a private Adam step, the local gradient kept,
        soft labels of a batch of the node's own public share."""
        gens = [ctx.generator("batches") for ctx in ctxs]
        idx = [self._private_batch(d, g) for d, g in zip(datas, gens)]
        if len({len(i) for i in idx}) != 1:
            return None
        grp = _group(self, states, ctxs, self.task.train.lr)
        if grp is None:
            return None
        k = len(ctxs)
        xb = torch.stack([d.x_train[i] for d, i in zip(datas, idx)])
        yb = torch.stack([d.y_train[i] for d, i in zip(datas, idx)])
        leaves = {n: t.detach().requires_grad_(True) for n, t in grp.params.items()}
        logits = grp.forward(leaves, xb, True)
        c = logits.shape[-1]
        losses = F.cross_entropy(logits.reshape(-1, c), yb.reshape(-1), reduction="none").view(k, -1).mean(1)
        grads = grouped.stacked_grads(losses.sum(), leaves)
        g_locs = [grp.flat(grads, i).detach().clone() for i in range(k)]
        grp.step(grads)
        px, py, own = public_shares(self.task, ctxs[0])
        picks = [self._public_batch(own, ctx, g) for ctx, g in zip(ctxs, gens)]
        if len({len(p) for p in picks}) != 1:
            return None
        with torch.no_grad():
            pub = grp.forward(grp.params, torch.stack([px[p] for p in picks]), False)
        out = []
        for i, pick in enumerate(picks):
            up, acc = soft_labels(pub[i], pick, py)
            out.append(ClientUpdate(grp.state(i, g_locs[i]), up, local_metrics(losses[i], acc)))
        return out

    # -- client: the global step (eq. 3-7) ------------------------------------------------------------------------
    def teachers(self, payload, device):
        """[(A_j, idx_j, p_j)] of the downloaded teachers, in node order."""
        relayed = payload.get("teachers")
        if relayed is None:
            return []
        return [(float(m["acc"][0]), m["idx"].to(device), m["p"].to(device))
                for _, m in sorted(relayed.teachers.items())]

    def step_global(self, payload, state, data, ctx: Context) -> ClientUpdate:
        teachers = self.teachers(payload, ctx.device)
        if not teachers:
            return ClientUpdate(state, {}, {})
        model, opt = self.live.get(state, ctx, self.params.public_lr or self.task.train.lr)
        px, py, _ = public_shares(self.task, ctx)
        g_loc = state["g_loc"].to(ctx.device)
        groups = [[t] for t in teachers] if self.params.per_teacher else [teachers]
        fired, kls, ces = [], [], []
        self.live.mode(ctx, True)
        for group in groups:
            opt.zero_grad(set_to_none=True)
            kl, ce = public_loss([model(px[idx]) for _, idx, _ in group], group, py)
            (kl + ce).backward()
            g, hit = self._project(flat_grad(model), g_loc)
            set_flat_grad(model, g)
            opt.step()
            fired.append(float(hit))
            kls.append(float(kl.detach()))
            ces.append(float(ce.detach()))
        weights, opt_state = self.live.snapshot(ctx)
        new = {"model": weights, "opt": opt_state, "g_loc": torch.zeros(0)}
        self.live.done(ctx, new)
        return ClientUpdate(new, {}, global_metrics(fired, kls, ces))

    def step_global_group(self, payloads, states, datas, ctxs) -> Optional[list]:
        """:meth:`step_global` for every node of a group (the summed form, eq. 3-6): the student's KL + CE on its
        teachers' public batches, the conflict projection against the node's local gradient (eq. 7), an Adam step."""
        if self.params.per_teacher:
            return None
        device = ctxs[0].device
        teachers = [self.teachers(p, device) for p in payloads]
        if not teachers[0] or len({len(t) for t in teachers}) != 1 or len({len(i) for t in teachers
                                                                           for _, i, _ in t}) != 1:
            return None
        grp = _group(self, states, ctxs, self.params.public_lr or self.task.train.lr)
        if grp is None:
            return None
        size = sum(p.numel() for p in grp.params.values()) // len(ctxs)
        g_locs = [st["g_loc"].to(device) for st in states]
        if any(g.numel() != size for g in g_locs):
            return None
        px, py, _ = public_shares(self.task, ctxs[0])
        k, b = len(ctxs), len(teachers[0][0][1])
        leaves = {n: t.detach().requires_grad_(True) for n, t in grp.params.items()}
        x = torch.stack([torch.cat([px[idx] for _, idx, _ in t]) for t in teachers])  # [K, T*B, ...]
        logits = grp.forward(leaves, x, True)
        terms = [public_loss([logits[i, j * b:(j + 1) * b] for j in range(len(t))], t, py)
                 for i, t in enumerate(teachers)]
        grads = grouped.stacked_grads(sum(kl + ce for kl, ce in terms), leaves)
        fired = []
        for i in range(k):
            g, hit = self._project(grp.flat(grads, i), g_locs[i])
            if hit:
                grp.unflat(grads, i, g)
            fired.append(hit)
        grp.step(grads)
        return [ClientUpdate(grp.state(i, torch.zeros(0)), {},
                             global_metrics([float(fired[i])], [float(kl.detach())], [float(ce.detach())]))
                for i, (kl, ce) in enumerate(terms)]

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        return domain_metrics(self._load(state, ctx), data)
