"""Asynchronous mode at population scale (issue 36, deliverable 6): 100,000 clients, 1,000 in flight, Ray with 2
client actors, against synchronous rounds of 1,000 clients on the same population. FedAvg with cnn_mnist on
fashion_mnist IID with replacement (2 training images and 1 test image per client, as benchmarks/population.py),
the ``mobile-heterogeneous`` environment. Each mode runs in its own process; memory is the peak over the run of the
PSS and RSS summed over the driver and every process it started (benchmarks/population.py's sampler).

Per update: the *training cost* is the clients' measured step seconds (summed over actors) per trained update; the
*engine cost* is the driver's own time per resolved update (event heap, dispatch picks, environment draws, rows),
i.e. the wall time less the time spent waiting in the backend's client and server steps, evaluation and callbacks.

    nice -n 10 python benchmarks/async_scale.py [--clients 100000] [--in-flight 1000] [--modes sync fedbuff fedasync]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def config(mode: str, n: int, k: int, buffer: int, versions: int, rounds: int) -> dict:
    cfg = {"name": f"ascale-{mode}", "seed": 3,
           "data": {"dataset": "fashion_mnist", "num_clients": n, "partition": "iid",
                    "partition_params": {"replace": True, "samples_per_client": 2, "test_per_client": 1}},
           "model": {"arch": "cnn_mnist"}, "algorithm": {"name": "fedavg", "params": {}},
           "train": {"batch_size": 2},
           "env": {"preset": "mobile-heterogeneous"},
           "backend": {"name": "ray", "state_memory_mb": 256, "num_actors": 2}, "output": {"progress": False}}
    if mode == "sync":
        cfg.update(rounds=rounds, clients_per_round=k)
    elif mode == "fedbuff":
        cfg.update(rounds=versions, server={"mode": "async", "rule": "fedbuff", "concurrency": k,
                                            "buffer_size": buffer})
    else:
        cfg.update(rounds=versions, server={"mode": "async", "rule": "fedasync", "concurrency": k, "alpha": 0.6,
                                            "staleness": {"fn": "polynomial", "a": 0.5}})
    cfg["eval"] = {"every": cfg["rounds"], "fraction": min(1.0, 200 / n)}
    return cfg


def one(mode: str, args) -> dict:
    from population import _Sampler

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    if args.max_batch:
        from raysim.engine import async_loop

        async_loop.MAX_BATCH = args.max_batch  # the driver's batching of untrained clients (its default: 16)
    versions = args.fedbuff_versions if mode == "fedbuff" else args.fedasync_versions
    cfg = make_config(config(mode, args.clients, args.in_flight, args.buffer, versions, args.rounds))
    sampler = _Sampler()
    t0 = time.perf_counter()
    res = run_experiment(cfg, write=False)
    total = time.perf_counter() - t0
    sampler.stop()
    df = res.table
    trained = int(((df["scope"] == "client") & (df["metric"] == "up_bytes")).sum())
    out = {"mode": mode, "clients": args.clients, "in_flight": args.in_flight, "total_s": round(total, 1),
           "peak_pss_sum_gb": round(sampler.peak_pss / 2**30, 2), "peak_rss_sum_gb": round(sampler.peak_rss / 2**30, 2)}
    a = res.timing.get("async")
    if a:
        out.update({k: a[k] for k in ("updates", "applied", "dropped", "batches", "in_flight_at_end")})
        trained_total = a["updates"] + a["trained_in_flight_at_end"]
        out["versions"] = cfg.rounds
        out["trained_updates"] = trained_total
        out["train_s_per_update_ms"] = round(1e3 * a["train_s"] / max(trained_total, 1), 2)
        out["engine_s_per_update_ms"] = round(1e3 * a["engine_s"] / max(a["updates"], 1), 3)
        out["client_step_wall_s"] = round(a["client_step_s"], 1)
        out["server_step_wall_s"] = round(a["server_step_s"], 1)
        out["server_step_ms_per_version"] = round(1e3 * a["server_step_s"] / cfg.rounds, 1)
        out["wall_s_per_update_ms"] = round(1e3 * a["wall_s"] / max(a["updates"], 1), 2)
        out["max_batch"] = args.max_batch or 16
    else:
        out["rounds"] = cfg.rounds
        out["trained_updates"] = trained
        out["median_round_s"] = round(sorted(res.timing["round_s"])[len(res.timing["round_s"]) // 2], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--in-flight", type=int, default=1000)
    ap.add_argument("--buffer", type=int, default=100)
    ap.add_argument("--fedbuff-versions", type=int, default=5)
    ap.add_argument("--fedasync-versions", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=1, help="synchronous rounds of --in-flight clients")
    ap.add_argument("--modes", nargs="+", default=["sync", "fedbuff", "fedasync"])
    ap.add_argument("--max-batch", type=int, default=None, help="clients per client step (async_loop.MAX_BATCH, default 16)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)), flush=True)
        return
    passed = [a for a in sys.argv[1:]]
    for mode in args.modes:
        p = subprocess.run([sys.executable, __file__, *passed, "--one", mode], capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{mode} failed")
        print(p.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
