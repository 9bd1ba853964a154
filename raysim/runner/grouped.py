"""Grouped execution: K models of one architecture built from standard layers, computed as one network — the
vectorised executor's fast path (:mod:`raysim.runner.vectorized`) and the tool of a method's group forms of client
steps (:class:`raysim.algorithm.Algorithm`; MAFML's in ``algorithms/mafml.py``), with
:class:`StackedOptimizer` (SGD / Adam over the stacked parameters, torch.optim's formulas).

``vmap`` turns each client's convolution into one grouped convolution over a channels-first tensor, and pools and
reshapes that tensor in channels-first layout. On CPUs the channels-first kernels for many small groups are slow
(max-pooling a [4, 1000, 24, 24] tensor takes ~13x longer channels-first than channels-last here), and ``vmap``
refuses channels-last tensors. This module runs the model's forward for the K clients of a group explicitly instead:

* image activations are one tensor [B, K*C, H, W] in channels-last memory (client k owns channels k*C .. k*C+C-1;
  channels-first in a model with batch norm, see :func:`grouped_forward`), a convolution is one convolution with
  ``groups = K * groups``, pools and element-wise functions act on it as is;
* a batch-norm layer is one ``F.batch_norm`` over the K*C channels with the clients' running statistics stacked
  [K, C] (viewed as [K*C], updated in place: each client's from its own batch, with the layer's momentum);
* vector activations are [K, B, F], a linear layer is one ``baddbmm`` over the clients' stacked weights;
* a dropout layer multiplies by the client's pre-drawn mask, exactly as :class:`raysim.layers.Dropout` does.

Supported: :class:`raysim.layers.SplitModel`, ``nn.Sequential``, ``Conv2d`` (zero padding), ``Linear``, ``ReLU`` and
other element-wise activations, ``MaxPool2d`` / ``AvgPool2d`` / ``AdaptiveAvgPool2d``, ``Flatten`` (from dim 1),
``Identity``, raysim's ``Dropout``, FedProto's CNN body (``cnn_mnist``), ``BatchNorm2d`` / ``BatchNorm1d`` (on [B, F];
with a momentum, or without running statistics), torchvision's ``BasicBlock``, ``InvertedResidual`` and
``Conv2dNormActivation`` and raysim's ResNet body (``resnet_small``, ``mobilenet_small``, ``resnet18``,
``resnet34``); the running statistics come in ``params`` with the parameters; any other module makes the model
ineligible and the executor uses ``vmap`` (:func:`supported`). The objective still runs per client under ``vmap``,
with a model stand-in (:class:`ReplayModel`) that hands it the precomputed outputs of its calls on the batch; the
per-client gradients come from ordinary autograd over the stacked parameters (client k's loss depends only on
client k's slice, so the gradient of the summed losses is every client's own gradient). Floating-point sums are
ordered differently from the loop's and from ``vmap``'s: the results agree within the vectorised executor's stated
tolerance, not bit for bit.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raysim.config import TrainConfig
from raysim.layers import Dropout, SplitModel


class Ineligible(Exception):
    """The model or the objective's use of it is outside what grouped execution supports: use ``vmap``."""


_ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.ELU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ReLU6, nn.Identity)


class _Act:
    """An activation of K clients: ``img`` [B, K*C, H, W] channels-last (``c`` = C) or ``vec`` [K, B, ...]."""
    __slots__ = ("t", "img", "c", "k")

    def __init__(self, t: torch.Tensor, img: bool, c: int, k: int):
        self.t, self.img, self.c, self.k = t, img, c, k

    @staticmethod
    def from_stacked(x: torch.Tensor, channels_last: bool = True) -> "_Act":
        """[K, B, C, H, W] -> image layout (channels-last memory, or channels-first); [K, B, ...] otherwise."""
        k = x.shape[0]
        if x.dim() == 5:
            b, c, h, w = x.shape[1:]
            t = x.transpose(0, 1).reshape(b, k * c, h, w).contiguous(
                memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            return _Act(t, True, c, k)
        return _Act(x, False, 0, k)

    def stacked(self) -> torch.Tensor:
        """[K, B, ...] (a view for image activations)."""
        if not self.img:
            return self.t
        b, _, h, w = self.t.shape
        return self.t.reshape(b, self.k, self.c, h, w).transpose(0, 1)

    def like(self, t: torch.Tensor, c: int | None = None) -> "_Act":
        return _Act(t, self.img, self.c if c is None else c, self.k)


def _conv(m: nn.Conv2d, a: _Act, p: dict, name: str) -> _Act:
    if not a.img:
        raise Ineligible(f"{name}: a convolution of a non-image activation")
    w = p[f"{name}.weight"]
    k = w.shape[0]
    b = p.get(f"{name}.bias") if m.bias is not None else None
    if _fixed_order(a.t, m):
        from raysim import fixed_gemm

        return a.like(fixed_gemm.grouped_conv2d(a.t, w, b, m.stride, m.padding, m.dilation), m.out_channels)
    t = F.conv2d(a.t, w.reshape(k * w.shape[1], *w.shape[2:]), None if b is None else b.reshape(-1),
                 m.stride, m.padding, m.dilation, k * m.groups)
    return a.like(t, m.out_channels)


def _fixed_order(t: torch.Tensor, m: Optional[nn.Conv2d] = None) -> bool:
    """A float32 CPU convolution or linear layer in a portable process runs raysim's fixed-order GEMM
    (:mod:`raysim.fixed_gemm`): torch's portable alternative computes the K clients' convolutions one group at a
    time, and every GEMM, on MKL's SSE2 branch."""
    from raysim import numerics

    return (numerics.active_mode() == "portable" and t.device.type == "cpu" and t.dtype == torch.float32
            and (m is None or (m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str))))


def _linear(a: _Act, p: dict, name: str, has_bias: bool) -> _Act:
    if a.img or a.t.dim() != 3:
        raise Ineligible(f"{name}: a linear layer on a non-[B, F] activation")
    w = p[f"{name}.weight"]  # [K, out, in]
    if _fixed_order(a.t):
        from raysim import fixed_gemm

        return a.like(fixed_gemm.grouped_linear(a.t, w, p[f"{name}.bias"] if has_bias else None))
    if has_bias:
        return a.like(torch.baddbmm(p[f"{name}.bias"].unsqueeze(1), a.t, w.transpose(1, 2)))
    return a.like(torch.bmm(a.t, w.transpose(1, 2)))


def _flatten(a: _Act) -> _Act:
    s = a.stacked()
    return _Act(s.reshape(s.shape[0], s.shape[1], -1), False, 0, a.k)


def _dropout(m: Dropout, a: _Act, masks: Iterator) -> _Act:
    if not m.training or m.p == 0.0:
        return a
    if m.p == 1.0:
        return a.like(a.t * 0.0)
    mask = next(masks)  # [K, B, ...] the client's mask as the loop draws it
    if a.img:
        mk = mask.transpose(0, 1)
        mask = mk.reshape(mk.shape[0], mk.shape[1] * mk.shape[2], *mk.shape[3:])
    return a.like(a.t * mask * (1.0 / (1.0 - m.p)))


def _batchnorm(m: nn.modules.batchnorm._BatchNorm, a: _Act, p: dict, name: str) -> _Act:
    """``BatchNorm2d`` on [B, K*C, H, W] (or ``BatchNorm1d`` on [K, B, F]) as one ``F.batch_norm`` over the K*C
    channels: each channel's statistics are over its own client's batch, so client k is normalised by its own batch
    statistics (training) or its own running statistics (eval), with its own weight and bias, exactly as the module
    does for one client. The running statistics come from ``p`` ({name}.running_mean / running_var /
    num_batches_tracked, [K, C]) and are updated in place, as the module updates its buffers (momentum, the unbiased
    variance); the normalisation itself uses the biased variance, as the module does."""
    if isinstance(m, nn.BatchNorm2d):
        if not a.img:
            raise Ineligible(f"{name}: BatchNorm2d of a non-image activation")
        x = a.t
    elif isinstance(m, nn.BatchNorm1d):
        if a.img or a.t.dim() != 3:
            raise Ineligible(f"{name}: BatchNorm1d of a non-[B, F] activation")
        k, b, f = a.t.shape
        x = a.t.transpose(0, 1).reshape(b, k * f)
    else:
        raise Ineligible(f"{name}: {type(m).__name__} has no grouped form")
    rm = rv = None
    factor = 0.0
    if m.track_running_stats:
        rm, rv = p.get(f"{name}.running_mean"), p.get(f"{name}.running_var")
        if rm is None or rv is None:
            raise Ineligible(f"{name}: the clients' running statistics were not given")
        if m.training:
            nbt = p.get(f"{name}.num_batches_tracked")
            if m.momentum is None or nbt is None or not (rm.is_contiguous() and rv.is_contiguous()):
                raise Ineligible(f"{name}: running statistics that cannot be updated in place per client")
            nbt.add_(1)
            factor = m.momentum
        rm, rv = rm.reshape(-1), rv.reshape(-1)  # views of the [K, C] stacks: updated in place
    w = p[f"{name}.weight"].reshape(-1) if m.weight is not None else None
    bias = p[f"{name}.bias"].reshape(-1) if m.bias is not None else None
    t = F.batch_norm(x, rm, rv, w, bias, m.training or not m.track_running_stats, factor, m.eps)
    if not a.img:
        t = t.reshape(b, k, f).transpose(0, 1)
    return a.like(t)


def _basic_block(m: nn.Module, a: _Act, p: dict, pre: str, masks: Iterator) -> _Act:
    """torchvision's ``BasicBlock``: conv, BN, ReLU, conv, BN, plus the input (or its downsampling), ReLU."""
    out = _run(m.relu, _run(m.bn1, _run(m.conv1, a, p, pre + "conv1", masks), p, pre + "bn1", masks), p,
               pre + "relu", masks)
    out = _run(m.bn2, _run(m.conv2, out, p, pre + "conv2", masks), p, pre + "bn2", masks)
    identity = a if m.downsample is None else _run(m.downsample, a, p, pre + "downsample", masks)
    return _run(m.relu, out.like(out.t + identity.t), p, pre + "relu", masks)


def _resnet_body(m: nn.Module, a: _Act, p: dict, pre: str, masks: Iterator) -> _Act:
    """raysim's ``_ResNetBody`` (torchvision's ResNet up to its pooling): stem, four stages, pooled and flattened."""
    for child in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"):
        a = _run(getattr(m, child), a, p, pre + child, masks)
    return _flatten(a)


def _inverted_residual(m: nn.Module, a: _Act, p: dict, pre: str, masks: Iterator) -> _Act:
    """torchvision's ``InvertedResidual``: its ``conv`` sequence, plus the input where shapes allow."""
    out = _run(m.conv, a, p, pre + "conv", masks)
    return out.like(a.t + out.t) if m.use_res_connect else out


def _torchvision_blocks() -> dict:
    """The grouped forms of torchvision's blocks that raysim's zoo uses (by exact class), and of raysim's ResNet
    body; {} for what cannot be imported."""
    forms: dict = {}
    try:
        from torchvision.models.mobilenetv2 import InvertedResidual
        from torchvision.models.resnet import BasicBlock
    except Exception:  # pragma: no cover - torchvision missing: those models use vmap
        pass
    else:
        forms[BasicBlock] = _basic_block
        forms[InvertedResidual] = _inverted_residual
    from raysim.models import _ResNetBody

    forms[_ResNetBody] = _resnet_body
    return forms


_BLOCKS: Optional[dict] = None


def _blocks() -> dict:
    global _BLOCKS
    if _BLOCKS is None:
        _BLOCKS = _torchvision_blocks()
    return _BLOCKS


def _sequential_types() -> tuple:
    """``nn.Sequential`` and torchvision's ``Conv2dNormActivation`` (a Sequential that only fixes the layers)."""
    try:
        from torchvision.ops.misc import Conv2dNormActivation
    except Exception:  # pragma: no cover
        return (nn.Sequential,)
    return (nn.Sequential, Conv2dNormActivation)


def _run(m: nn.Module, a: _Act, p: dict, name: str, masks: Iterator) -> _Act:
    pre = f"{name}." if name else ""
    block = _blocks().get(type(m))
    if block is not None:
        return block(m, a, p, pre, masks)
    if isinstance(m, nn.Sequential):
        for child_name, child in m._modules.items():  # as Sequential.forward walks them
            a = _run(child, a, p, pre + child_name, masks)
        return a
    if isinstance(m, nn.Conv2d):
        return _conv(m, a, p, name)
    if isinstance(m, nn.Linear):
        return _linear(a, p, name, m.bias is not None)
    if isinstance(m, _ELEMENTWISE):
        return a.like(m(a.t))
    if isinstance(m, nn.MaxPool2d):
        if not a.img or m.return_indices:
            raise Ineligible(f"{name}: max-pooling")
        return a.like(F.max_pool2d(a.t, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode))
    if isinstance(m, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
        if not a.img:
            raise Ineligible(f"{name}: pooling a non-image activation")
        return a.like(m(a.t))
    if isinstance(m, nn.Flatten):
        return _flatten(a)
    if isinstance(m, Dropout):
        return _dropout(m, a, masks)
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return _batchnorm(m, a, p, name)
    raise Ineligible(f"{name or 'model'}: {type(m).__name__} has no grouped form")


_KNOWN = (SplitModel, nn.Sequential, nn.Conv2d, nn.Linear, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten,
          Dropout, nn.BatchNorm1d, nn.BatchNorm2d) + _ELEMENTWISE


def _plain(m: nn.Module) -> bool:
    """``m`` is exactly one of the known classes (a subclass may override ``forward`` or a helper such as
    ``Conv2d._conv_forward``; a parametrized layer is a subclass) and has no hooks of its own."""
    known = type(m) in _KNOWN or type(m) in _blocks() or type(m) in _sequential_types()
    return known and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                                      or m._backward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as mm

    return any(getattr(mm, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                     "_global_backward_hooks", "_global_backward_pre_hooks"))


def supported(model: nn.Module) -> bool:
    """Whether ``model`` has a grouped form: every module exactly a known class without hooks, no module object or
    parameter used twice (tied layers), no buffers but batch-norm running statistics, a SplitModel of body and head
    only (structure; the layouts are checked when run)."""
    def ok(m: nn.Module) -> bool:
        if not _plain(m):
            return False
        if isinstance(m, SplitModel):
            return set(m._modules) == {"body", "head"} and all(ok(c) for c in m.children())
        if isinstance(m, nn.Sequential) or type(m) in _blocks():
            return all(ok(c) for c in m.children())
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return m.momentum is not None or not m.track_running_stats
        if isinstance(m, nn.Conv2d):
            return m.padding_mode == "zeros" and not isinstance(m.padding, str)
        if isinstance(m, nn.Flatten):
            return m.start_dim == 1 and m.end_dim == -1
        if isinstance(m, nn.MaxPool2d):
            return not m.return_indices
        return True
    if not isinstance(model, (SplitModel, nn.Sequential)) or _global_hooks():
        return False
    once = len(list(model.modules())) == len(list(model.modules(remove_duplicate=False)))
    untied = (len(list(model.named_parameters())) == len(list(model.named_parameters(remove_duplicate=False))))
    stats = {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             for b, _ in m.named_buffers(recurse=False)}
    return once and untied and ok(model) and all(n in stats for n, _ in model.named_buffers())


def grouped_forward(model: nn.Module, params: dict, x: torch.Tensor, return_embedding: bool, masks: Iterator):
    """``model``'s forward for K clients at once: ``params`` {name: [K, ...]}, ``x`` [K, B, ...]; returns what the
    model returns, each tensor stacked [K, B, ...]. A model with batch norm runs channels-first (as each client's own
    forward does): the batch-norm kernel then reduces each of the K*C channels in the order it does for one client,
    where the channels-last kernel sums otherwise, a difference a channel of small variance amplifies (and CPU
    kernels mixing the two layouts are best avoided)."""
    a = _Act.from_stacked(x, not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()))
    if isinstance(model, SplitModel):
        z = _run(model.body, a, params, "body", masks)
        logits = _run(model.head, z, params, "head", masks)
        return (logits.stacked(), z.stacked()) if return_embedding else logits.stacked()
    if return_embedding:
        raise Ineligible("return_embedding on a model that is not a SplitModel")
    return _run(model, a, params, "", masks).stacked()


def stack_weights(model: nn.Module, weights: list) -> dict:
    """The parameters (and batch-norm running statistics) of K clients' weights (state dicts, or
    :class:`raysim.messages.Rows` of a group's stacks) as {name: [K, ...]} on ``model``'s devices and dtypes, in
    ``model``'s parameter order: rows of one stack taken in one
    op, anything else stacked in one op per parameter."""
    from raysim.messages import row_source

    out = {}
    stats = [(f"{pre}.{b}" if pre else b, t) for pre, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
             for b, t in m.named_buffers(recurse=False) if t is not None]  # each client's own running statistics
    for name, like in list(model.named_parameters()) + stats:
        src = [row_source(w, name) for w in weights]
        if all(s is not None for s in src) and all(s[0] is src[0][0] for s in src):
            base, rows = src[0][0][name], [s[1] for s in src]
            t = base if rows == list(range(base.shape[0])) else base[torch.as_tensor(rows, device=base.device)]
        else:
            t = torch.stack([w[name].detach().to(like.device) for w in weights])
        out[name] = t.to(device=like.device, dtype=like.dtype)
    return out


def grouped_embeddings(model: nn.Module, params: dict, x: torch.Tensor, chunk: int = 4096) -> Optional[tuple]:
    """(logits, embeddings), each [K, n, ...], of K clients' ``x`` [K, n, ...] under their ``params`` {name: [K, ...]}
    in eval mode and without autograd (what :func:`raysim.training.forward_all` gives one client), in chunks of about
    ``chunk`` samples; None where the model has no grouped form."""
    if not isinstance(model, SplitModel) or not supported(model):
        return None
    k, n = int(x.shape[0]), int(x.shape[1])
    step = max(1, chunk // max(1, k))
    model.eval()
    try:
        with torch.no_grad():
            outs = [grouped_forward(model, params, x[:, s:s + step], True, iter(())) for s in range(0, n, step)]
    except Ineligible:
        return None
    if len(outs) == 1:
        return outs[0]
    return torch.cat([o[0] for o in outs], dim=1), torch.cat([o[1] for o in outs], dim=1)


def group_test_accuracy(model: nn.Module, weights: list, xs: list, ys: list) -> Optional[list]:
    """Each of K clients' accuracy on its own data (``xs``, ``ys``: one shape) under its own ``weights`` (state dicts
    or rows of a group's stacks), from one grouped forward (:func:`grouped_embeddings`): per client (accuracy as a 0-dim
    float64 tensor, the number of samples), as :func:`raysim.training.device_accuracy` gives one; None where the
    model has no grouped form or the data sets differ in shape."""
    if len({(tuple(x.shape), x.device) for x in xs}) != 1 or not ys[0].numel():
        return None
    out = grouped_embeddings(model, stack_weights(model, weights), torch.stack(xs))
    if out is None:
        return None
    y = torch.stack(ys)
    n = int(y.shape[1])
    return [(a, float(n)) for a in ((out[0].argmax(2) == y).sum(1).to(torch.float64) / n).unbind()]


def stacked_grads(total: torch.Tensor, leaves: dict) -> dict:
    """{name: [K, ...]} gradients of ``total`` (the sum of the K clients' losses) with respect to the stacked
    ``leaves``: client k's loss depends only on slice k, so slice k of each gradient is client k's own gradient (zeros
    where a parameter did not enter the loss)."""
    gs = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(leaves, gs)}


class ParameterView:
    """The parameter accessors of a stand-in for a module under given parameters (``self._params``: name -> tensor):
    what an objective reads as ``model.named_parameters()`` / ``model.parameters()`` (FedProx's proximal term)."""

    def named_parameters(self):
        return iter(self._params.items())

    def parameters(self):
        return iter(self._params.values())


class ReplayModel(ParameterView):
    """What the objective sees as ``model`` on the grouped path, inside ``vmap`` over the clients: its calls on the
    step's batch return the precomputed grouped outputs (one client's slice), in order; ``named_parameters()`` gives
    the client's parameters; other attributes come from the live module. A call on anything else, or a call the
    shape probe did not see, raises :class:`Ineligible` (the executor then runs the step with ``vmap``)."""

    def __init__(self, module: nn.Module, params: dict, xb, outs: list, calls: list):
        self._module, self._params, self._xb, self._outs, self._calls = module, params, xb, outs, calls
        self._next = 0

    def __call__(self, x, *args, **kwargs):
        j = self._next
        if x is not self._xb or args or j >= len(self._calls) or kwargs != self._calls[j]:
            raise Ineligible("the objective called the model in a way the probe did not see")
        self._next += 1
        out = self._outs[j]
        if not torch.is_grad_enabled():  # a call under no_grad: the loop's output would carry no gradient
            out = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
        return out

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if isinstance(value, nn.Module) or callable(value):
            raise Ineligible(f"the objective used model.{name}")
        return value


class RecordingModel:
    """The probe's stand-in: runs ``inner`` (a functional model) and records each call's keyword arguments when it is
    a call on ``xb`` alone, or marks the objective ineligible; counts the dropout masks each call draws."""

    def __init__(self, inner, xb, mask_count: Callable[[], int]):
        self._inner, self._xb, self._count = inner, xb, mask_count
        self._version = xb._version  # an objective that modifies its batch in place before a call: outside the form
        self.calls: list = []
        self.ok = True
        self._masks_seen = 0

    def __call__(self, x, *args, **kwargs):
        before = self._count()
        if before != self._masks_seen:  # masks drawn outside a model call
            self.ok = False
        out = self._inner(x, *args, **kwargs)
        self._masks_seen = self._count()
        if x is not self._xb or args or set(kwargs) - {"return_embedding"} or x._version != self._version:
            self.ok = False
        self.calls.append(dict(kwargs))
        return out

    def named_parameters(self):
        return self._inner.named_parameters()

    def parameters(self):
        return self._inner.parameters()

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if isinstance(value, nn.Module) or (callable(value) and not isinstance(value, type)):
            self.ok = False
        return value

    def finished(self) -> bool:
        return self.ok and self._count() == self._masks_seen


class StackedOptimizer:
    """SGD / Adam over stacked per-client tensors ({name: [K, ...]}), torch.optim's update formulas."""

    def __init__(self, cfg: TrainConfig, params: dict, states: list[Optional[dict]], lr: float):
        self.cfg, self.lr = cfg, lr
        self.adam = cfg.optimizer == "adam"
        k = len(states)
        self.bufs: dict = {}  # name -> [K, ...] momentum buffer (SGD) or (exp_avg, exp_avg_sq) (Adam)
        dev = next(iter(params.values())).device if params else torch.device("cpu")  # the parameters' (CUDA too)
        self.has_buf = torch.zeros(k, dtype=torch.bool, device=dev)  # SGD: the first momentum step copies the gradient
        self._has_host = [False] * k  # the same on the host: deciding "nobody's first step" reads no device value
        self.steps = torch.zeros(k, dtype=torch.float64, device=dev)  # Adam: per-client step count
        for name, p in params.items():
            if self.adam:
                m, v = torch.zeros_like(p), torch.zeros_like(p)
                for i, st in enumerate(states):
                    s = (st or {}).get(name)
                    if s:
                        m[i], v[i] = s["exp_avg"], s["exp_avg_sq"]
                        self.steps[i] = float(s["step"])
                self.bufs[name] = (m, v)
            elif cfg.momentum:
                b = torch.zeros_like(p)
                for i, st in enumerate(states):
                    s = (st or {}).get(name)
                    if s and s.get("momentum_buffer") is not None:
                        b[i] = s["momentum_buffer"]
                        self.has_buf[i] = True
                        self._has_host[i] = True
                self.bufs[name] = b

    @torch.no_grad()
    def step(self, params: dict, grads: dict, rows: torch.Tensor, whole: bool = False,
             host_rows: Optional[list] = None) -> None:
        """Update the clients ``rows`` (indices into the stack) with their gradients ``grads`` ({name: [len(rows), ...]}).
        ``whole``: ``rows`` is every client of the stack in order: the same arithmetic in place, without gathering
        and scattering the stacked parameters and buffers (~5 copies of every parameter per step). ``host_rows``:
        the same indices as a list (else read from ``rows`` once: a host synchronisation on a GPU)."""
        cfg = self.cfg
        if host_rows is None:
            host_rows = list(range(len(self._has_host))) if whole else [int(r) for r in rows.tolist()]
        if self.adam:
            if whole:
                self.steps += 1
            else:
                self.steps[rows] += 1
        steps = (self.steps if whole else self.steps[rows]) if self.adam else None
        first = None  # SGD with momentum: the clients whose first step copies the gradient (None: nobody's)
        if not self.adam and cfg.momentum:
            has = self.has_buf if whole else self.has_buf[rows]
            first = None if all(self._has_host[i] for i in host_rows) else ~has
        if self.adam:
            self._adam(params, grads, rows, whole, steps)
        for name, g in ({} if self.adam else grads).items():
            full, bufs = params[name], self.bufs.get(name)
            p = full if whole else full[rows]
            st = bufs if whole or bufs is None else bufs[rows]
            st = self._update(p, g, st, steps, first)
            if not whole:
                full[rows] = p
                if bufs is not None:
                    bufs[rows] = st
        if not self.adam and cfg.momentum:
            if whole:
                self.has_buf[:] = True
            else:
                self.has_buf[rows] = True
            for i in host_rows:
                self._has_host[i] = True

    def _adam(self, params: dict, grads: dict, rows: torch.Tensor, whole: bool, steps: torch.Tensor) -> None:
        """torch.optim.Adam's update of the clients ``rows`` of every stacked parameter, in place: the moments per
        tensor, then one square root over all second moments (one call instead of one per tensor: in a portable
        process aten::sqrt is raysim's IEEE kernel, several kernels a call), then the steps. Each element's arithmetic
        is torch's, in torch's order: the bits of the per-tensor form."""
        cfg, lr = self.cfg, self.lr
        b1, b2 = 0.9, 0.999
        bc1_64, bc2_sqrt_64 = 1 - b1 ** steps, (1 - b2 ** steps).sqrt()  # [n] float64, the same for every tensor
        work = []
        for name, g in grads.items():
            full, bufs = params[name], self.bufs[name]
            p = full if whole else full[rows]
            m, v = bufs if whole else (bufs[0][rows], bufs[1][rows])
            if cfg.weight_decay:
                g = g.add(p, alpha=cfg.weight_decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            work.append((name, full, bufs, p, m, v))
        if not work:
            return
        n = work[0][5].shape[0]
        flat = [v.reshape(n, v[0].numel()) for *_, v in work]
        one = len(flat) > 1 and len({f.dtype for f in flat}) == 1  # (mixed dtypes: a concatenation would promote)
        roots = torch.cat(flat, dim=1).sqrt() if one else None
        off = 0
        for (name, full, bufs, p, m, v), f in zip(work, flat):
            root = f.sqrt().reshape(v.shape) if roots is None else roots[:, off:off + f.shape[1]].reshape(v.shape)
            off += f.shape[1]
            shape = (-1,) + (1,) * (p.dim() - 1)
            bc1 = bc1_64.to(p.dtype).view(shape)
            denom = (root / bc2_sqrt_64.to(p.dtype).view(shape)).add_(1e-8)
            p.addcdiv_(m, denom * (bc1 / lr), value=-1.0)
            if not whole:
                full[rows] = p
                bufs[0][rows], bufs[1][rows] = m, v

    def _update(self, p: torch.Tensor, g: torch.Tensor, st, steps, first):
        """torch.optim's SGD update of client-stacked ``p`` in place, with its state ``st`` (SGD with momentum: the
        buffer; else None), updated in place and returned (Adam: :meth:`_adam`)."""
        cfg, lr = self.cfg, self.lr
        if cfg.weight_decay:
            g = g.add(p, alpha=cfg.weight_decay)
        shape = (-1,) + (1,) * (p.dim() - 1)
        if cfg.momentum:
            if first is None:
                st.mul_(cfg.momentum).add_(g)
            else:
                st.copy_(torch.where(first.view(shape), g, st.mul(cfg.momentum).add(g)))
            p.add_(st, alpha=-lr)
            return st
        p.add_(g, alpha=-lr)
        return None

    def state_of(self, i: int, names: list[str]) -> dict:
        """Client ``i``'s state in the loop's format ({name: {key: tensor}}); {} when it never stepped."""
        out = {}
        for name in names:
            if self.adam:
                if self.steps[i] > 0:
                    m, v = self.bufs[name]
                    out[name] = {"step": torch.tensor(float(self.steps[i])), "exp_avg": m[i].clone(),
                                 "exp_avg_sq": v[i].clone()}
            elif self.cfg.momentum and bool(self.has_buf[i]):
                out[name] = {"momentum_buffer": self.bufs[name][i].clone()}
        return out
