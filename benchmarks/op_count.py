"""Work counted, not timed: the aten operations (by name) that reach the dispatcher and the host reads among them
(``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)`` -- a stream synchronisation each on a GPU),
which do not depend on the CPU, so what a plain loop does not do shows on any machine.

* ``clients`` (issue "Faster than a hand-written loop on a GPU"): per trained client on benchmarks/gpu.py's workload
  (cnn4, 50 images 3x32x32 a client, batch 10, one epoch, SGD 0.05 / momentum 0.9, sequential, CPU, 1 thread), raysim
  against its plain-PyTorch twin (benchmarks/twin.py) for FedAvg, FedProx, FedProto and FedTGP (whose clients are
  FedProto's; its twin: the loop plus the method's loss and prototype sums). Setup and the final evaluation cancel
  out: runs of 2 and 4 rounds are counted and differenced. ``client steps`` counts inside the client runner's
  training steps (with its partial aggregate), ``round`` everything (the server step too; FedTGP's server trains a
  generator, which no twin does).
* ``mafml``: per MAFML iteration, raysim's per-node steps against the plain loop of benchmarks/multi_exchange.py.

    PYTHONPATH=$PWD python benchmarks/op_count.py [--what clients,mafml] [--top 25] [--vectorize]
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


READ = "aten._local_scalar_dense.default"
TWIN_OBJECTIVE = {"fedavg": "ce", "fedprox": "prox", "fedproto": "proto", "fedtgp": "proto"}


def raysim_client_counts(method: str, cohort: int = 10, clients: int = 10, vectorize: bool = False,
                         rounds: tuple = (2, 4), model: dict | None = None) -> dict:
    """Ops per trained client of raysim's sequential run (module docstring): {"client steps": Counter per client,
    "round": Counter per client}. ``model``: the config's model section instead of cnn4's (e.g. ``{"arch":
    "cnn_mnist"}``, a model with dropout)."""
    import gpu

    from raysim import register_dataset
    from raysim.config import make_config
    from raysim.runner import runners
    from raysim.engine.loop import run_experiment

    register_dataset("cifar_twin", "benchmarks.gpu:cifar_twin")
    steps = Count()
    original = runners.ClientRunner.run_client_step

    def counted_step(self, step, *a, **kw):
        if step.mode == "evaluate":
            return original(self, step, *a, **kw)
        with _Resume(steps):
            return original(self, step, *a, **kw)

    def one(r):
        c = gpu.config("cnn4", clients, cohort, r, None, {"torch_threads": 1, "device": "cpu", "vectorize": vectorize})
        c["algorithm"] = {"name": method}
        if model is not None:
            c["model"] = dict(model)
        steps.ops.clear()
        with Count() as whole:
            run_experiment(make_config(c), write=False, progress=False)
        return whole.ops.copy(), steps.ops.copy()

    from raysim.runner.step_reports import HOST_READS

    runners.ClientRunner.run_client_step = counted_step
    try:
        r0 = HOST_READS["count"]
        w1, s1 = one(rounds[0])
        r1 = HOST_READS["count"]
        w2, s2 = one(rounds[1])
        r2 = HOST_READS["count"]
    finally:
        runners.ClientRunner.run_client_step = original
    n = (rounds[1] - rounds[0]) * cohort
    # the runner's batched reads (one stacked read of all its clients' metrics and checks per step): a plain
    # memory access on a CPU, which no aten operation shows, counted by the runner itself
    batched = ((r2 - r1) - (r1 - r0)) / n
    return {"client steps": per(s2, s1, n), "round": per(w2, w1, n), "batched reads": batched}


_TWIN_COUNTS: dict = {}  # the twin's counts depend only on their arguments: counted once per process


def twin_client_counts(objective: str, cohort: int = 10, clients: int = 10, vectorized: bool = False,
                       rounds: tuple = (2, 4)) -> dict:
    """Ops per trained client of the plain twin (benchmarks/twin.py) on the same workload, differenced the same way."""
    key = (objective, cohort, clients, vectorized, tuple(rounds))
    if key not in _TWIN_COUNTS:
        _TWIN_COUNTS[key] = _twin_client_counts(*key)
    return collections.Counter(_TWIN_COUNTS[key])


def _twin_client_counts(objective: str, cohort: int, clients: int, vectorized: bool, rounds: tuple) -> dict:
    import gpu
    import twin

    from raysim.models import cnn4

    data = gpu.cifar_twin(None, clients)
    x, y = twin.client_tensors(data["x_train"], data["y_train"], clients, 50, "cpu")
    work = twin.Work(x, y)
    gen = torch.Generator().manual_seed(0)

    def one(r):
        torch.manual_seed(0)
        model = cnn4((3, 32, 32), 10)
        runner = twin.VmapCohort(model, work) if vectorized else twin.PlainLoop(
            model, work, objective, lam={"prox": 0.01, "proto": 1.0}.get(objective, 1.0))
        with Count() as c:
            for _ in range(r):
                runner.round(torch.randperm(clients, generator=gen)[:cohort].tolist())
        return c.ops.copy()

    one(1)  # first calls (torch.optim's lazy imports) outside the counts
    return per(one(rounds[1]), one(rounds[0]), (rounds[1] - rounds[0]) * cohort)


def per(a, b, n) -> collections.Counter:
    return collections.Counter({k: (a[k] - b[k]) / n for k in set(a) | set(b) if a[k] != b[k]})


class _Resume:
    """Enter an existing Count again (its counts accumulate)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.mode.__enter__()

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def clients(top: int, vectorize: bool = False, methods=("fedavg", "fedprox", "fedproto", "fedtgp")) -> dict:
    out = {}
    for m in methods:
        rs = raysim_client_counts(m, vectorize=vectorize)
        tw = twin_client_counts(TWIN_OBJECTIVE[m], vectorized=vectorize and m == "fedavg")
        ops_t, reads_t = sum(tw.values()), tw.get(READ, 0)
        row = {"twin_ops": ops_t, "twin_reads": reads_t}
        for scope in ("client steps", "round"):
            cnt = rs[scope]
            row[f"{scope}_ops"], row[f"{scope}_reads"] = sum(cnt.values()), cnt.get(READ, 0)
        row["batched_reads"] = rs["batched reads"]
        out[m] = row
        print(f"{m:9s} twin {ops_t:7.1f} ops {reads_t:5.1f} reads | raysim client steps {row['client steps_ops']:7.1f} "
              f"ops ({row['client steps_ops'] / ops_t:.3f}x) {row['client steps_reads']:5.1f} reads | whole round "
              f"{row['round_ops']:8.1f} ops ({row['round_ops'] / ops_t:.3f}x) {row['round_reads']:5.1f} reads | the runner's "
              f"batched reads {row['batched_reads']:.2f} per client", flush=True)
        if top:
            report(f"{m}, per trained client", "twin", tw, {}, "raysim client steps", rs["client steps"], {}, top)
    return out


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
    ap.add_argument("--what", default="clients,mafml")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--vectorize", action="store_true", help="clients: raysim's vectorised executor, the vmap twin")
    ap.add_argument("--methods", default="fedavg,fedprox,fedproto,fedtgp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "clients" in a.what:
        out = clients(a.top, a.vectorize, tuple(a.methods.split(",")))
        if a.json:
            import json

            Path(a.json).write_text(json.dumps(out, indent=1))
    if "mafml" in a.what:
        mafml(a.top)


if __name__ == "__main__":
    main()
