"""Would training MAFML's nodes together (one vmapped computation over the stacked parameters of the 4 LeNets) beat
the per-node loop on this CPU? (issue "Performance II", item 1: "let the vectorised executor train the nodes of a
multi-exchange step together where their architecture matches").

One MAFML iteration's arithmetic, 4 LeNet nodes on 28x28 inputs, batch 32, Adam (lr 1e-3, weight decay 1e-4):
per node a private CE step and soft labels of a public batch (eval forward), then per node a CE step on the other
three nodes' public batches (96 samples). ``plain``: the nodes one after another with torch.optim.Adam, as the
per-node loop (and raysim's MAFML) does it; ``vmap``: the same steps for the 4 nodes at once (torch.func
functional_call + vmap + grad_and_value over the stacked parameters, Adam written over the stacked tensors). Random
inputs (the timing does not depend on the pixels). Prints ms per iteration, at 1 and 2 torch threads.

    PYTHONPATH=$PWD python benchmarks/mafml_vmap.py [--iterations 40]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

from raysim.models import lenet

N, B, PRIVATE, PUBLIC = 4, 32, 650, 100


def setup(seed: int = 0):
    torch.manual_seed(seed)
    models = [lenet((1, 28, 28), 10) for _ in range(N)]
    data = {"x": torch.randn(N, PRIVATE, 1, 28, 28), "y": torch.randint(0, 10, (N, PRIVATE)),
            "px": torch.randn(N, PUBLIC, 1, 28, 28), "py": torch.randint(0, 10, (N, PUBLIC))}
    return models, data


def plain_runner(models, d):
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-4) for m in models]

    def iteration():
        for i, (m, o) in enumerate(zip(models, opts)):
            idx = torch.randperm(PRIVATE)[:B]
            o.zero_grad()
            F.cross_entropy(m(d["x"][i, idx]), d["y"][i, idx]).backward()
            o.step()
            with torch.no_grad():
                m(d["px"][i, :B])
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            sum(F.cross_entropy(m(d["px"][j, :B]), d["py"][j, :B]) for j in range(N) if j != i).backward()
            o.step()
    return iteration


def vmap_runner(models, d):
    base = lenet((1, 28, 28), 10)
    params, _ = stack_module_state(models)
    params = {k: v.detach().clone() for k, v in params.items()}
    moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in params.items()}
    step = [0]

    def loss(p, xb, yb):
        return F.cross_entropy(functional_call(base, (p, {}), (xb,)), yb)

    grads_of = vmap(grad_and_value(loss))
    forward = vmap(lambda p, xb: functional_call(base, (p, {}), (xb,)))

    def adam(grads, lr=1e-3, wd=1e-4, b1=0.9, b2=0.999, eps=1e-8):
        step[0] += 1
        t = step[0]
        for k, p in params.items():
            g = grads[k] + wd * p
            m, v = moments[k]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v / (1 - b2 ** t)).sqrt_().add_(eps), value=-lr / (1 - b1 ** t))

    others = [[j for j in range(N) if j != i] for i in range(N)]

    def iteration():
        idx = torch.stack([torch.randperm(PRIVATE)[:B] for _ in range(N)])
        xb = torch.stack([d["x"][i, idx[i]] for i in range(N)])
        yb = torch.stack([d["y"][i, idx[i]] for i in range(N)])
        g, _ = grads_of(params, xb, yb)
        adam(g)
        with torch.no_grad():
            forward(params, d["px"][:, :B])
        xp = torch.stack([torch.cat([d["px"][j, :B] for j in others[i]]) for i in range(N)])
        yp = torch.stack([torch.cat([d["py"][j, :B] for j in others[i]]) for i in range(N)])
        g, _ = grads_of(params, xp, yp)
        adam(g)
    return iteration


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=40)
    args = ap.parse_args()
    print("| torch threads | per-node loop ms / iteration | vmapped ms / iteration | vmapped / loop |")
    print("|---|---|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = {}
        for name, make in (("plain", plain_runner), ("vmap", vmap_runner)):
            models, data = setup()
            it = make(models, data)
            for _ in range(5):  # warm-up
                it()
            t0 = time.perf_counter()
            for _ in range(args.iterations):
                it()
            out[name] = (time.perf_counter() - t0) / args.iterations * 1000
        print(f"| {threads} | {out['plain']:.1f} | {out['vmap']:.1f} | {out['vmap'] / out['plain']:.2f} |")


if __name__ == "__main__":
    main()
