"""Population scale: round time and peak memory for 1k, 10k and 100k personalised clients (FedPer with cnn_mnist,
10 clients per round, fashion_mnist IID with replacement: 2 training images and 1 test image per client), on the
sequential backend or on Ray with 2 client actors (``--backend ray``), one process per population size. Memory is the
peak over the run of the PSS and RSS summed over the driver and every process it started (Ray's raylet, GCS, workers,
actors), sampled every 0.2 s from /proc. Client states are created lazily (on first selection), kept under
backend.state_memory_mb, and client data stays uint8; evaluation samples eval.fraction of the clients.

    python benchmarks/population.py [--sizes 1000,10000,100000] [--rounds 40] [--backend sequential|ray]
                                    [--malloc-mmap-threshold 1000000000]

``--malloc-mmap-threshold`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for each size's process (a diagnostic: before
clients were built compact it hid the heap fragmentation that slowed 100k-client rounds; benchmarks/PERFORMANCE.md).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's raysim, run from anywhere


def _tree_memory(root: int, skip: int = -1) -> tuple[int, int]:
    """(PSS, RSS) in bytes summed over ``root`` and all its descendants (Ray's processes are the driver's), less the
    process ``skip`` (the sampler)."""
    children: dict = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    pss = rss = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid == skip:
            continue
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return pss, rss


def _sample(root: int) -> None:
    """The sampler process (``--sample ROOT``): polls the tree's memory every 0.2 s, leaving itself out, until a line
    arrives on stdin; then prints the peaks. A separate process, so polling /proc takes nothing from the measured
    process's interpreter (a thread there would hold its GIL while parsing)."""
    import select

    peak_pss = peak_rss = 0
    me = os.getpid()
    while True:
        pss, rss = _tree_memory(root, skip=me)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        if select.select([sys.stdin], [], [], 0.2)[0]:
            break
    print(json.dumps([peak_pss, peak_rss]), flush=True)


class _Sampler:
    def __init__(self):
        self._p = subprocess.Popen([sys.executable, __file__, "--sample", str(os.getpid())], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)

    def stop(self):
        out, _ = self._p.communicate("stop\n")
        self.peak_pss, self.peak_rss = json.loads(out.strip().splitlines()[-1])


def one(n: int, rounds: int, backend: str = "sequential") -> dict:
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    cfg = make_config({
        "name": f"pop{n}", "seed": 3, "rounds": rounds, "clients_per_round": 10,
        "data": {"dataset": "fashion_mnist", "num_clients": n, "partition": "iid",
                 "partition_params": {"replace": True, "samples_per_client": 2, "test_per_client": 1}},
        "model": {"arch": "cnn_mnist"}, "algorithm": {"name": "fedper", "params": {}},
        "eval": {"every": rounds, "fraction": min(1.0, 200 / n)},
        "backend": {"name": backend, "state_memory_mb": 256, "num_actors": 2}, "output": {"progress": False}})
    sampler = _Sampler()
    t0 = time.perf_counter()
    res = run_experiment(cfg, write=False)
    total = time.perf_counter() - t0
    sampler.stop()
    train_rounds = res.timing["round_s"][1:-1]  # not the first (warm-up) nor the last (evaluation)
    return {"clients": n, "median_round_s": statistics.median(train_rounds), "total_s": round(total, 1),
            "setup_and_data_s": round(total - sum(res.timing["round_s"]), 1),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "backend": backend,
            "peak_pss_sum_gb": sampler.peak_pss / 2**30, "peak_rss_sum_gb": sampler.peak_rss / 2**30,
            "evaluated": int((res.table["metric"] == "test_acc").sum())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--one", type=int, default=None)
    ap.add_argument("--sample", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=["sequential", "ray"], default="sequential")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None,
                    help="run each size with glibc's MALLOC_MMAP_THRESHOLD_ set (bytes; e.g. 1000000000)")
    args = ap.parse_args()
    if args.sample:
        _sample(args.sample)
        return
    if args.one:
        print(json.dumps(one(args.one, args.rounds, args.backend)))
        return
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        env = dict(os.environ)
        if args.malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        p = subprocess.run([sys.executable, __file__, "--one", str(n), "--rounds", str(args.rounds),
                            "--backend", args.backend],
                           capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    base = rows[0]["median_round_s"]
    for r in rows:
        print(f"{r['clients']:>7} clients: {r['median_round_s']:.3f} s/round ({r['median_round_s'] / base:.2f}x the "
              f"smallest), setup + data {r['setup_and_data_s']} s, peak over all processes PSS "
              f"{r['peak_pss_sum_gb']:.2f} GB, RSS {r['peak_rss_sum_gb']:.2f} GB ({r['backend']}), "
              f"{r['evaluated']} clients evaluated")


if __name__ == "__main__":
    main()
