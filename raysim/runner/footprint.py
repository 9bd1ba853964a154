"""What one client's local training holds in device memory, measured before a run (``backend.model_resources``): a
pool whose GPU share cannot hold it is refused before any actor starts, with the estimate and the key to change —
never an out-of-memory error mid-run.

The estimate, per architecture: weights + gradients + optimiser state (SGD with momentum: one copy, Adam: two) +
the activations autograd saves for the backward pass of one batch of ``train.batch_size`` (measured: one forward and
backward on the CPU with a hook counting every saved tensor that is not a parameter) + the batch itself + the
runner's cache of decoded client data (``backend.decoded_cache_mb``, an upper bound). It leaves out the CUDA
context (a few hundred MB per process, outside torch's allocator and so outside the per-process cap) and a method's
extra models (a generator, a teacher): for those, set ``gpu_memory_mb`` with room to spare."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.errors import ConfigError


@dataclass(frozen=True)
class Footprint:
    weights: int
    optimizer: int
    activations: int
    batch: int
    data_cache: int

    @property
    def total(self) -> int:
        return 2 * self.weights + self.optimizer + self.activations + self.batch + self.data_cache

    def describe(self) -> str:
        mb = 2**20
        return (f"weights {self.weights / mb:.1f} MB, gradients {self.weights / mb:.1f} MB, optimiser state "
                f"{self.optimizer / mb:.1f} MB, activations of a batch {self.activations / mb:.1f} MB, the batch "
                f"{self.batch / mb:.1f} MB, decoded client data up to {self.data_cache / mb:.0f} MB")


def training_footprint(model: torch.nn.Module, input_shape: tuple, train, data_cache_mb: float = 0.0) -> Footprint:
    """Measure ``model``'s training footprint for one batch (on the CPU; nothing is moved to a GPU)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    slots = 2 if train.optimizer == "adam" else (1 if train.momentum > 0 else 0)
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.zeros((train.batch_size, *input_shape))
    y = torch.zeros(train.batch_size, dtype=torch.long)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        F.cross_entropy(logits, y).backward()
    model.zero_grad(set_to_none=True)
    return Footprint(weights, slots * weights, sum(seen.values()), x.numel() * x.element_size(),
                     int(data_cache_mb * 2**20))


def check_gpu_budgets(cfg, task) -> None:
    """Every ``backend.model_resources`` pool with GPUs: its architecture's footprint fits its cap (``gpu_memory_mb``,
    else ``num_gpus`` x the memory of the GPU this driver sees; without either there is nothing to compare)."""
    pools = [(i, r) for i, r in enumerate(cfg.backend.model_resources or []) if r.num_gpus > 0]
    if not pools:
        return
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    for i, r in pools:
        cap = r.gpu_memory_mb * 2**20 if r.gpu_memory_mb else (min(r.num_gpus, 1.0) * total if total else None)
        if cap is None:
            continue
        specs = {repr(a): cid for cid, a in enumerate(task.archs) if a.arch == r.arch}
        for cid in specs.values():
            fp = training_footprint(task.build_model(cid), task.input_shape, task.train, cfg.backend.decoded_cache_mb)
            if fp.total > cap:
                key = f"backend.model_resources[{i}]." + ("gpu_memory_mb" if r.gpu_memory_mb else "num_gpus")
                raise ConfigError(key, f"{r.arch} needs about {fp.total / 2**20:,.0f} MB of GPU memory to train "
                                       f"({fp.describe()}), more than the {cap / 2**20:,.0f} MB this pool's actors "
                                       f"may use; raise {key.rsplit('.', 1)[1]}, or lower train.batch_size / "
                                       f"backend.decoded_cache_mb")
