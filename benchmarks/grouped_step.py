"""Grouped execution vs vmap vs a per-model loop, one training step (issue 22, the vectorised executor's fast path):

  (1) max-pooling one [4, 1000, 24, 24] activation channels-first vs channels-last (the kernel vmap's layout hits);
  (2) one local step of K cnn_mnist clients (batch 4, dropout on): vmap(grad) as the executor ran it before, and
      grouped execution (raysim.runner.grouped.grouped_forward + autograd of the summed losses), same gradients;
  (3) MAFML's unit of work, 4 LeNets at batch 32, forward + backward: one after another vs one grouped network.

    PYTHONPATH=$PWD python benchmarks/grouped_step.py [--threads 2] [--clients 100]

Prints milliseconds per call (median of --repeat timings of 20 calls each) and the largest gradient difference.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysim import models  # noqa: E402
from raysim.runner.grouped import grouped_forward  # noqa: E402
from raysim.layers import replay_masks  # noqa: E402


def timed(f, repeat: int, n: int = 20) -> float:
    f()
    f()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    k, b = args.clients, 4

    x = torch.randn(4, 1000, 24, 24)
    xc = x.contiguous(memory_format=torch.channels_last)
    print(f"(1) max_pool2d [4, 1000, 24, 24]: channels-first {timed(lambda: F.max_pool2d(x, 2), args.repeat):.2f} ms, "
          f"channels-last {timed(lambda: F.max_pool2d(xc, 2), args.repeat):.2f} ms")

    model = models.cnn_mnist((1, 28, 28), 10)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    stacked = {n: torch.stack([p.detach() + 0.01 * torch.randn_like(p) for _ in range(k)])
               for n, p in model.named_parameters()}
    xb, yb = torch.rand(k, b, 1, 28, 28), torch.randint(0, 10, (k, b))
    masks = [(torch.rand(k, b, 20, 1, 1) > 0.5).float(), (torch.rand(k, b, 50) > 0.5).float()]

    def one(p, xi, yi, mi):
        with replay_masks(mi):
            return F.cross_entropy(torch.func.functional_call(model, p, (xi,)), yi)

    vgrad = torch.func.vmap(torch.func.grad(one))

    def grouped():
        leaves = {n: t.detach().requires_grad_(True) for n, t in stacked.items()}
        logits = grouped_forward(model, leaves, xb, False, iter(masks))
        losses = F.cross_entropy(logits.reshape(k * b, 10), yb.reshape(-1), reduction="none").view(k, b).mean(1)
        return dict(zip(names, torch.autograd.grad(losses.sum(), list(leaves.values()))))

    ref, got = vgrad(stacked, xb, yb, masks), grouped()
    diff = max(float((ref[n] - got[n]).abs().max()) for n in names)
    tv, tg = timed(lambda: vgrad(stacked, xb, yb, masks), args.repeat), timed(grouped, args.repeat)
    print(f"(2) one step of {k} cnn_mnist clients, batch {b}: vmap(grad) {tv:.1f} ms, grouped {tg:.1f} ms "
          f"({tv / tg:.2f}x); largest gradient difference {diff:.1e}")

    lenets = [models.lenet((1, 28, 28), 10) for _ in range(4)]
    x4, y4 = torch.randn(4, 32, 1, 28, 28), torch.randint(0, 10, (4, 32))

    def loop():
        for i, m in enumerate(lenets):
            torch.autograd.grad(F.cross_entropy(m(x4[i]), y4[i]), list(m.parameters()))

    st4 = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in lenets])
           for n, _ in lenets[0].named_parameters()}

    def grouped4():
        leaves = {n: t.detach().requires_grad_(True) for n, t in st4.items()}
        out = grouped_forward(lenets[0], leaves, x4, False, iter(()))
        loss = F.cross_entropy(out.reshape(-1, 10), y4.reshape(-1), reduction="none").view(4, 32).mean(1).sum()
        return torch.autograd.grad(loss, list(leaves.values()))

    tl, tg4 = timed(loop, args.repeat), timed(grouped4, args.repeat)
    print(f"(3) 4 LeNets, batch 32, forward + backward: one after another {tl:.1f} ms, grouped {tg4:.1f} ms "
          f"({tl / tg4:.2f}x)")


if __name__ == "__main__":
    main()
