"""The vectorised executor (``backend.vectorize: true``): the clients of one architecture in one client step on one
runner train together as one batched computation — ``torch.func.functional_call`` + ``vmap`` + ``grad`` over the
stacked parameters of the clients — instead of one after another.

It runs the same three functions as the per-client loop (:func:`raysim.training.local_sgd`), the pure client step of
:class:`raysim.algorithm.LocalTraining`: ``client_init`` per client (loads its starting weights, unpacks the
payload), one ``objective`` for the whole group, ``client_final`` per client (or ``client_final_group`` once for
the group). A method opts in with ``LocalTraining.vectorizable(start)``: True promises that the objective built from
``start`` depends only on what every client of the step shares (the broadcast payload) and on the client's own
inputs it declares, so one loss function serves the group, and that it is pure (the local epoch is an argument; no
side effects, no generator of its own), so it can be traced by ``vmap``.

* **per-client inputs** — ``LocalStart.rows`` (tensors, or mappings of tensors such as a state dict or a control
  variate) are stacked [K, ...] once per group (:func:`stack_rows`: rows of one earlier stack taken in one op, else
  one stack op per tensor) and handed to ``LocalTraining.row_objective(start)``'s ``loss_fn(model, xb, yb, epoch,
  rows)`` with each client's own rows (under ``vmap``, its slice; a sub-group of a step takes its rows: :func:`
  take_rows`); SCAFFOLD's c_i. ``LocalStart.frozen`` names frozen models (:class:`raysim.algorithm.FrozenForward`:
  a module in eval mode under weights shared by the group or under each client's rows) whose outputs on each step's
  batch the objective reads: the executor computes them for the group before the objective — one grouped forward
  under the stacked weights (the shared ones expanded) where the model has a grouped form, ``vmap`` of
  ``functional_call`` otherwise — and adds them to the rows; MOON's global and previous models. ``LocalStart.draws``
  (:class:`raysim.algorithm.StepDraws`) are each step's random inputs: drawn for every client of the step from its
  own stream with the loop objective's calls, in its order (FedGen's noise and labels; one draw per client and step,
  as the batch orders), stacked, then optionally turned into more inputs for the group at once (FedGen's frozen
  generator), and added to the rows. The trained stacks and the stacked rows reach ``client_final_group``
  (:class:`raysim.algorithm.TrainedGroup`).

Exactness rules (what makes the table equal to the loop's within the stated tolerance, not bit for bit):

* **batches** — each client's batch order of an epoch is the counter-based permutation of its own ``"batches"``
  stream (:func:`raysim.rng.permutations`, a pure function of (key, epoch, position)), computed for the whole group in
  one go and bit for bit the one the loop computes for the client alone, so its batches are the loop's. Clients with different data sizes have different batch
  counts and a smaller last batch: at every step the executor groups the clients that still train by their batch
  size and local epoch (the loss function receives the epoch, as in the loop) and runs one batched computation per
  group (no padding, so every client's loss is the mean over exactly its own batch, as in the loop); a client that
  has finished its steps keeps its weights.
* **dropout** — client i's j-th mask is the counter-based mask number j of its own ``"dropout"`` stream
  (:func:`raysim.rng.keep_masks`, a pure function of (key, mask number, element)), computed for the whole group in one
  go per mask of the step (shapes found by a probe forward per batch size and epoch) and fed to the batched forward
  (``models.replay_masks``): the masks are the loop's masks, bit for bit, and their cost does not grow with the group.
* **optimisers** — SGD (momentum, weight decay) and Adam (weight decay, bias correction) are applied to the stacked
  tensors with torch's own update formulas; per-client state (momentum buffers, Adam moments and step counts) goes in
  and out in the loop's format (``training.optimizer_state``), so ``persist_optimizer`` and repeated steps work.
* **BatchNorm** — per-client running statistics, batched: each client's ``running_mean`` / ``running_var`` /
  ``num_batches_tracked`` (from its starting state dict) are stacked [K, C] and updated in place by the batched
  forward, each from its own batch as ``nn.BatchNorm2d`` updates them for one client (the batch's biased variance
  normalises, the unbiased one enters the running average, with the layer's momentum and eps and the client's own
  affine weight and bias); the grouped network runs a layer as one ``F.batch_norm`` over the K*C channels, ``vmap``
  passes each client its own rows of the stacks. The trained statistics come back with the trained parameters (the
  client's state and upload carry them). Refused (``check_model``: a ConfigError naming ``backend.vectorize``):
  ``momentum=None`` (a cumulative average, one factor per client) and ``SyncBatchNorm``.

* **grouped execution** — for a model built from standard layers (:func:`raysim.runner.grouped.supported`; batch norm and
  the zoo's residual blocks included) whose objective calls it only on the step's batch (seen by the shape probe), the
  group's forward runs as one grouped computation in channels-last layout (channels-first with batch norm) and the
  per-client gradients come from autograd over the stacked parameters (:mod:`raysim.runner.grouped`; ~2x faster than
  ``vmap`` on CPUs); any other model or objective uses ``vmap``.

Floating-point sums inside batched kernels are ordered differently from per-client kernels, so the numbers differ
from the loop's in the last bits (the equality policy's "stated tolerance": metrics within 1e-4).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn as nn

from raysim.config import TrainConfig
from raysim import rng as rngmod
from raysim.runner import fallbacks, grouped as _grouped
from raysim.errors import ConfigError
from raysim.runner.grouped import StackedOptimizer
from raysim.layers import _MASKS
from raysim.messages import row_source
from raysim.models import dropout_masks_of, replay_masks
from raysim.training import accumulate_metric


def check_model(model: nn.Module, arch: str = "") -> None:
    """Refuse (a ConfigError naming ``backend.vectorize``) the batch-norm layers the executor cannot batch: a
    cumulative average (``momentum=None``: each client's factor is 1 / its own ``num_batches_tracked``, a host read
    per client and step) and ``SyncBatchNorm`` (statistics across processes)."""
    for m in model.modules():
        if not isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        why = None
        if isinstance(m, nn.SyncBatchNorm):
            why = "SyncBatchNorm (statistics across processes)"
        elif m.track_running_stats and m.momentum is None:
            why = (f"{type(m).__name__} with momentum=None (a cumulative average of the running statistics: each "
                   f"client's factor is 1 / its own num_batches_tracked)")
        if why is not None:
            raise ConfigError("backend.vectorize", f"the vectorised executor cannot batch {why} in model "
                                                   f"{arch or type(model).__name__}; use backend.vectorize: false, or "
                                                   f"a momentum")


def running_stat_names(model: nn.Module) -> list[str]:
    """The buffers a training forward updates, each client's own in a vectorised group: the running statistics of
    every batch-norm layer that tracks them (``running_mean``, ``running_var``, ``num_batches_tracked``), in the
    model's buffer order."""
    names = []
    for prefix, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            names += [f"{prefix}.{b}" if prefix else b for b, t in m.named_buffers(recurse=False) if t is not None]
    return names


class _FunctionalModel(_grouped.ParameterView):
    """What an objective sees as ``model`` inside the batched computation: calling it runs the live module's forward
    under the (batched) parameters; ``named_parameters()`` / ``parameters()`` give those parameters (FedProx's
    proximal term); a child module (``model.head``: FedGen) is called under its part of them; other attributes
    (``embed_dim``, ...) come from the live module."""

    def __init__(self, module: nn.Module, params: dict, buffers: dict):
        self._module, self._params, self._buffers = module, params, buffers

    def __call__(self, *args, **kwargs):
        return torch.func.functional_call(self._module, (self._params, self._buffers), args, kwargs)

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if isinstance(value, nn.Module) and name in self._module._modules:  # a child (model.head): under the same
            pre = name + "."  # parameters and buffers, the client's
            sub = {n[len(pre):]: t for n, t in {**self._params, **self._buffers}.items() if n.startswith(pre)}
            return lambda *args, **kwargs: torch.func.functional_call(value, sub, args, kwargs)
        return value


def _const(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _detached(parts: dict) -> dict:
    """An objective's ``parts`` (floats or tensors) as detached tensors, the form vmap can return."""
    return {key: (v if torch.is_tensor(v) else torch.tensor(float(v))).detach() for key, v in parts.items()}


@dataclass
class Member:
    """One client of a vectorised group: its starting parameters (name -> tensor), its training data, its own
    counter-based batch-order and dropout streams (:class:`raysim.rng.Counter`), and its optimiser state (None:
    fresh)."""

    params: dict
    x: torch.Tensor
    y: torch.Tensor
    batches: rngmod.Counter
    dropout: rngmod.Counter
    opt_state: Optional[dict] = None


def vmap_local_sgd(model: nn.Module, loss_fn: Callable, members: list[Member], cfg: TrainConfig,
                   grouped: bool = True, inputs: Optional["ClientInputs"] = None) -> tuple[list[dict], list[dict],
                                                                                              list[dict]]:
    """Train K clients of one architecture together (``cfg.local_epochs`` epochs at ``cfg.lr``);
    ``loss_fn(model, xb, yb, epoch) -> (loss, parts)``, shared by the group. Returns per client (trained parameters,
    ``train_*`` metrics, optimiser state), as :func:`raysim.training.local_sgd` does for one client (the trained
    parameters with the batch-norm running statistics, where the model has any). ``grouped``: use
    grouped execution (:mod:`raysim.runner.grouped`) where the model and the objective allow it, else ``vmap`` throughout.
    ``inputs``: the clients' own inputs of the objective (:class:`ClientInputs`); then
    ``loss_fn(model, xb, yb, epoch, rows)`` receives each client's rows (``LocalTraining.row_objective``)."""
    stacks, metrics, opt = _GroupTraining(model, loss_fn, members, cfg, grouped, inputs).run()
    return [{n: t[i] for n, t in stacks.items()} for i in range(len(members))], metrics, opt


def train_group(model: nn.Module, loss_fn: Callable, members: list[Member], cfg: TrainConfig,
                grouped: bool = True, inputs: Optional["ClientInputs"] = None) -> tuple[dict, list[dict], list[dict]]:
    """:func:`vmap_local_sgd` with the trained parameters as stacks (name -> [K, ...], in the model's parameter
    order, then the batch-norm running statistics (:func:`running_stat_names`); client i's are row i): what the
    vectorised executor hands to a method's ``client_final_group``."""
    return _GroupTraining(model, loss_fn, members, cfg, grouped, inputs).run()


@dataclass(frozen=True)
class ClientInputs:
    """A group's per-client inputs of the objective: ``rows`` (the clients' ``LocalStart.rows``, :func:`stack_rows`)
    and ``frozen`` (name -> :class:`raysim.algorithm.FrozenForward`, the first client's ``LocalStart.frozen``: frozen
    models whose outputs on every step's batch are computed for the group and added to the rows under their
    names)."""

    rows: dict
    frozen: dict = field(default_factory=dict)
    draws: Optional[list] = None  # per client: its StepDraws (raysim.algorithm), or None


def _rows_of_one(mappings: list, name: str) -> torch.Tensor:
    """``mappings[i][name]`` of every client as one [K, ...] tensor, read-only: the stack itself (or its rows, one
    op) when every entry is a row of one earlier stack (:class:`raysim.messages.Rows`), else one stack op."""
    src = [row_source(m, name) for m in mappings]
    if all(s is not None for s in src) and all(s[0] is src[0][0] for s in src):
        base, rows = src[0][0][name], [s[1] for s in src]
        return base if rows == list(range(base.shape[0])) else base[torch.as_tensor(rows, device=base.device)]
    return torch.stack([_const(m[name]) for m in mappings])


def stack_rows(rows: list[dict]) -> dict:
    """The clients' per-client inputs of the objective (each client's ``LocalStart.rows``: one structure) stacked:
    key -> [K, ...] for a tensor, key -> {name: [K, ...]} for a mapping (a state dict, a control variate, rows of
    a group's stacks), one operation per tensor at most. Never written to."""
    out: dict = {}
    for key, first in rows[0].items():
        if torch.is_tensor(first):
            out[key] = torch.stack([_const(r[key]) for r in rows])
        else:
            mappings = [r[key] for r in rows]
            out[key] = {name: _rows_of_one(mappings, name) for name in first}
    return out


def take_rows(rows, index):
    """``rows`` (:func:`stack_rows`, with frozen models' outputs) at ``index`` (an int: one client's rows; a tensor:
    a sub-group's stacks), tensor by tensor through dicts, tuples and lists."""
    if torch.is_tensor(rows):
        return rows[index]
    if isinstance(rows, (tuple, list)):
        return type(rows)(take_rows(v, index) for v in rows)
    return {k: take_rows(v, index) for k, v in rows.items()}


def _stack(params: list, name: str, like: torch.Tensor) -> torch.Tensor:
    """The clients' starting values of parameter ``name`` as one new [K, ...] tensor on ``like``'s device and dtype:
    rows of one earlier stack (a group's states from its last round: :class:`raysim.messages.Rows`) taken in one op,
    anything else stacked in one op."""
    src = [row_source(p, name) for p in params]
    if all(s is not None for s in src) and all(s[0] is src[0][0] for s in src):
        base, rows = src[0][0][name], [s[1] for s in src]
        t = base.clone() if rows == list(range(base.shape[0])) else base[torch.as_tensor(rows, device=base.device)]
    else:
        t = torch.stack([_const(p[name]).to(like.device) for p in params])
    return t.to(device=like.device, dtype=like.dtype)


class _GroupTraining:
    def __init__(self, model: nn.Module, loss_fn: Callable, members: list[Member], cfg: TrainConfig, grouped: bool,
                 inputs: Optional[ClientInputs] = None):
        self.model, self.loss_fn, self.members, self.cfg = model, loss_fn, members, cfg
        # the clients' own inputs of the objective, stacked, and its frozen models (None: the objective takes none)
        self.rows, self.with_rows = (inputs.rows, True) if inputs is not None else ({}, False)
        self.frozen_models = dict(inputs.frozen) if inputs is not None else {}
        self.frozen_grouped: dict = {}  # name -> whether that frozen model runs as a grouped forward
        self.draws = inputs.draws if inputs is not None else None  # per client: its step draws (StepDraws) or None
        self.k = len(members)
        params = [m.params for m in members]
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}  # frozen ones (a fixed head): no step
        self.names = [n for n in params[0] if n in trainable]
        live = dict(model.named_parameters())
        self.order = [n for n in live if n in params[0]]
        # each a new tensor (the optimiser updates it in place)
        self.stacked = {n: _stack(params, n, live[n]) for n in self.names}
        self.frozen = {n: _stack(params, n, live[n]) for n in self.order if n not in trainable}
        # the batch-norm running statistics: each client's own, stacked (updated in place by the training forwards;
        # a client whose start lacks them starts from the live model's); other buffers are shared, never written
        live_buffers = dict(model.named_buffers())
        self.stat_names = running_stat_names(model)
        self.stats = {n: _stack(params, n, live_buffers[n]) if n in params[0] else
                      live_buffers[n].detach().unsqueeze(0).repeat(self.k, *([1] * live_buffers[n].dim()))
                      for n in self.stat_names}
        self.buffers = {n: b for n, b in live_buffers.items() if n not in self.stats}
        self.proven: set = set()  # (batch size, epoch) whose grouped step ran once (its failure then updates nothing)
        self.opt = StackedOptimizer(cfg, self.stacked, [m.opt_state for m in members], cfg.lr)
        # (epoch, first, end) of each client's batches; their indices are slices of the client's batch order of the
        # epoch, the counter-based permutations of the whole group computed at once (rng.permutations: the loop's bits)
        sizes, bs = [int(m.y.shape[0]) for m in members], cfg.batch_size
        self.plans = [[(e, lo, min(lo + bs, n)) for e in range(cfg.local_epochs) for lo in range(0, n, bs)]
                      for n in sizes]
        bases = [m.batches.base for m in members]
        self.perms = [rngmod.permutations(bases, e, sizes) for e in range(cfg.local_epochs)]  # [K, max n] each, host
        self.drop_bases: Optional[torch.Tensor] = None  # the dropout streams' folded keys, [K] (on first use)
        self.drawn = [0] * self.k  # masks each client has drawn so far (the counter of its next mask)
        # clients with data of one shape (the usual case): their data stacked once, each step's batches gathered for
        # all of them in one indexing op; each step's losses kept as one vector (per-client sums at the end)
        self.uniform = self.k > 1 and len({(tuple(m.x.shape), tuple(m.y.shape), m.x.device) for m in members}) == 1
        if self.uniform:
            self.xs, self.ys = torch.stack([m.x for m in members]), torch.stack([m.y for m in members])
            self.ar = torch.arange(self.k, device=self.xs.device).unsqueeze(1)
            self.idx = [self.perms[e][:, lo:hi].to(self.xs.device) for e, lo, hi in self.plans[0]]
        self.step_values: list = []  # uniform groups: per step, (loss vector, {part: vector}) of every client
        self.probes: dict[tuple, list] = {}  # (batch size, epoch) -> the dropout masks one forward draws
        self.draw_cache: dict[tuple, dict] = {}  # (clients, probe) -> what stacked step draws compute once (StepDraws)
        self.calls: dict[tuple, Optional[list]] = {}  # (batch size, epoch) -> the objective's model calls (None: vmap)
        self.use_grouped = grouped and bool(self.names) and _grouped.supported(model)
        self.grad_fn = torch.func.vmap(torch.func.grad(self._one, has_aux=True), in_dims=(0, 0, 0, 0, 0, None))
        self.totals: list[dict] = [{} for _ in range(self.k)]
        self.counts = [0] * self.k

    def _idx(self, i: int, s: int) -> torch.Tensor:
        """Client ``i``'s batch indices at its step ``s``."""
        e, lo, hi = self.plans[i][s]
        return self.perms[e][i, lo:hi]

    def probe(self, b: int, epoch: int, i: int) -> list:
        """The dropout masks (shape, dtype, p) one forward of batch size ``b`` draws, and the objective's model
        calls, found once per (batch size, epoch) on client ``i``'s first batch with a throw-away generator."""
        if (b, epoch) in self.probes:
            return self.probes[b, epoch]
        from raysim.models import set_dropout_generator

        fm = _FunctionalModel(self.model, {**{n: self.stacked[n][i] for n in self.names},
                                           **{n: t[i] for n, t in self.frozen.items()}},
                              {**self.buffers, **{n: t[i].clone() for n, t in self.stats.items()}})  # not updated
        first = self._idx(i, 0)[:b]
        x0, y0 = self.members[i].x[first], self.members[i].y[first]
        with torch.no_grad():  # the clients' own streams are untouched
            set_dropout_generator(self.model, torch.Generator(device=x0.device))
            rec = _grouped.RecordingModel(fm, x0, lambda: len(_MASKS.record))
            done = []

            def forward():
                self._loss(rec, x0, y0, epoch, take_rows(self._step_draws(self._frozen_outputs(
                    take_rows(self.rows, torch.tensor([i], device=x0.device)), x0.unsqueeze(0)), [i], y0.unsqueeze(0),
                    True), 0))
                done.append(rec.finished())  # while the masks are still being recorded

            try:
                self.probes[b, epoch] = dropout_masks_of(forward)
                self.calls[b, epoch] = rec.calls if self.use_grouped and done[0] and rec.calls else None
            finally:
                set_dropout_generator(self.model, None)
        return self.probes[b, epoch]

    def _masks(self, group: list[int], rows: torch.Tensor, whole: bool, spec: list, device) -> list:
        """The dropout masks of one step of ``group`` (the probe's ``spec``: shape, dtype, p of each), each [len(group),
        *shape]: client i's mask number ``drawn[i] + j`` of its counter-based stream, the loop's bits, computed for the
        whole group in one go."""
        if not spec:
            return []
        if self.drop_bases is None:
            self.drop_bases = rngmod.stacked_bases([m.dropout for m in self.members], device)
        bases = self.drop_bases if whole else self.drop_bases[rows]
        first = self.drawn[group[0]]
        if all(self.drawn[i] == first for i in group):
            draws = [first + j for j in range(len(spec))]
        else:  # clients at different mask counts (an objective whose draws depend on the batch): one counter each
            at = torch.tensor([self.drawn[i] for i in group], dtype=torch.int64, device=device)
            draws = [at + j for j in range(len(spec))]
        for i in group:
            self.drawn[i] += len(spec)
        return [rngmod.keep_masks(bases, d, shape, p, dt, device) for d, (shape, dt, p) in zip(draws, spec)]

    def _frozen_outputs(self, rows: dict, xb: torch.Tensor) -> dict:
        """``rows`` (the clients' of ``xb`` [K', B, ...]) with each frozen model's outputs on ``xb`` added under its
        name, stacked [K', ...]: one grouped forward under the stacked weights (the shared ones expanded, a view),
        else ``vmap``; without autograd."""
        if not self.frozen_models:
            return rows
        out = dict(rows)
        with torch.no_grad():
            for name, f in self.frozen_models.items():
                own = isinstance(f.weights, str)  # the client's own weights: a rows entry
                w = rows[f.weights] if own else f.weights
                if self.frozen_grouped.setdefault(name, _grouped.supported(f.module)
                                                  and set(f.kwargs) <= {"return_embedding"}):
                    params = dict(w) if own else {n: t.unsqueeze(0).expand(xb.shape[0], *t.shape) for n, t in w.items()}
                    try:
                        out[name] = _grouped.grouped_forward(f.module, params, xb,
                                                             bool(f.kwargs.get("return_embedding", False)), iter(()))
                        continue
                    except _grouped.Ineligible as err:
                        self.frozen_grouped[name] = False
                        fallbacks.note("the grouped forward of a frozen model", "it runs with vmap", err)
                out[name] = torch.func.vmap(lambda wi, xi, f=f: torch.func.functional_call(f.module, wi, (xi,), f.kwargs),
                                            in_dims=(0 if own else None, 0))(dict(w), xb)
        return out

    def _step_draws(self, rows: dict, group: list, yb: torch.Tensor, probe: bool = False) -> dict:
        """``rows`` with the step's random inputs of the clients ``group`` (labels ``yb`` [K', B]) added: each
        :class:`raysim.algorithm.StepDraws` called on its own stream, in the loop's order (the probe's on a
        throw-away generator), stacked; then its ``group`` inputs from the stacks, without autograd."""
        draws = self.draws and [self.draws[i] for i in group]
        if not draws or draws[0] is None:
            return rows
        b = int(yb.shape[1])
        if probe:  # on throw-away streams: the clients' own are untouched
            draws = [replace(d, generator=rngmod.Counter(d.generator.key) if isinstance(d.generator, rngmod.Counter)
                             else torch.Generator(device=d.generator.device)) for d in draws]
        if draws[0].stacked is not None and len({d.generator.drawn for d in draws}) == 1:  # the group's at once
            out = {**rows, **draws[0].stacked(b, draws, self.draw_cache.setdefault((tuple(group), probe), {}))}
        else:
            got = [d.fn(b, d.generator) for d in draws]
            out = {**rows, **{key: torch.stack([g[key] for g in got]) for key in got[0]}}
        if draws[0].group is not None:
            with torch.no_grad():
                out.update(draws[0].group(out, yb))
        return out

    def _loss(self, model, xb, yb, epoch, rows):
        """The objective on one client's batch (and, where it takes them, its own rows)."""
        if self.with_rows:
            return self.loss_fn(model, xb, yb, epoch, rows)
        return self.loss_fn(model, xb, yb, epoch)

    def _one(self, p, fixed, xb, yb, masks, epoch):
        fz, st, rows = fixed  # st: the client's running statistics (its rows of the stacks, updated in place)
        with replay_masks(masks):
            loss, parts = self._loss(_FunctionalModel(self.model, {**p, **fz}, {**self.buffers, **st}), xb, yb,
                                     epoch, rows)
        return loss, (loss.detach(), _detached(parts))

    def _grouped_grad(self, p, fixed, batch, masks, epoch, seen):
        """The model's forward for the group at once, the objective per client under vmap on its outputs,
        per-client gradients by autograd of the summed losses (raysim.runner.grouped); ``fixed``: (the frozen parameters,
        the group's running statistics, updated in place)."""
        (fz, st, rows), (xb, yb) = fixed, batch
        leaves = {n: t.detach().requires_grad_(True) for n, t in p.items()}
        every, it = {**leaves, **fz, **st}, iter(masks)
        outs = [_grouped.grouped_forward(self.model, every, xb, bool(kw.get("return_embedding", False)), it)
                for kw in seen]

        def obj(lp, lfz, louts, lxb, lyb, lrows):
            replay = _grouped.ReplayModel(self.model, {**lp, **lfz}, lxb, louts, seen)
            loss, parts = self._loss(replay, lxb, lyb, epoch, lrows)
            return loss, _detached(parts)

        losses, parts = torch.func.vmap(obj)(leaves, fz, outs, xb, yb, rows)
        return _grouped.stacked_grads(losses.sum(), leaves), (losses.detach(), parts)

    def step(self, s: int) -> None:
        """Step ``s`` of every client that still trains, grouped by batch size and epoch (the loss function receives
        the epoch: one value per batched computation)."""
        by_size: dict[tuple, list[int]] = {}
        for i in range(self.k):
            if s < len(self.plans[i]):
                e, lo, hi = self.plans[i][s]
                by_size.setdefault((hi - lo, e), []).append(i)
        for (b, e), group in by_size.items():
            self._group_step(s, b, e, group)

    def _group_step(self, s: int, b: int, e: int, group: list[int]) -> None:
        spec = self.probe(b, e, group[0])
        ms = [self.members[i] for i in group]
        whole = len(group) == self.k
        if self.uniform and whole:  # every client's batch of this step in one gather
            xb, yb = self.xs[self.ar, self.idx[s]], self.ys[self.ar, self.idx[s]]
        else:
            xb = torch.stack([m.x[self._idx(i, s).to(m.x.device)] for i, m in zip(group, ms)])
            yb = torch.stack([m.y[self._idx(i, s).to(m.y.device)] for i, m in zip(group, ms)])
        rows = torch.as_tensor(group, device=xb.device)  # indexes the stacked tensors and optimiser state
        masks = self._masks(group, rows, whole, spec, xb.device)
        sub = self.stacked if whole else {n: t[rows] for n, t in self.stacked.items()}
        fz = self.frozen if whole else {n: t[rows] for n, t in self.frozen.items()}
        st = self.stats if whole else {n: t[rows] for n, t in self.stats.items()}  # updated in place by the forward
        rs = self._frozen_outputs(self.rows if whole else take_rows(self.rows, rows), xb)  # per-client inputs
        rs = self._step_draws(rs, group, yb)
        seen, out = self.calls.get((b, e)), None
        if seen is not None:
            # until a grouped step of this shape has run once, it runs on copies of the running statistics (a failure
            # part-way must not leave them updated twice)
            trial = {n: t.clone() for n, t in st.items()} if st and (b, e) not in self.proven else st
            try:
                out = self._grouped_grad(sub, (fz, trial, rs), (xb, yb), masks, e, seen)
            except Exception as err:  # Ineligible, or a model the grouped form mis-reads: the objective is pure, so
                self.calls[b, e] = None  # the step runs with vmap instead (which raises a genuine error itself)
                fallbacks.note("the grouped forward (raysim.runner.grouped)", "its steps run with vmap", err)
            else:
                self.proven.add((b, e))
                for n, t in (trial.items() if trial is not st else ()):
                    st[n].copy_(t)
        grads, (loss, parts) = out if out is not None else self.grad_fn(sub, (fz, st, rs), xb, yb, masks, e)
        if not whole:
            for n, t in st.items():
                self.stats[n][rows] = t
        self.opt.step(self.stacked, grads, rows, whole, host_rows=group)
        if self.uniform and whole and all(torch.is_tensor(v) and v.dim() == 1 for v in parts.values()):
            self.step_values.append((loss.detach(), {key: v.detach() for key, v in parts.items()}))
            return
        self._flush_steps()  # a step that is not the whole group: the per-client sums from here on
        for j, i in enumerate(group):
            self.counts[i] += 1
            accumulate_metric(self.totals[i], "loss", loss[j])  # on the device: no host synchronisation per step
            for key, v in parts.items():
                accumulate_metric(self.totals[i], key, v[j])

    def _flush_steps(self) -> None:
        """Fold the whole-group steps kept as vectors into the per-client sums (float64, in step order: one stack and
        one sequential scan down the steps, the sums the per-client accumulation makes)."""
        if not self.step_values:
            return
        keys = ["loss"] + sorted(self.step_values[0][1])
        if any(sorted(parts) != keys[1:] for _, parts in self.step_values):
            raise ValueError("an objective's parts changed between steps")
        table = torch.stack([torch.stack([loss] + [parts[k] for k in keys[1:]]) for loss, parts in self.step_values])
        sums = table.to(torch.float64).cumsum(0)[-1]  # [metrics, K]
        if not any(self.totals) and not any(self.counts):  # the usual case, every step whole: the means at once
            self.means = (keys, sums / len(self.step_values), len(self.step_values))
        for m, key in enumerate(keys):
            for i, v in enumerate(sums[m].unbind()):
                self.totals[i][key] = self.totals[i][key] + v if key in self.totals[i] else v
        for i in range(self.k):
            self.counts[i] += len(self.step_values)
        self.step_values = []

    def _metrics(self) -> list[dict]:
        """Each client's ``train_*`` means (0-dim tensors: the runner reads them once per step)."""
        means = getattr(self, "means", None)
        if means is not None and all(c == means[2] for c in self.counts):  # the means of one flush: no op a client
            keys, table, _ = means
            cols = [row.unbind() for row in table.unbind()]
            return [{f"train_{key}": cols[m][i] for m, key in enumerate(keys)} for i in range(self.k)]
        return [{f"train_{key}": v / max(self.counts[i], 1) for key, v in self.totals[i].items()}
                for i in range(self.k)]

    def run(self) -> tuple[list[dict], list[dict], list[dict]]:
        self.model.train()
        for s in range(max((len(p) for p in self.plans), default=0)):
            self.step(s)
        self._flush_steps()
        # the trained parameters, stacked (nothing writes to them after the last step), in the model's order, then the
        # clients' running statistics
        stacks = {n: self.stacked[n] if n in self.stacked else self.frozen[n] for n in self.order}
        stacks.update(self.stats)
        opt = ([self.opt.state_of(i, self.names) for i in range(self.k)] if self.cfg.persist_optimizer
               else [{} for _ in range(self.k)])
        return stacks, self._metrics(), opt
