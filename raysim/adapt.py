"""The user's own models: built from a factory reached by import path or registered name, then given the body/head
split every method relies on (``logits, z = model(x, return_embedding=True)``, ``model.body``, ``model.head``,
``model.embed_dim``).

How a user module is understood, in order:

1. a :class:`raysim.models.SplitModel`: as it is;
2. ``embedding`` named in the config (``model.embedding``): the module is traced with ``torch.fx`` and cut after
   that layer (a module path such as ``fc1`` or a traced node name such as ``flatten``): the body is everything the
   forward computes up to it, the head everything after; a value that crosses the cut other than the embedding
   (a skip connection around it) is refused;
3. ``features`` (input -> embedding) and ``classifier`` (embedding -> logits) attributes: body = features (flattened
   to N x d), head = classifier, checked to reproduce the module's own forward on a probe batch;
4. a torchvision builder (``torchvision.models:resnet18``): cut before its final classifier module (``fc``,
   ``classifier``, ``heads``, ``head``), the embedding being that module's input;
5. anything else: a :class:`WholeModel` without a known embedding, fine for methods that only read logits (FedAvg,
   FedProx, Local, ...); a method that needs the split is refused when the run is prepared, with one line saying
   how to declare it (:func:`suggest_embedding` names a likely layer).

``nn.Dropout`` / ``nn.Dropout2d`` inside a user module are replaced by :class:`raysim.models.Dropout` (same p), so
their masks come from the per-client generators: the same table on every backend. torchvision builders are called as
``builder(weights=None, num_classes=C, **model.params)`` (weights are never downloaded); an input whose channel count
differs from 3 gets a first convolution with that many input channels (same out-channels, kernel, stride, padding;
freshly initialised); image sizes are left as they are (ResNets, MobileNets and EfficientNets end in adaptive average
pooling, so 28x28 and 32x32 inputs pass: resnet18 turns 32x32 into 1x1 maps before its ``fc``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from raysim.config import ArchSpec
from raysim.errors import ConfigError
from raysim.layers import Dropout, SplitModel, num_parameters
from raysim.config.registry import (MODEL_FACTORY, MODELS, check_signature, is_import_path, marked, refuse_unmarked,
                             registered, resolve)

_HEAD_NAMES = ("fc", "classifier", "heads", "head")


class WholeModel(nn.Module):
    """A user module without a known body/head split: logits only; the embedding is empty (N x 0)."""

    embed_dim = 0

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, return_embedding: bool = False):
        logits = self.net(x)
        return (logits, logits.new_zeros(logits.shape[0], 0)) if return_embedding else logits


class FlatBody(nn.Module):
    """The body of a split user module: its output flattened to N x d (the embedding)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        z = self.net(x)
        return z.flatten(1) if z.dim() > 2 else z


class ShapedHead(nn.Module):
    """The head of a split user module: the flat embedding reshaped to what the rest of the forward expects."""

    def __init__(self, net: nn.Module, shape: tuple):
        super().__init__()
        self.net, self.shape = net, tuple(shape)

    def forward(self, z):
        return self.net(z.reshape(z.shape[0], *self.shape) if len(self.shape) > 1 else z)


def _probe(input_shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)  # never torch's global stream (model building must not move it)
    return torch.randn((2, *input_shape), generator=g)


def replace_dropout(module: nn.Module) -> nn.Module:
    """``nn.Dropout`` / ``nn.Dropout2d`` -> :class:`raysim.models.Dropout` (generator-driven masks), in place."""
    for name, child in list(module.named_children()):
        if type(child) in (nn.Dropout, nn.Dropout2d):
            setattr(module, name, Dropout(child.p, channelwise=type(child) is nn.Dropout2d))
        else:
            replace_dropout(child)
    return module


def is_torchvision_builder(fn) -> bool:
    """``fn`` is one of torchvision's registered model builders (``torchvision.models.list_models()``), the very
    function, not merely something defined in torchvision.models (``get_model_weights``, helpers)."""
    module = getattr(fn, "__module__", None)
    if not (isinstance(module, str) and module.startswith("torchvision.models")):
        return False
    try:
        from torchvision.models import get_model_builder, list_models
    except ImportError:
        return False
    return any(get_model_builder(n) is fn for n in list_models())


def weight_parameters(fn) -> dict:
    """``{name: None}`` for every parameter of a builder's signature that names pretrained weights (``*weights*``,
    ``pretrained*``: torchvision's ``weights_backbone`` defaults to ImageNet weights in the segmentation and detection
    builders): raysim calls builders with all of them off, so nothing downloads."""
    import inspect

    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {n: None for n, p in names.items() if ("weights" in n or n.startswith("pretrained"))
            and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}


def is_module_class(obj) -> bool:
    """``obj`` is a subclass of ``torch.nn.Module`` (called as ``Class(input_shape, num_classes, **params)``)."""
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _adapt_channels(model: nn.Module, channels: int) -> None:
    """Give a torchvision model's first convolution ``channels`` input channels (fresh weights, same geometry)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != channels:
                    setattr(parent, name, nn.Conv2d(channels, child.out_channels, child.kernel_size, child.stride,
                                                    child.padding, child.dilation, child.groups,
                                                    child.bias is not None, child.padding_mode))
                return


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer; raysim's Dropout (whose forward branches on the training flag) and the layer named as the
    embedding stay whole modules."""

    def __init__(self, leaves: tuple = ()):
        super().__init__()
        self.leaves = set(leaves)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Dropout) or qualname in self.leaves or super().is_leaf_module(m, qualname)


def _trace(model: nn.Module, key: str, leaves: tuple = ()) -> torch.fx.GraphModule:
    try:
        graph = _Tracer(leaves).trace(model)
    except Exception as e:
        raise ConfigError(key, f"cannot trace the model with torch.fx to cut it at the embedding "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give it `features` "
                               f"and `classifier` attributes or return a raysim.models.SplitModel") from None
    return torch.fx.GraphModule(model, graph)


def _ancestors(node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def split_at(model: nn.Module, name: str, input_shape, key: str):
    """(body, head, embedding shape) of ``model`` cut after the layer or node ``name``."""
    gm = _trace(model, key, (name,))
    nodes = list(gm.graph.nodes)
    cut = [n for n in nodes if n.op == "call_module" and n.target == name] or [n for n in nodes if n.name == name]
    if not cut:
        mods = [n.target for n in nodes if n.op == "call_module"]
        raise ConfigError(key, f"the model has no layer {name!r}; layers in forward order: {', '.join(mods[-12:])}")
    if len(cut) > 1:
        raise ConfigError(key, f"layer {name!r} runs {len(cut)} times in the forward; name one node (traced names: "
                               f"{', '.join(n.name for n in cut)})")
    cut = cut[0]
    body_nodes = _ancestors(cut)
    out = next(n for n in nodes if n.op == "output")
    head_nodes = [n for n in nodes if n.op not in ("output", "placeholder") and n not in body_nodes
                  and n in _ancestors(out)]
    for n in head_nodes + [out]:
        for a in n.all_input_nodes:
            if a in body_nodes and a is not cut:
                raise ConfigError(key, f"the forward uses {a.name!r} (computed before {name!r}) after it, so {name!r} "
                                       f"does not separate body and head; name a later layer")
            if a.op == "placeholder":
                raise ConfigError(key, f"the forward reads its input again after {name!r}; name a later layer")
    placeholders = [n for n in body_nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ConfigError(key, "the body must take exactly one input (the images)")
    body_mods = {n.target for n in body_nodes if n.op in ("call_module", "get_attr")}
    head_mods = {n.target for n in head_nodes if n.op in ("call_module", "get_attr")}
    for t in sorted(body_mods & head_mods):
        obj = _submodule(gm, t)
        if obj is not None and any(True for _ in obj.parameters()):
            raise ConfigError(key, f"layer {t!r} runs both before and after {name!r}; name another cut")

    bg = torch.fx.Graph()
    env: dict = {}
    for n in nodes:
        if n in body_nodes:
            env[n] = bg.node_copy(n, lambda a: env[a])
    bg.output(env[cut])
    hg = torch.fx.Graph()
    henv = {cut: hg.placeholder("z")}
    for n in nodes:
        if n in head_nodes:
            henv[n] = hg.node_copy(n, lambda a: henv[a])
    hg.output(torch.fx.graph.map_arg(out.args[0], lambda a: henv[a]))
    body, head = torch.fx.GraphModule(gm, bg), torch.fx.GraphModule(gm, hg)
    was = model.training
    body.eval()
    with torch.no_grad():
        z = body(_probe(input_shape))
    body.train(was)
    if not isinstance(z, torch.Tensor):
        raise ConfigError(key, f"layer {name!r} outputs {type(z).__name__}, not a tensor")
    return body, head, tuple(z.shape[1:])


def _submodule(gm, target: str) -> Optional[nn.Module]:
    try:
        return gm.get_submodule(target)
    except AttributeError:
        return None


def suggest_embedding(model: nn.Module) -> Optional[str]:
    """A likely embedding layer of a user module: the input of the last linear layer its forward calls."""
    net = model.net if isinstance(model, WholeModel) else model
    try:
        gm = torch.fx.GraphModule(net, _Tracer().trace(net))
    except Exception:
        return None
    last = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)]
    if not last or not last[-1].all_input_nodes:
        return None
    src = last[-1].all_input_nodes[0]
    while src.op == "call_module" and isinstance(gm.get_submodule(src.target), Dropout) and src.all_input_nodes:
        src = src.all_input_nodes[0]  # the embedding is taken before dropout
    return src.target if src.op == "call_module" else src.name


def _check_logits(model: nn.Module, input_shape, num_classes: int, key: str, what: str) -> torch.Tensor:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(_probe(input_shape))
    except Exception as e:
        raise ConfigError(key, f"{what} fails on a batch of 2 inputs of shape {tuple(input_shape)} "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(key, f"{what} returns {got} for a batch of 2 inputs of shape {tuple(input_shape)}; expected "
                               f"logits of shape (2, {num_classes})")
    return out


def build_user_model(factory: Callable, spec: ArchSpec, input_shape, num_classes: int, path: str) -> nn.Module:
    """A user module from ``factory``, adapted to the engine's interface (see the module docstring)."""
    input_shape = tuple(input_shape)
    name = getattr(factory, "__qualname__", repr(factory))
    tv = is_torchvision_builder(factory)
    model = _user_module(factory, spec, input_shape, num_classes, path)
    if tv and input_shape[0] != 3:
        _adapt_channels(model, input_shape[0])
    replace_dropout(model)
    if isinstance(model, SplitModel):
        _check_logits(model, input_shape, num_classes, f"{path}.arch", name)
        return model
    reference = _check_logits(model, input_shape, num_classes, f"{path}.arch", name)
    cut = spec.embedding
    if cut is None and tv:
        cut = _torchvision_cut(model, f"{path}.arch")
    if cut is not None:
        body, head, shape = split_at(model, cut, input_shape, f"{path}.embedding")
        out = SplitModel(FlatBody(body), ShapedHead(head, shape), int(torch.tensor(shape).prod()))
    elif isinstance(getattr(model, "features", None), nn.Module) and isinstance(getattr(model, "classifier", None),
                                                                                nn.Module):
        was = model.training
        model.eval()
        with torch.no_grad():
            z = FlatBody(model.features)(_probe(input_shape))
        model.train(was)
        out = SplitModel(FlatBody(model.features), model.classifier, int(z.shape[1]))
        _same_forward(out, reference, input_shape, num_classes, f"{path}.arch",
                      f"{name}: classifier(features(x)) does not reproduce the module's forward; name the embedding "
                      f"layer with {path}.embedding")
        return out
    else:
        return WholeModel(model)
    _same_forward(out, reference, input_shape, num_classes, f"{path}.embedding",
                  f"{name}: the cut at {cut!r} does not reproduce the module's forward")
    return out


def _user_module(factory: Callable, spec: ArchSpec, input_shape: tuple, num_classes: int, path: str) -> nn.Module:
    """``factory``'s module, called as a torchvision builder (weights=None, num_classes=C) or as a factory
    (input_shape, num_classes), with ``spec.params``; its signature checked first, user code run under the dry
    run's guard."""
    params = dict(spec.params)
    name = getattr(factory, "__qualname__", repr(factory))
    tv = is_torchvision_builder(factory)
    if tv:
        no_weights = weight_parameters(factory)
        for k in sorted(set(no_weights) | {"weights", "pretrained", "weights_backbone"}):
            if k in params:
                raise ConfigError(f"{path}.params.{k}", "torchvision weights are never downloaded at run time; build "
                                                        "from a local weights file in a factory of your own")
        args, kwargs, expected = (), {**no_weights, "weights": None, "num_classes": num_classes, **params}, \
            "builder(weights=None, num_classes=C, **model.params)"
    else:
        args, kwargs, expected = (input_shape, num_classes), params, "factory(input_shape, num_classes, **model.params)"
    check_signature(factory, args, kwargs, f"{path}.arch", f"{path}.params", expected)
    from raysim.config import dryrun

    # a dry run lets no code it calls write: the user's factories and installed builders alike (a builder that would
    # download weights into ~/.cache/torch is refused, naming the key)
    try:
        with dryrun.user_code(f"{path}.arch", f"the model factory {name}"):
            model = factory(*args, **kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{path}.arch", f"{name}(...) raised {type(e).__name__}: "
                                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{path}.arch", f"{name}(...) returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _same_forward(split: nn.Module, reference: torch.Tensor, input_shape, num_classes, key, message) -> None:
    try:
        got = _check_logits(split, input_shape, num_classes, key, "the split model")
    except ConfigError:
        raise ConfigError(key, message) from None
    if not torch.allclose(got, reference, rtol=1e-4, atol=1e-5):
        raise ConfigError(key, message)


def _torchvision_cut(model: nn.Module, key: str) -> Optional[str]:
    gm = _trace(model, key)
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target.split(".")[0] in _HEAD_NAMES and n.all_input_nodes:
            src = n.all_input_nodes[0]
            return src.target if src.op == "call_module" and _unique_call(gm, src.target) else src.name
    return None


def _unique_call(gm, target: str) -> bool:
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == target) == 1


def resolve_factory(arch: str, key: str, zoo) -> Optional[Callable]:
    """The factory of a registered name or import path, or None for a name of the ``zoo`` (raysim.models.ARCHS)."""
    if arch in zoo:
        return None
    if arch in MODELS:  # registered from Python: trusted
        return resolve(MODELS[arch], key, "factory", trusted=True)
    if is_import_path(arch):  # from a config: called only when marked, registered, or a model by its kind
        factory = resolve(arch, key, "factory")
        if (marked(factory, MODEL_FACTORY) or registered(factory, arch, MODELS) or is_torchvision_builder(factory)
                or is_module_class(factory)):
            return factory
        raise refuse_unmarked(key, arch, factory, "model factory", "raysim.model_factory",
                              "raysim.register_model(name, factory)")
    extra = f", {', '.join(MODELS)}" if MODELS else ""
    raise ConfigError(key, f"{arch!r} is not allowed; choose one of: {', '.join(zoo)}{extra}, or an import path "
                           f"package.module:factory")


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter count and embedding size of a built model (the dry run's per-client line)."""
    return {"params": num_parameters(model),
            "embed_dim": int(model.embed_dim) if isinstance(model, SplitModel) else None}


__all__ = ["WholeModel", "build_user_model", "describe", "replace_dropout", "resolve_factory", "split_at",
           "suggest_embedding"]
