"""Cost-aware placement (issue 12 item 3): round time with the fixed layout (client i on actor i % n,
``backend.balance: static``) against cost-aware placement (``backend.balance: cost``) and against the ideal
(max(total client work / actors, the largest client)), on a Dirichlet(0.1) split with the mixed model zoo.

    python benchmarks/placement.py [--rounds 6] [--actors 2]

Workload: FedProto (per-client models move with their clients), mnist5k, 20 clients, Dirichlet(0.1) over the whole
training pool (client sizes vary ~100x), the 1x28x28 zoo cycled over clients (cnn_mnist, cnn4, resnet_small,
mobilenet_small; 21k-106k parameters), batch 10, one local epoch, Ray with 2 actors x 1 CPU, 1 torch thread.
Reported: the median round time over rounds 2.. (round 1 warms up) for both layouts; the ideal per round from the
per-client step seconds measured in the same run; the ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ZOO = [{"arch": "cnn_mnist", "params": {"out_channels": 20, "embed_dim": 50, "dropout": 0.0}},
       {"arch": "cnn4", "params": {"channels": 16, "hidden": 128, "embed_dim": 50}},
       {"arch": "resnet_small", "params": {"width": 8, "embed_dim": 50}},
       {"arch": "mobilenet_small", "params": {"width": 8, "embed_dim": 50}}]


def config(balance: str, rounds: int, actors: int) -> dict:
    return {"name": "placement", "seed": 1, "rounds": rounds,
            "data": {"dataset": "mnist5k", "num_clients": 20, "partition": "dirichlet",
                     "partition_params": {"alpha": 0.1, "min_samples": 20, "test_ratio": 0.1}},
            "model": {"assign": "cycle", "per_client": ZOO},
            "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.01},
            "algorithm": {"name": "fedproto", "params": {"lam": 1.0}},
            "eval": {"every": rounds},
            "backend": {"name": "ray", "num_actors": actors, "num_cpus": 1, "balance": balance},
            "output": {"progress": False}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--actors", type=int, default=2)
    args = ap.parse_args(argv)
    import ray
    from raysim.config import make_config
    from raysim.engine.prepare import prepare
    from raysim.engine.loop import run_experiment

    prep = prepare(make_config(config("static", args.rounds, args.actors)))
    sizes = [int(c.y_train.numel()) for c in prep.fed_data.clients]
    print(f"client training sizes: min {min(sizes)}, median {int(statistics.median(sizes))}, max {max(sizes)}; "
          f"total {sum(sizes)}")
    ray.init(num_cpus=args.actors, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    out = {}
    try:
        for balance in ("static", "cost"):
            res = run_experiment(make_config(config(balance, args.rounds, args.actors)), write=False, progress=False)
            out[balance] = res
    finally:
        ray.shutdown()
    static = statistics.median(out["static"].timing["round_s"][1:-1])
    cost = statistics.median(out["cost"].timing["round_s"][1:-1])
    log = out["cost"].timing["balance"]
    ideal = statistics.median(e["ideal_s"] for e in log[1:-1])
    work = statistics.median(sum(e["measured_loads"]) for e in log[1:-1])
    busiest = statistics.median(max(e["measured_loads"]) for e in log[1:-1])  # the placement's own makespan
    print("| layout | s/round | x ideal |\n|---|---|---|")
    print(f"| static (i % {args.actors}) | {static:.3f} | {static / ideal:.2f} |")
    print(f"| cost-aware | {cost:.3f} | {cost / ideal:.2f} |")
    print(f"| ideal (max(work / {args.actors}, largest client)) | {ideal:.3f} | 1.00 |")
    print(f"busiest actor's client work (cost-aware) {busiest:.3f} s = {busiest / ideal:.2f} x ideal: the rest of the "
          f"round ({cost - busiest:.3f} s) is the server step, payload and report traffic and driver work")
    print(f"total client work per round {work:.3f} s; moves per round: {[e['moves'] for e in log]}")
    print("per-actor measured loads (cost-aware):", [[round(x, 3) for x in e["measured_loads"]] for e in log])
    from raysim.io.results import without_timing

    same = without_timing(out["static"].table).equals(without_timing(out["cost"].table))  # same run_id
    print(f"result tables identical: {same}")


if __name__ == "__main__":
    main()
