"""Synchronous rounds vs FedBuff vs FedAsync (issue 36, deliverable 5): FedAvg and FedProto on Fashion-MNIST under
the ``mobile-heterogeneous`` environment preset, several seeds, paired intervals (raysim/app/verdicts.py).

Every run trains about the same number of client updates: sync runs ``--rounds`` rounds of ``--k`` clients; FedBuff
runs with ``--k`` clients in flight and a buffer of ``--buffer`` (rounds * k / buffer versions); FedAsync with ``--k``
in flight applies each update (rounds * k versions). Reported per method and mode: the simulated time (seconds) at
which the mean local test accuracy first reaches ``--target``, the final mean local test accuracy, the simulated
time at the end, and the traffic (bytes up + down, all clients); then each async mode minus sync, paired by seed
(mean, 95 % Student-t interval). Writes the run directories, ``summary-<methods>-<target>.md/.json`` and ``raysim report``'s tables and
plots (accuracy against simulated time, sync and async side by side) under ``--out``. Run directories that already
hold a ``results.parquet`` are read instead of run again (another ``--target`` on the same runs).

    nice -n 10 python benchmarks/async_compare.py --seeds 1 2 3 --out runs/async_compare
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from raysim.config import make_config
from raysim.engine.loop import run_experiment
from raysim.io import results
from raysim.app.verdicts import format_interval, interval


def base(args, method: str, seed: int) -> dict:
    params = {"lam": 1.0} if method == "fedproto" else {}
    return {
        "name": f"async-{method}", "seed": seed, "rounds": args.rounds,
        "data": {"dataset": "fashion_mnist", "num_clients": args.clients, "partition": "dirichlet",
                 "partition_params": {"alpha": 0.5, "samples_per_client": args.samples, "min_samples": 20,
                                      "test_ratio": 0.3333}},
        "model": {"arch": "cnn_mnist", "params": {"out_channels": 10, "embed_dim": 32, "dropout": 0.0}},
        "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.02, "momentum": 0.5},
        "algorithm": {"name": method, "params": params},
        "env": {"preset": "mobile-heterogeneous"},
        "backend": {"name": "sequential", "torch_threads": 1},
        "output": {"progress": False},
    }


def mode_config(args, method: str, mode: str, seed: int) -> dict:
    cfg = base(args, method, seed)
    evals = args.evals
    if mode == "sync":
        cfg.update(clients_per_round=args.k, rounds=args.rounds, eval={"every": max(1, args.rounds // evals)})
        return cfg
    if mode == "fedbuff":
        versions = args.rounds * args.k // args.buffer
        server = {"mode": "async", "rule": "fedbuff", "concurrency": args.k, "buffer_size": args.buffer,
                  "server_lr": 1.0}
    else:
        versions = args.rounds * args.k
        server = {"mode": "async", "rule": "fedasync", "concurrency": args.k, "alpha": args.alpha,
                  "staleness": {"fn": "polynomial", "a": 0.5}}
    cfg.update(rounds=versions, server=server, eval={"every": max(1, versions // evals)})
    return cfg


def measure(df, target: float) -> dict:
    avt = results.accuracy_vs_sim_time(df)
    hit = avt[avt["mean"] >= target].sort_values("round")
    comm = results.communication(df)
    traffic = float(comm[comm["metric"].isin(["up_bytes", "down_bytes"])]["total"].sum())
    last = avt.sort_values("round").iloc[-1]
    return {"time_to_target": float(hit["sim_time"].iloc[0]) if len(hit) else math.nan,
            "final_acc": float(last["mean"]), "sim_time_end": float(last["sim_time"]), "traffic_mb": traffic / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedproto"])
    ap.add_argument("--modes", nargs="+", default=["sync", "fedbuff", "fedasync"])
    ap.add_argument("--clients", type=int, default=60)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--buffer", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--evals", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--out", default="runs/async_compare")
    args = ap.parse_args()
    out = Path(args.out)
    values: dict = {}  # (method, mode) -> seed -> measures
    dirs = []
    t_all = time.perf_counter()
    for method in args.methods:
        for mode in args.modes:
            for seed in args.seeds:
                d = out / f"{method}-{mode}-s{seed}"
                t0 = time.perf_counter()
                if (d / "results.parquet").is_file():  # a finished run of an earlier invocation: re-read it
                    table = results.load(d)
                else:
                    table = run_experiment(make_config(mode_config(args, method, mode, seed)), out_dir=d,
                                           progress=False).table
                m = measure(table, args.target)
                m["wall_s"] = time.perf_counter() - t0
                values.setdefault((method, mode), {})[seed] = m
                dirs.append(str(d))
                print(f"{method:9s} {mode:8s} seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()),
                      flush=True)
    keys = ("time_to_target", "final_acc", "sim_time_end", "traffic_mb")
    lines = [f"| method | mode | sim. time to {args.target:.2f} (s) | final acc | sim. time at end (s) | traffic (MB) |",
             "|---|---|---|---|---|---|"]
    for (method, mode), per_seed in values.items():
        cells = []
        for k in keys:
            xs = [per_seed[s][k] for s in args.seeds]
            fin = [x for x in xs if math.isfinite(x)]
            iv = interval(fin) if fin else {"mean": math.nan}
            cell = format_interval(iv, digits=3 if k == "final_acc" else (2 if k == "traffic_mb" else 1)).lstrip("+")
            if len(fin) < len(xs):
                cell += f" ({len(xs) - len(fin)} of {len(xs)} never)"
            cells.append(cell)
        lines.append(f"| {method} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "paired by seed, async minus sync (mean ± 95 % half-width [interval]):", "",
              "| method | mode | Δ time to target (s) | Δ final acc | Δ sim. time at end (s) | Δ traffic (MB) |",
              "|---|---|---|---|---|---|"]
    for method in args.methods:
        for mode in [m for m in args.modes if m != "sync"]:
            cells = []
            for k in keys:
                d = [values[(method, mode)][s][k] - values[(method, "sync")][s][k] for s in args.seeds]
                d = [x for x in d if math.isfinite(x)]
                cell = format_interval(interval(d), digits=3 if k == "final_acc" else (2 if k == "traffic_mb" else 1)) if d else "–"
                cells.append(cell + (f" (n={len(d)})" if d and len(d) < len(args.seeds) else ""))
            lines.append(f"| {method} | {mode} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\nwall time of the whole comparison: {time.perf_counter() - t_all:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{'-'.join(args.methods)}-{args.target:g}"
    (out / f"summary-{tag}.md").write_text(table + "\n")
    (out / f"summary-{tag}.json").write_text(json.dumps({f"{m}/{mo}": v for (m, mo), v in values.items()}, indent=1,
                                                 default=float))
    from raysim.app.summary import ReportOptions, build_report

    # each method is judged against itself (async vs sync); the plots put FedAvg's global test_acc beside FedProto's
    # personalised one knowingly (the report says so; issue 52)
    build_report(dirs, out / f"report-{tag}", ReportOptions(target=args.target, mixed_metrics=True))
    print(f"report: {out / f'report-{tag}'}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
