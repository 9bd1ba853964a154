"""Fast Ray serialisation of CPU tensors.

Ray pickles a ``torch.Tensor`` through torch's own reducer, which copies the storage several times: a 4.8 MB state
dict takes ~150 ms from one actor to another and back, against ~10 ms as raw bytes (measured on this project's
machine). Every payload, upload and client-data group goes through the object store, so this is most of the Ray
backend's overhead for large models. :func:`register` makes a process ship a dense CPU tensor as its raw bytes
(one numpy array, which Ray's pickle-5 path moves without copies) plus dtype, shape and ``requires_grad``; on the
receiving side the bytes are copied once into a fresh tensor (never a view of the shared, immutable object-store
buffer, so a receiver may modify what it got). The values are bit-identical. Tensors of other kinds (CUDA, sparse,
quantised, subclasses such as ``nn.Parameter``) keep torch's reducer. The deserialiser travels with the data, so
only the sending process needs :func:`register`; the driver and every raysim actor call it.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

_done = False


def _is_plain(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_quantized and not t.is_nested and not t.is_conj() and not t.is_neg())


def _serialize(t: torch.Tensor):
    if not _is_plain(t):
        return ("pickle", pickle.dumps(t, protocol=5))
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.element_size() and flat.numel() else np.zeros(0, np.uint8)
    return ("raw", raw, str(t.dtype).split(".")[-1], tuple(t.shape), t.requires_grad)


def _deserialize(obj):
    if obj[0] == "pickle":
        return pickle.loads(obj[1])
    _, raw, dtype, shape, requires_grad = obj
    dt = getattr(torch, dtype)
    buf = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # own memory, writable
    t = buf.view(dt).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dt)
    return t.requires_grad_(True) if requires_grad else t


def register() -> None:
    """Use the raw-bytes path for tensors this process sends through Ray (idempotent; needs Ray initialised)."""
    global _done
    if _done:
        return
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_serialize, deserializer=_deserialize)
    _done = True
