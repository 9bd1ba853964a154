"""Peer benchmarks (issue 12 item 4): one FedAvg workload in raysim (sequential, Ray with 2 actors, each with and
without ``backend.vectorize``), in a plain PyTorch loop (1 process, and 2 persistent worker processes each owning half
of the clients) and, optionally, in Flower's simulation (``--flower-python``: the interpreter of a separate virtual
environment, because Flower pins its own Ray):

    python3 -m venv /tmp/flwr-venv && /tmp/flwr-venv/bin/pip install "flwr[simulation]" torch numpy
    python benchmarks/peers/run.py --workload b --flower-python /tmp/flwr-venv/bin/python

Workloads (every client every round, one local epoch, SGD lr 0.01 momentum 0.5, 1 torch thread per process):
  (a) 10 clients x 400 MNIST-5k images, PFLlib's FedAvgCNN widened to 1.19M parameters (``fedavg_cnn`` with
      embed_dim 1100), batch 32;
  (b) 100 clients x 40 MNIST-5k images, FedProto's CNN (``cnn_mnist``, 21,840 parameters, dropout on), batch 4.
Flower runs both of its simulation entry points (``run_simulation`` and the legacy ``start_simulation``); its rounds
keep getting faster for a few rounds while Ray's worker pool warms up, so use ``--rounds 8`` for a steady figure.
Reported: median seconds per round over the timed rounds (the first round warms up; evaluation only after the
last, untimed), and every variant's ratio to the plain 2-process loop. All variants run one after another in one
invocation, so the ratios are measured in one run on one machine state.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "a": {"clients": 10, "samples": 400, "batch": 32, "arch": "fedavg_cnn", "params": {"embed_dim": 1100}},
    "b": {"clients": 100, "samples": 40, "batch": 4, "arch": "cnn_mnist", "params": {}},
}


def config(w: dict, rounds: int, backend: str = "sequential", vectorize: bool = False, threads: int = 1) -> dict:
    return {"name": "peers", "seed": 1, "rounds": rounds,
            "data": {"dataset": "mnist5k", "num_clients": w["clients"], "partition": "iid",
                     "partition_params": {"samples_per_client": w["samples"], "test_per_client": 10}},
            "model": {"arch": w["arch"], "params": w["params"]},
            "train": {"local_epochs": 1, "batch_size": w["batch"], "lr": 0.01, "momentum": 0.5},
            "algorithm": {"name": "fedavg", "params": {}},
            "eval": {"every": rounds},
            "backend": {"name": backend, "num_actors": 2, "vectorize": vectorize, "torch_threads": threads},
            "output": {"progress": False}}


# -- plain PyTorch --------------------------------------------------------------------------------------------------
def _client_round(model, global_w, x, y, batch, gen):
    model.load_state_dict(global_w)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    perm = torch.randperm(len(y), generator=gen)
    for s in range(0, len(y), batch):
        idx = perm[s:s + batch]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, len(y)


def _data(w, rounds):
    from raysim.config import make_config
    from raysim.engine.prepare import prepare

    prep = prepare(make_config(config(w, rounds)))
    clients = [c.to("cpu") for c in prep.fed_data.clients]  # decoded float images, as raysim trains on
    return prep, [(c.x_train, c.y_train) for c in clients]


def _average(results):
    total = sum(n for _, n in results)
    return {k: sum(r[k] * (n / total) for r, n in results) for k in results[0][0]}


def _worker(conn, w, rounds, ids):
    torch.set_num_threads(1)
    prep, data = _data(w, rounds)
    model = prep.task.build_model(0)
    gen = torch.Generator().manual_seed(0)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send([_client_round(model, msg, *data[i], w["batch"], gen) for i in ids])


def plain(w, rounds, processes) -> list[float]:
    torch.set_num_threads(1)
    prep, data = _data(w, rounds)
    model = prep.task.build_model(0)
    global_w = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    times = []
    if processes == 1:
        for _ in range(rounds):
            t0 = time.perf_counter()
            global_w = _average([_client_round(model, global_w, x, y, w["batch"], gen) for x, y in data])
            times.append(time.perf_counter() - t0)
        return times
    ctx = mp.get_context("fork")
    pipes = []
    for p in range(processes):
        a, b = ctx.Pipe()
        ctx.Process(target=_worker, args=(b, w, rounds, list(range(p, w["clients"], processes))), daemon=True).start()
        pipes.append(a)
    for _ in range(rounds):
        t0 = time.perf_counter()
        for a in pipes:
            a.send(global_w)
        res = [r for a in pipes for r in a.recv()]
        global_w = _average(res)
        times.append(time.perf_counter() - t0)
    for a in pipes:
        a.send(None)
    return times


# -- raysim ---------------------------------------------------------------------------------------------------------
def raysim_rounds(w, rounds, backend, vectorize, threads=1) -> list[float]:
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    res = run_experiment(make_config(config(w, rounds, backend, vectorize, threads)), write=False, progress=False)
    return res.timing["round_s"][:-1]  # the last round also evaluates


def flower(python: str, w, rounds, api: str = "run_simulation") -> list[float]:
    out = subprocess.run([python, str(Path(__file__).with_name("flower_fedavg.py")), json.dumps(w), str(rounds), api],
                         capture_output=True, text=True, cwd=ROOT, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ROUND_TIMES ")]
    if out.returncode or not lines:
        raise RuntimeError(f"flower run failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("ROUND_TIMES "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flower-python", default=None)
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]
    torch.set_num_threads(1)
    variants = {
        "plain loop, 1 process": lambda: plain(w, args.rounds, 1),
        "plain loop, 2 processes": lambda: plain(w, args.rounds, 2),
        "raysim sequential": lambda: raysim_rounds(w, args.rounds, "sequential", False),
        "raysim ray, 2 actors": lambda: raysim_rounds(w, args.rounds, "ray", False),
        "raysim sequential, vectorised": lambda: raysim_rounds(w, args.rounds, "sequential", True),
        "raysim ray, 2 actors, vectorised": lambda: raysim_rounds(w, args.rounds, "ray", True),
        # one process using both cores through intra-op threads (backend.torch_threads: 2; numbers within float
        # tolerance of 1 thread, not bit-identical)
        "raysim sequential, vectorised, 2 torch threads": lambda: raysim_rounds(w, args.rounds, "sequential", True, 2),
    }
    if args.flower_python:
        variants["Flower run_simulation, 2 CPUs"] = lambda: flower(args.flower_python, w, args.rounds)
        variants["Flower start_simulation (legacy), 2 CPUs"] = lambda: flower(args.flower_python, w, args.rounds,
                                                                              "start_simulation")
    res = {}
    for name, fn in variants.items():
        times = fn()
        res[name] = statistics.median(times[1:]) if len(times) > 1 else times[0]
        print(f"  {name}: {res[name]:.3f} s/round", flush=True)
    ref = res["plain loop, 2 processes"]
    print(f"\nworkload ({args.workload}): {w['clients']} clients x {w['samples']} mnist5k images, {w['arch']} "
          f"{w['params'] or ''}, batch {w['batch']}, 1 epoch, FedAvg, {args.rounds} rounds (first untimed)")
    print("| variant | s/round | x plain 2-process loop |")
    print("|---|---|---|")
    for name, s in res.items():
        print(f"| {name} | {s:.3f} | {s / ref:.2f} |")
    best = min(v for k, v in res.items() if k.startswith("raysim"))
    flw = {k: v for k, v in res.items() if k.startswith("Flower")}
    if flw:
        print(f"fastest raysim variant vs the faster Flower entry point: {min(flw.values()) / best:.2f}x faster")


if __name__ == "__main__":
    main()
