"""Per-step work counted, not timed (issue "GPU-first execution", item 5): the aten operations (by name) and the
bytes they copy, per MAFML iteration, for raysim's per-node steps against the plain loop of benchmarks/
multi_exchange.py doing the same maths; and per ResNet-18 round for the Ray backend with one actor against the
sequential backend. Counts do not depend on the CPU, so what the plain loop does not do shows on any machine.

    PYTHONPATH=$PWD python benchmarks/op_count.py [--what mafml,resnet] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

COPIES = {"aten.copy_.default", "aten.clone.default", "aten._to_copy.default",
          "aten.cat.default", "aten.stack.default", "aten.index.Tensor", "aten.lift_fresh.default"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.copied = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        self.ops[name] += 1
        if name in COPIES and isinstance(out, torch.Tensor):
            self.copied[name] += out.numel() * out.element_size()
        return out


def counted(fn):
    with Count() as c:
        fn()
    return c


def diff(a: Count, b: Count, scale: float):
    return {k: (a.ops[k] - b.ops[k]) / scale for k in set(a.ops) | set(b.ops)}, \
           {k: (a.copied[k] - b.copied[k]) / scale for k in set(a.copied) | set(b.copied)}


def mafml(top: int) -> None:
    from multi_exchange import config, plain_loop

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment
    from raysim.engine.prepare import prepare

    prep = prepare(make_config(config(1, "sequential", 1)))
    p1 = counted(lambda: plain_loop(prep, 1, 0))
    p3 = counted(lambda: plain_loop(prep, 3, 0))
    plain_ops, plain_bytes = diff(p3, p1, 2)
    it = 4
    cfg = lambda r: make_config({**config(r, "sequential", 1), "algorithm": {"name": "mafml", "params": {"iterations": it}},
                                 "train": {**config(r, "sequential", 1)["train"], "local_steps": it}})
    r1 = counted(lambda: run_experiment(cfg(1), write=False))
    r2 = counted(lambda: run_experiment(cfg(2), write=False))
    ray_ops, ray_bytes = diff(r2, r1, it)
    report("MAFML, per iteration (4 LeNet nodes)", "plain loop", plain_ops, plain_bytes, "raysim sequential", ray_ops,
           ray_bytes, top)


def report(title, an, a_ops, a_bytes, bn, b_ops, b_bytes, top):
    print(f"\n== {title}: {an} vs {bn}")
    print(f"ops: {sum(a_ops.values()):.0f} vs {sum(b_ops.values()):.0f} ({sum(b_ops.values()) / max(1, sum(a_ops.values())):.2f}x); "
          f"bytes copied: {sum(a_bytes.values()) / 1e6:.2f} MB vs {sum(b_bytes.values()) / 1e6:.2f} MB")
    rows = sorted(set(a_ops) | set(b_ops), key=lambda k: -(abs(b_ops.get(k, 0) - a_ops.get(k, 0))))
    print(f"{'op':40s} {an:>12s} {bn:>12s} {'extra':>8s}  bytes {an} / {bn}")
    for k in rows[:top]:
        print(f"{k:40s} {a_ops.get(k, 0):12.1f} {b_ops.get(k, 0):12.1f} {b_ops.get(k, 0) - a_ops.get(k, 0):8.1f}  "
              f"{a_bytes.get(k, 0) / 1e3:.0f} kB / {b_bytes.get(k, 0) / 1e3:.0f} kB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="mafml")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "mafml" in a.what:
        mafml(a.top)


if __name__ == "__main__":
    main()
