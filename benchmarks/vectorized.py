"""Issue 12 item 1: the vectorised executor against the per-client loop, in one run (interleaved repetitions, so
both see the same machine load), on the issue's setting: 100 clients x 40 MNIST-5k images, FedProto's CNN
(cnn_mnist, 21,840 parameters), batch 4, one local epoch, FedAvg, every client every round, SGD momentum 0.5.

Reported: seconds per round (median of the timed rounds, after one warm-up round) for the sequential backend and
for Ray with 2 actors, loop vs ``backend.vectorize: true``, and the largest difference between the two tables (the
equality policy's stated tolerance). ``--dropout 0`` turns cnn_mnist's two dropouts off (the issue's equality
setting); with dropout on, the vectorised run replays each client's own masks.

    python benchmarks/vectorized.py --rounds 4 --reps 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def config(backend: str, vectorize: bool, rounds: int, clients: int, samples: int, dropout: float, algo: str) -> dict:
    return {"name": "vec-bench", "seed": 1, "rounds": rounds,
            "data": {"dataset": "mnist5k", "num_clients": clients, "partition": "iid",
                     "partition_params": {"samples_per_client": samples, "test_per_client": 10}},
            "model": {"arch": "cnn_mnist", "params": {"dropout": dropout, "conv_dropout": dropout}},
            "train": {"local_epochs": 1, "batch_size": 4, "lr": 0.01, "momentum": 0.5},
            "algorithm": {"name": algo, "params": {}},
            "eval": {"every": rounds},
            "backend": {"name": backend, "num_actors": 2, "vectorize": vectorize},
            "output": {"progress": False}}


def one(backend, vectorize, args):
    """Median seconds per round over rounds 1 .. R-2 (the first warms up, the last also evaluates)."""
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    res = run_experiment(make_config(config(backend, vectorize, args.rounds, args.clients, args.samples, args.dropout,
                                            args.algorithm)), write=False, progress=False)
    return statistics.median(res.timing["round_s"][1:-1]), res.table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--backends", nargs="+", default=["sequential", "ray"])
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out = {}
    tables = {}
    for rep in range(args.reps):
        for backend in args.backends:
            for vec in (False, True):
                s, t = one(backend, vec, args)
                out.setdefault((backend, vec), []).append(s)
                tables[(backend, vec)] = t
                print(f"  rep {rep} {backend:10s} vectorize={vec!s:5s} {s:.3f} s/round", flush=True)
    print(f"\n{args.clients} clients x {args.samples} mnist5k images, cnn_mnist (dropout {args.dropout}), batch 4, "
          f"1 epoch, {args.algorithm}, all clients every round; median s/round over {args.reps} reps")
    print("| backend | loop s/round | vectorised s/round | speed-up | max |table diff| |")
    print("|---|---|---|---|---|")
    for backend in args.backends:
        lo, ve = min(out[(backend, False)]), min(out[(backend, True)])
        a, b = tables[(backend, False)], tables[(backend, True)]
        keys = ["round", "client_id", "scope", "metric"]
        m = a.merge(b, on=keys, suffixes=("_l", "_v"))
        diff = float((m["value_l"] - m["value_v"]).abs().max())
        print(f"| {backend} | {lo:.3f} | {ve:.3f} | {lo / ve:.2f}x | {diff:.2e} |")


if __name__ == "__main__":
    main()
