"""A live model's weights in and out without ``nn.Module``'s generic machinery (issue 48: the per-client loop's host
work). ``model.state_dict(keep_vars=True)`` and ``model.load_state_dict(weights)`` visit every module through hooks,
metadata, prefix scans over every key and error bookkeeping — about 0.5 ms of Python a client on a small CNN, where a
hand-written loop copies into the tensors it already holds. :func:`live_state` and :func:`load_live` give the same
tensors and make the same copies (``param.copy_(value)`` under ``torch.no_grad``, in state-dict order) for module trees
that use none of that machinery (no state-dict hooks, no class overriding how a module saves or loads its state, no
lazy parameters); any other tree, any key or shape mismatch and a non-tensor value go to torch's own methods (which
raise their own errors)."""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

_OVERRIDABLE = ("_save_to_state_dict", "_load_from_state_dict", "get_extra_state", "set_extra_state",
                "state_dict", "load_state_dict")
_plain_class: dict = {}  # module class -> whether it overrides none of _OVERRIDABLE (torch's generic code applies)


def _plain(cls) -> bool:
    ok = _plain_class.get(cls)
    if ok is None:
        ok = _plain_class[cls] = (all(getattr(cls, name, None) is getattr(nn.Module, name) for name in _OVERRIDABLE)
                                  and not issubclass(cls, nn.modules.lazy.LazyModuleMixin))
    return ok


class _Generic(Exception):
    """The tree needs torch's own state-dict code."""


def _collect(module: nn.Module, prefix: str, out: dict) -> None:
    if not _plain(type(module)) or module._state_dict_hooks or module._state_dict_pre_hooks \
            or module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
        raise _Generic
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = p
    skip = module._non_persistent_buffers_set
    for name, b in module._buffers.items():
        if b is not None and name not in skip:
            out[prefix + name] = b
    for name, child in module._modules.items():
        if child is not None:
            _collect(child, prefix + name + ".", out)


def _tensors(model: nn.Module) -> Optional[dict]:
    """{name: the model's own tensor} in ``state_dict`` order, or None when the tree needs torch's code."""
    out: dict = {}
    try:
        _collect(model, "", out)
    except _Generic:
        return None
    if any(isinstance(t, nn.parameter.UninitializedTensorMixin) or t.is_meta for t in out.values()):
        return None
    return out


def live_state(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)``: the parameters and persistent buffers themselves, by name, in the same
    order (a plain dict; torch's ordered dict with its version metadata for a tree that needs torch's code)."""
    out = _tensors(model)
    return model.state_dict(keep_vars=True) if out is None else out


def load_live(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(weights)`` (strict): each parameter and persistent buffer copied from the value of its
    name in place, under ``torch.no_grad``, in state-dict order."""
    own = _tensors(model) if isinstance(weights, Mapping) else None
    if (own is None or len(own) != len(weights) or torch.__future__.get_swap_module_params_on_conversion()
            or any(not isinstance(weights.get(k), torch.Tensor) or weights[k].shape != t.shape
                   for k, t in own.items())):
        model.load_state_dict(weights)
        return
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(weights[k])
