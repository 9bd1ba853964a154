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
