"""Local training and evaluation helpers shared by the methods (tensor slicing, no DataLoader overhead).

:func:`local_sgd` is the per-client loop executor, the reference that a vectorised executor must match: minibatch
SGD/Adam on a loss function ``loss_fn(model, xb, yb, epoch) -> (loss, parts)``, where ``model`` is a forward under the
client's parameters, buffers and dropout generator and ``epoch`` the 0-based local epoch of the batch (every loss
function of the training loops has this signature; most ignore the epoch). Randomness is explicit (a batch-order
stream and a dropout stream, both derived from (seed, round, client)): the local-training methods' streams are
counter-based (:class:`raysim.rng.Counter`: the draws a pure function of (key, epoch or mask number, element), the same
bits the vectorised executor computes for a whole group at once); a method's own loop may pass torch generators;
optimiser state comes in and goes out as a plain dict keyed by parameter
name, so it can live in the client's state (``train.persist_optimizer``) or across the repeated steps of a round.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

from raysim.config import TrainConfig
from raysim.rng import Counter


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimiser named without a train section: ``kind`` (``"sgd"`` | ``"adam"``), learning rate, momentum (SGD),
    weight decay, Adam's ``betas`` (torch's default when None; the GANs use (0.5, 0.999))."""
    kind: str
    lr: Optional[float] = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: Optional[tuple] = None

    @classmethod
    def of(cls, cfg: TrainConfig, **change) -> "OptimizerSpec":
        """The train section's optimiser (``cfg.optimizer``, ``lr``, ``momentum``, ``weight_decay``), with
        ``change`` applied (e.g. ``kind="adam"``)."""
        return replace(cls(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay), **change)


# -- torch's optimisers without the torch._dynamo import ---------------------------------------------------------------
# torch.optim wraps Optimizer.step, zero_grad, add_param_group, state_dict and load_state_dict for torch.compile; each
# wrapper imports torch._dynamo on its first call (about 1 s of CPU and 145 MB in every process that trains: each Ray
# actor, trial worker and CLI run). The classes below are torch's SGD and Adam (isinstance holds, the same
# param_groups, state, hooks and state_dict) whose methods call torch's own functions behind those wrappers, in the
# grad mode the step wrapper sets: the same arithmetic, bit for bit (tests/test_lean_methods.py). Under torch.compile
# torch's wrapped functions run, as in torch's classes. Only the wrappers known to do nothing else are looked behind
# (_KNOWN); a torch version with other wrappers, or without torch.compiler.is_compiling, gets torch's classes.

_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
# a wrapper is known by its code (functools.wraps copies the wrapped function's names): (file, qualified name)
_STEP_HOOKS = ("optimizer.py", "Optimizer.profile_hook_step.<locals>.wrapper")  # torch's per-class step hooks
_KNOWN = {"step": (("optimizer.py", "_use_grad_for_differentiable.<locals>._use_grad"),),  # grad mode, graph breaks
          **{name: (("_compile.py", "_disable_dynamo.<locals>.inner"),) for name in _WRAPPED}}  # dynamo.disable


def _code_of(fn) -> tuple:
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("", "")
    return (code.co_filename.replace("\\", "/").rsplit("/", 1)[-1], getattr(code, "co_qualname", code.co_name))


def _same_code(found: tuple, known: tuple) -> bool:
    return found[0] == known[0] and found[1] in (known[1], known[1].rsplit(".", 1)[-1])  # co_qualname: Python 3.11+


def _functions(cls, name: str):
    """(torch's wrapped function without the per-class step hooks, torch's function behind the wrappers) of
    ``cls.name``, or None where the wrappers are not exactly the known ones."""
    fn = getattr(cls, name)
    if _same_code(_code_of(fn), _STEP_HOOKS):
        fn = fn.__wrapped__
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    known = _KNOWN[name]
    if len(chain) != len(known) + 1 or not all(_same_code(_code_of(f), k) for f, k in zip(chain, known)):
        return None
    raw = chain[-1]
    return (fn, raw) if getattr(raw, "__qualname__", "").endswith(f".{name}") else None


class _WithoutDynamoImport:
    _wrapped: dict = {}
    _raw: dict = {}

    def step(self, closure=None):
        if torch.compiler.is_compiling():
            return self._wrapped["step"](self, closure)
        prev = torch.is_grad_enabled()
        try:  # what torch's step wrapper does, but for the graph breaks
            torch.set_grad_enabled(self.defaults["differentiable"])
            return self._raw["step"](self, closure)
        finally:
            torch.set_grad_enabled(prev)

    def zero_grad(self, set_to_none: bool = True):
        fns = self._wrapped if torch.compiler.is_compiling() else self._raw
        return fns["zero_grad"](self, set_to_none)

    def add_param_group(self, param_group):
        fns = self._wrapped if torch.compiler.is_compiling() else self._raw
        return fns["add_param_group"](self, param_group)

    def state_dict(self):
        fns = self._wrapped if torch.compiler.is_compiling() else self._raw
        return fns["state_dict"](self)

    def load_state_dict(self, state_dict):
        fns = self._wrapped if torch.compiler.is_compiling() else self._raw
        return fns["load_state_dict"](self, state_dict)


def _eager(base):
    found = {name: _functions(base, name) for name in ("step", *_WRAPPED)}
    if any(f is None for f in found.values()) or not hasattr(torch.compiler, "is_compiling"):
        return base
    return type(base.__name__, (_WithoutDynamoImport, base), {
        "_wrapped": {k: f[0] for k, f in found.items()}, "_raw": {k: f[1] for k, f in found.items()},
        "__module__": __name__, "__doc__": f"torch.optim.{base.__name__}, without the torch._dynamo import "
                                          f"(raysim.training)"})


SGD, Adam = _eager(torch.optim.SGD), _eager(torch.optim.Adam)


def make_optimizer(params, cfg: "TrainConfig | OptimizerSpec | None" = None, lr: Optional[float] = None,
                   state: Optional[dict] = None, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
    """The one optimiser builder: ``cfg``'s optimiser (a train section, or an :class:`OptimizerSpec` for one that
    is not the clients' -- a generator's, a GAN's) over ``params``, with learning rate ``lr`` when given. A saved
    ``state`` (from :func:`optimizer_state`; e.g. kept with ``train.persist_optimizer``) is loaded by ``model``'s
    parameter names."""
    spec = cfg if isinstance(cfg, OptimizerSpec) or cfg is None else OptimizerSpec.of(cfg)
    kind = spec.kind if spec is not None else None
    lr = lr if lr is not None else (spec.lr if spec is not None else None)
    if kind not in ("sgd", "adam") or lr is None:
        raise TypeError(f"make_optimizer needs kind 'sgd' or 'adam' and a learning rate (from cfg or given), got "
                        f"kind={kind!r}, lr={lr!r}")
    if kind == "adam":
        opt = Adam(params, lr=lr, weight_decay=spec.weight_decay, **({"betas": spec.betas} if spec.betas else {}))
    else:
        opt = SGD(params, lr=lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if state:
        if model is None:
            raise TypeError("make_optimizer: a saved state is loaded by parameter names: pass model=")
        load_optimizer_state(opt, model, state)
    return opt


def minibatches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled index batches for one epoch (the last, smaller batch is kept)."""
    perm = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        yield perm[start:start + batch_size]


def optimizer_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """The optimiser's per-parameter state as {parameter name: {key: tensor}} (copies)."""
    ids = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        if id(p) in ids and st:
            out[ids[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, model: nn.Module, state: dict) -> None:
    params = dict(model.named_parameters())
    for name, st in (state or {}).items():
        p = params.get(name)
        if p is not None:
            opt.state[p] = {k: (v.to(p.device).clone() if torch.is_tensor(v) and v.dim() > 0 else
                                (v.clone() if torch.is_tensor(v) else v)) for k, v in st.items()}


@dataclass(frozen=True)
class TrainOptions:
    """A local training call's options: the train section, the batch-order stream and the dropout stream (each a
    counter-based :class:`raysim.rng.Counter` or a torch generator; dropout None: the model's dropout draws from
    torch's global stream), ``epochs`` (default ``cfg.local_epochs``), the learning
    rate (default ``cfg.lr``) and whether :func:`local_sgd` returns the optimiser state (``optimizer_out``)."""
    cfg: TrainConfig
    batches: Union[torch.Generator, Counter]
    dropout: Union[torch.Generator, Counter, None] = None
    epochs: Optional[int] = None
    lr: Optional[float] = None
    optimizer_out: bool = True  # local_sgd returns the optimiser state (False: {} -- nobody keeps it, no copies)

    @property
    def num_epochs(self) -> int:
        return self.cfg.local_epochs if self.epochs is None else self.epochs


def local_sgd(model: nn.Module, objective: Callable, x: torch.Tensor, y: torch.Tensor, run: TrainOptions,
              opt_state: Optional[dict] = None) -> tuple[dict, dict]:
    """``run.num_epochs`` of minibatch training of the live ``model`` with the loss function
    ``objective(model, xb, yb, epoch)``, the optimiser built from ``run.cfg`` (and ``run.lr``) with the saved
    ``opt_state``. Returns (mean losses as ``train_*`` metrics: 0-dim float64 tensors on the data's device, read by
    the runner once per step for all its clients; the optimiser state after the last step, or {} when
    ``run.optimizer_out`` is off)."""
    from raysim.models import set_dropout_generator

    set_dropout_generator(model, run.dropout)
    try:
        opt = make_optimizer(model.parameters(), run.cfg, run.lr, opt_state, model)
        metrics = _train_loop(model, x, y, run, objective, opt)
        return metrics, (optimizer_state(opt, model) if run.optimizer_out else {})
    finally:
        set_dropout_generator(model, None)


def train_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, run: TrainOptions, loss_fn: Callable,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Run ``run.num_epochs`` of minibatch training with ``loss_fn(model, xb, yb, epoch) -> (loss, parts dict)`` and
    ``optimizer`` (default: built from ``run.cfg``); returns mean losses (Python floats)."""
    from raysim.models import set_dropout_generator

    set_dropout_generator(model, run.dropout)
    try:
        opt = optimizer or make_optimizer(model.parameters(), run.cfg)
        return {k: float(v) for k, v in _train_loop(model, x, y, run, loss_fn, opt).items()}
    finally:
        set_dropout_generator(model, None)


def epoch_count(cfg, n: int, epochs: int) -> int:
    """How many epochs the training loop runs over ``n`` samples: ``epochs``, or with ``cfg.local_steps`` enough
    epochs for that many steps (the loop stops after the last step, possibly inside the last epoch)."""
    limit = getattr(cfg, "local_steps", None)
    if limit is None:
        return epochs
    return -(-int(limit) * cfg.batch_size // max(int(n), 1)) + 1


def _train_loop(model, x, y, run: TrainOptions, loss_fn, opt) -> dict:
    """Minibatch training without host synchronisation: each epoch's shuffled indices reach the data's device in one
    copy; the loss and its parts of every step are kept (detached) and summed once at the end, on the device, in
    float64 and in step order (a sequential scan: the same sums as adding Python floats), so the mean losses come
    back as 0-dim tensors that nobody has read yet."""
    cfg, generator = run.cfg, run.batches
    model.train()
    values: dict = {}
    steps = 0
    n = int(y.shape[0])
    limit = getattr(cfg, "local_steps", None)  # exactly this many steps: epochs continued as needed
    epochs = epoch_count(cfg, n, run.num_epochs)
    for epoch in range(epochs):
        if limit is not None and steps >= limit:
            break
        if isinstance(generator, Counter):  # counter-based: the bits the vectorised executor computes for a group
            perm = generator.permutation(n, epoch).to(x.device)
        else:
            perm = torch.randperm(n, generator=generator).to(x.device)  # minibatches()'s draw, moved once per epoch
        for start in range(0, n, cfg.batch_size):
            if limit is not None and steps >= limit:
                break
            idx = perm[start:start + cfg.batch_size]
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            loss, parts = loss_fn(model, xb, yb, epoch)
            loss.backward()
            opt.step()
            steps += 1
            keep_metric(values, "loss", loss)
            for k, v in parts.items():
                keep_metric(values, k, v)
    return {f"train_{k}": v for k, v in step_means(values, max(steps, 1)).items()}


def keep_metric(values: dict, key: str, v) -> None:
    """Append one step's value of a metric (a tensor, detached only when it needs it; or a number)."""
    if torch.is_tensor(v) and v.requires_grad:
        v = v.detach()
    values.setdefault(key, []).append(v)


def step_means(values: dict, steps: int) -> dict:
    """Each metric's mean over the steps: its per-step values summed in step order in float64 (a sequential scan,
    the sums of adding Python floats), divided by ``steps``. Tensor metrics of one device and count give 0-dim
    tensors on that device from one stack, one cast, one scan and one division; numbers give Python floats."""
    out, tensors = {}, {}
    for k, vs in values.items():
        if all(torch.is_tensor(v) and v.dim() == 0 for v in vs):
            tensors.setdefault((vs[0].device, len(vs)), []).append(k)
        else:
            out[k] = sum(float(v) for v in vs) / steps  # numbers: Python's left-to-right sum
    for (_, count), keys in tensors.items():
        flat = [v for k in keys for v in values[k]]
        table = (torch.stack(flat) if len(flat) > 1 else flat[0].reshape(1)).to(torch.float64).view(len(keys), count)
        means = table.cumsum(1)[:, -1] / steps  # a sequential scan on a CPU: ((v0 + v1) + v2) + ..., as Python adds
        for j, k in enumerate(keys):
            out[k] = means[j] if len(keys) > 1 else means.view(())
    return out


def accumulate_metric(totals: dict, key: str, v) -> None:
    """totals[key] += v, on v's device in float64 for tensors (no host synchronisation), as a Python float else."""
    if torch.is_tensor(v):
        v = v.detach().to(torch.float64)
    totals[key] = totals[key] + v if key in totals else v


@torch.no_grad()
def forward_all(model: nn.Module, x: torch.Tensor, batch_size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, embeddings) for all of x in eval mode."""
    model.eval()
    if 0 < int(x.shape[0]) <= batch_size:  # one chunk: no slicing, no concatenation
        return model(x, return_embedding=True)
    logits, zs = [], []
    for s in range(0, int(x.shape[0]), batch_size):
        lo, z = model(x[s:s + batch_size], return_embedding=True)
        logits.append(lo)
        zs.append(z)
    if not logits:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(logits), torch.cat(zs)


def device_accuracy(pred: torch.Tensor, y: torch.Tensor) -> tuple:
    """:func:`accuracy` without reading the device: (the accuracy as a 0-dim float64 tensor, the number of samples),
    the same value bit for bit once read. For a client's evaluation metrics, which its runner reads in one host read
    per step (not one per client and metric)."""
    n = int(y.shape[0])
    if not n:
        return float("nan"), 0.0
    return (pred == y).sum().to(torch.float64) / n, float(n)


def group_accuracies(model: nn.Module, xs: list, ys: list) -> list[tuple]:
    """:func:`device_accuracy` of one ``model`` on each of several clients' data sets (``xs``, ``ys``), from one
    forward of them concatenated (:func:`forward_all`) and one segment sum: per client (accuracy as a 0-dim float64
    tensor, or NaN for an empty set; the number of samples). The predictions are the per-client forwards' up to the
    batch composition of the kernels (last bits of the logits)."""
    sizes = [int(y.shape[0]) for y in ys]
    y = torch.cat(ys)
    pred = forward_all(model, torch.cat(xs))[0].argmax(1)
    seg = torch.repeat_interleave(torch.arange(len(ys), device=y.device), torch.tensor(sizes, device=y.device))
    correct = torch.zeros(len(ys), dtype=torch.float64, device=y.device).index_add_(0, seg, (pred == y).to(torch.float64))
    accs = (correct / torch.tensor(sizes, dtype=torch.float64).clamp_min(1).to(y.device)).unbind()
    return [(a, float(n)) if n else (float("nan"), 0.0) for a, n in zip(accs, sizes)]


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, number of samples) — the number is the weight of the value in the result table."""
    n = int(y.shape[0])
    return (float((pred == y).sum()) / n if n else float("nan")), float(n)


def clone_state(model: nn.Module) -> dict:
    """A copy of the model's state dict (one copy per tensor, outside autograd)."""
    with torch.no_grad():
        return {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}
