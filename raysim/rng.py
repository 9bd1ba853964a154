"""Deterministic random streams.

Every random draw in raysim comes from a stream keyed by (seed, round_idx, client_id, purpose), so a run gives the
same numbers whichever backend, actor or process executes a client, and a resumed run re-derives the same streams.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib

import numpy as np
import torch

SERVER = -1  # client_id used for server-side streams
NO_ROUND = -1  # round_idx used for streams that do not depend on the round (initialisation, partitioning)


# The classic steps' random streams keep the names of the one-exchange engine: by step name (raysim.steps.CLASSIC_ROUND
# and EVALUATION, plus the engine's own calls) for the streams a method draws, by method for the global-RNG stream of
# a step's execution.
CLASSIC_STEPS = frozenset({"update", "evaluate", "init", "aggregate", "broadcast", "evaluate_server"})
CLASSIC_METHOD_STREAMS = {"client_update": "update", "evaluate_client": "evaluate", "classic_aggregate": "aggregate",
                          "evaluate_server": "evaluate"}


def stream_name(purpose: str, step: str = "", iteration: int = 0) -> str:
    """The purpose of a stream drawn for ``purpose`` in the schedule step named ``step``, repetition ``iteration``:
    ``purpose`` in a classic step (or none), ``purpose@step`` in any other; ``#iteration`` appended when
    ``iteration`` > 0. The one naming rule of the determinism contract (``Context.rng`` / ``Context.generator`` and
    the runners' pinning of torch's global RNG, :func:`step_stream`, both use it)."""
    if step and step not in CLASSIC_STEPS:
        purpose = f"{purpose}@{step}"
    return f"{purpose}#{iteration}" if iteration else purpose


def step_stream(method: str, step: str, iteration: int = 0) -> str:
    """The purpose torch's global RNG is pinned to for one execution of a step (method ``method``, named ``step``):
    the classic methods keep their one-exchange names, any other step is named by its step name."""
    return stream_name(CLASSIC_METHOD_STREAMS.get(method, step), iteration=iteration)


def derive_seed(seed: int, round_idx: int, client_id: int, purpose: str) -> int:
    """A 63-bit integer seed, a pure function of its four arguments (stable across processes and Python versions)."""
    key = f"{int(seed)}|{int(round_idx)}|{int(client_id)}|{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def numpy_rng(seed: int, round_idx: int, client_id: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, round_idx, client_id, purpose))


def torch_generator(seed: int, round_idx: int, client_id: int, purpose: str, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, round_idx, client_id, purpose))
    return g


@contextlib.contextmanager
def init_seed(seed: int, purpose: str, round_idx: int = NO_ROUND, client_id: int = SERVER):
    """Inside the block torch's global RNG (which ``nn.init`` draws from when a module is built) is pinned to the
    stream (seed, round, client, purpose); after it the caller's CPU stream continues where it was. The methods'
    one way to make seeded initial weights: ``with rng.init_seed(task.seed, "tgp_init"): gen = Generator(...)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, round_idx, client_id, purpose))
        yield


@contextlib.contextmanager
def keep_global_rng():
    """torch's global CPU RNG restored after the block: building a module whose weights are loaded afterwards (a
    cache filled on first use) never moves the caller's random stream."""
    with torch.random.fork_rng(devices=[]):
        yield


def seed_torch_global(seed: int, round_idx: int, client_id: int, purpose: str) -> None:
    """Pin torch's global RNG (used by dropout and nn.init) for one client step.

    The runners call this before every client update / initialisation so that layers drawing from the global
    generator are still a function of (seed, round, client, purpose)."""
    s = derive_seed(seed, round_idx, client_id, purpose)
    if _accelerator_present():
        torch.manual_seed(s)  # also the accelerators' generators
    else:
        # CPU only: the same CPU generator state, without torch.manual_seed's queueing of lazy CUDA/XPU/MTIA seed calls
        # (each captures a stack trace, ~0.6 ms; a few per client step)
        torch.default_generator.manual_seed(s)


@functools.cache
def _accelerator_present() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return bool(torch.cuda.is_available() or (mps is not None and mps.is_available())
                or (xpu is not None and xpu.is_available()))


# --- Counter-based draws -------------------------------------------------------------------------------------------
# A local training's batch orders and dropout masks are pure functions of (stream key, counter, element): the stream
# key is derive_seed(seed, round, client, purpose), the counter the local epoch (batch orders) or the number of masks
# the client drew before (dropout), the element the position in the permutation or the mask. Nothing is carried from
# draw to draw, so a whole group of clients draws in one computation whatever its size (the vectorised executor), and
# the per-client loop computes the very same bits with a group of one. Integer arithmetic only (int64 tensors holding
# 32-bit values; every product below 2^63), so the draws are the same on every CPU and accelerator.

_M32 = 0xFFFFFFFF
# a 32-bit integer hash of the xorshift-multiply family, shifts 16 / 15 / 15 and multipliers 0x21f0aaad, 0x735a2d97
# (from C. Wellons' hash prospector, one of its lowest-bias results): both multipliers are below 2^31, so a 32-bit
# value times either stays below 2^63 and the whole hash is exact in int64 tensors, 10 elementwise ops
_C1, _C2 = 0x21F0AAAD, 0x735A2D97


def _mix32_int(h: int) -> int:
    """The 32-bit mixing function on a Python int (the same bits as :func:`_mix32` on a tensor)."""
    h &= _M32
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 15
    h = (h * _C2) & _M32
    h ^= h >> 15
    return h


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32_int` on an int64 tensor of values in [0, 2^32) (every product below 2^63)."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 15)


def _key_base(key: int) -> int:
    """A stream key (63 bits) folded to the 32-bit base its draws start from."""
    return _mix32_int(_mix32_int(key & _M32) ^ (key >> 32))


_ELEMENTS: dict = {}


def _elements(n: int, device) -> torch.Tensor:
    """The hashed positions 0..n-1 on ``device`` (cached: the same for every draw of that size)."""
    k = (int(n), str(device))
    e = _ELEMENTS.get(k)
    if e is None:
        if len(_ELEMENTS) > 64:
            _ELEMENTS.clear()
        e = _ELEMENTS[k] = _mix32(torch.arange(int(n), dtype=torch.int64, device=device))
    return e


def _draw_bits(bases, counter, n: int, device) -> torch.Tensor:
    """[K, n] 32-bit values (int64) for K streams (``bases``: their folded keys as an int64 tensor [K] on ``device``,
    or a Python int for one stream) at ``counter`` (an int, or an int64 tensor [K])."""
    if isinstance(bases, int) and isinstance(counter, int):  # one stream: its base folded on the host
        return _mix32(_elements(n, device) ^ _mix32_int(bases ^ _mix32_int(counter))).unsqueeze(0)
    if isinstance(bases, int):
        bases = torch.tensor([bases], dtype=torch.int64, device=device)
    c = _mix32_int(counter) if isinstance(counter, int) else _mix32(counter.to(bases.device))
    return _mix32(_mix32(bases ^ c).unsqueeze(1) ^ _elements(n, device))


def _mix32_np(h: np.ndarray) -> np.ndarray:
    """:func:`_mix32_int` on a uint64 array of values in [0, 2^32) (uint64 products are exact modulo 2^64)."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(_C1)) & np.uint64(_M32)
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(_C2)) & np.uint64(_M32)
    return h ^ (h >> np.uint64(15))


_POSITIONS: dict = {}


def permutations(bases, epoch: int, sizes) -> torch.Tensor:
    """The batch orders of K streams (``bases``: their folded keys, :attr:`Counter.base`) for local epoch ``epoch``:
    an int64 CPU tensor [K, max(sizes)] whose row i starts with a permutation of 0..sizes[i]-1 (the rest of the row:
    the unused positions). Computed on the host (a few vector operations over K x n integers, no device op; the caller
    moves it where the data is, once an epoch); row i is the same whatever the other streams of the group are."""
    sizes = [int(s) for s in sizes]
    n = max(sizes, default=0)
    pos = _POSITIONS.get(n)
    if pos is None:
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        pos = _POSITIONS[n] = _mix32_np(np.arange(n, dtype=np.uint64))
    c = _mix32_int(int(epoch))
    b = _mix32_np(np.asarray([int(x) ^ c for x in bases], dtype=np.uint64))
    bits = _mix32_np(b[:, None] ^ pos[None, :])
    if any(s != n for s in sizes):  # positions past a stream's size sort last (above every 32-bit value)
        bits[np.arange(n)[None, :] >= np.asarray(sizes)[:, None]] = np.uint64(_M32 + 1)
    return torch.from_numpy(np.argsort(bits, axis=1, kind="stable").astype(np.int64))


def keep_masks(bases, draw, shape: tuple, p: float, dtype, device) -> torch.Tensor:
    """Dropout keep-masks (1 kept, 0 dropped, probability ``1 - p`` of keeping) of shape [K, *shape] in ``dtype``:
    the mask number ``draw`` (an int, or an int64 tensor [K]) of each of K streams."""
    n = 1
    for s in shape:
        n *= int(s)
    keep = int(round((1.0 - float(p)) * 2.0 ** 32))  # kept where the 32-bit value is below this
    bits = _draw_bits(bases, draw, n, device)
    k = bits.shape[0]
    return (bits < keep).to(dtype).view(k, *shape)


def uniforms(bases, counter, n: int, device) -> torch.Tensor:
    """Uniform float32 values in [0, 1) (24-bit, exact) of shape [K, n]: draw number ``counter`` of K streams."""
    return (_draw_bits(bases, counter, n, device) >> 8).to(torch.float32) * (1.0 / 2 ** 24)


def integers(bases, counter, n: int, high, device) -> torch.Tensor:
    """Integers in [0, high) of shape [K, n] (``high``: an int, or an int64 tensor [K, 1] of each stream's bound,
    below 2^31): draw number ``counter`` of K streams, by the multiply-shift of the 32-bit values (exact in int64)."""
    return (_draw_bits(bases, counter, n, device) * high) >> 32


class Counter:
    """A client's counter-based stream for one local training (:func:`permutations`, :func:`keep_masks`,
    :func:`uniforms`, :func:`integers`): its key, and the number of draws made so far (the counter of the next). Used in place of a torch generator
    by :func:`raysim.training.local_sgd` (batch orders) and :class:`raysim.layers.Dropout` (masks)."""

    def __init__(self, key: int):
        self.key = int(key)
        self.base = _key_base(self.key)
        self.drawn = 0

    def permutation(self, n: int, epoch: int) -> torch.Tensor:
        """The batch order of local epoch ``epoch`` over ``n`` samples (an int64 CPU tensor)."""
        return permutations([self.base], epoch, [n])[0]

    def mask(self, shape: tuple, p: float, dtype, device) -> torch.Tensor:
        m = keep_masks(self.base, self.drawn, shape, p, dtype, device)[0]
        self.drawn += 1
        return m

    def uniform(self, shape: tuple, device) -> torch.Tensor:
        """The next draw as uniform float32 values in [0, 1) of ``shape`` (:func:`uniforms`)."""
        n = 1
        for d in shape:
            n *= int(d)
        u = uniforms(self.base, self.drawn, n, device)[0].view(shape)
        self.drawn += 1
        return u

    def integers(self, high: int, shape: tuple, device) -> torch.Tensor:
        """The next draw as integers in [0, high) of ``shape`` (:func:`integers`)."""
        n = 1
        for d in shape:
            n *= int(d)
        v = integers(self.base, self.drawn, n, int(high), device)[0].view(shape)
        self.drawn += 1
        return v


def counter(seed: int, round_idx: int, client_id: int, purpose: str) -> Counter:
    """The counter-based stream for (seed, round, client, purpose)."""
    return Counter(derive_seed(seed, round_idx, client_id, purpose))


def stacked_bases(streams, device) -> torch.Tensor:
    """The folded keys of several :class:`Counter` streams as one int64 tensor [K] on ``device`` (one copy): the
    ``bases`` of :func:`keep_masks` for a group."""
    return torch.tensor([s.base for s in streams], dtype=torch.int64, device=device)
