"""Device-resident training (issue "GPU-first execution"), checked without a GPU: local training reads nothing
back to the host per step. Every host synchronisation of a CUDA run goes through a tensor-to-Python conversion
(``float``, ``item``, ``bool``, ``int``, ``tolist``, ``numpy``, ``cpu``); a TorchFunctionMode counts those calls, and
their number must not grow with the number of local steps (only the final metric reads remain)."""
from __future__ import annotations

import torch

from raysim import rng as rngmod
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from raysim.config import TrainConfig
from raysim.models import cnn_mnist

SYNCS = {"__float__", "item", "__bool__", "__int__", "tolist", "cpu", "numpy", "__index__"}


class CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _ce(model, xb, yb, epoch):
    logits = model(xb)
    return F.cross_entropy(logits, yb), {"ce": F.cross_entropy(logits.detach(), yb)}


def _syncs_of_loop(epochs: int) -> tuple[list, dict]:
    from raysim.training import TrainOptions, _train_loop

    torch.manual_seed(0)
    model = cnn_mnist((1, 28, 28), 10)
    x, y = torch.rand(24, 1, 28, 28), torch.randint(0, 10, (24,))
    cfg = TrainConfig(optimizer="sgd", lr=0.05, momentum=0.5, batch_size=4, local_epochs=epochs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    with CountSyncs() as c:
        metrics = _train_loop(model, x, y, TrainOptions(cfg, torch.Generator().manual_seed(1)), _ce, opt)
    return c.calls, metrics


def test_the_per_client_loop_reads_nothing_back_to_the_host():
    """The loop's mean losses stay 0-dim tensors on the device (the runner reads every client's at once, at the end
    of the step: tests/test_op_counts.py), whatever the number of steps."""
    one, m1 = _syncs_of_loop(1)  # 6 steps
    three, m3 = _syncs_of_loop(3)  # 18 steps
    assert one == three == []
    assert set(m1) == set(m3) == {"train_loss", "train_ce"}
    assert all(torch.is_tensor(v) and v.dim() == 0 and v.dtype == torch.float64 for v in m3.values())
    assert float(m3["train_loss"]) > 0


def _syncs_of_vectorised(epochs: int, n: int = 8) -> list:
    from raysim.runner.vectorized import vmap_local_sgd
    from tests.members import zip_members

    torch.manual_seed(0)
    model = cnn_mnist((1, 28, 28), 10)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    cfg = TrainConfig(optimizer="sgd", lr=0.05, momentum=0.5, batch_size=4, local_epochs=epochs)
    xs, ys = [torch.rand(n, 1, 28, 28)] * 3, [torch.randint(0, 10, (n,))] * 3
    gens = [rngmod.Counter(i) for i in range(3)]
    with CountSyncs() as c:
        vmap_local_sgd(model, _ce, zip_members([start] * 3, xs, ys, gens, [rngmod.Counter(9 + i)
                                                                           for i in range(3)]), cfg)
    return c.calls


def test_the_vectorised_executor_does_not_read_the_host_per_step():
    """2 steps or 6 steps of one epoch: the same reads (the shape probe of each (batch size, epoch) and the final
    metrics; nothing per step)."""
    two, six = _syncs_of_vectorised(1, 8), _syncs_of_vectorised(1, 24)
    assert len(two) == len(six), (two, six)
