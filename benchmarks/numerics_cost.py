"""What portable numerics costs (issue "Same table on any machine"): seconds per round of portable against native
kernels, each in a fresh process (a process keeps one numerics mode), alternated so both see the same machine load.

Workloads: the quick start (configs/fedproto_mnist5k.yaml: FedProto, cnn_mnist, 20 clients; sequential backend, 1
torch thread) and the vectorised benchmark's setting (benchmarks/vectorized.py: 100 clients x 40 MNIST-5k images,
cnn_mnist, batch 4, FedAvg, ``backend.vectorize: true``, sequential). Reported: median s/round over the rounds after
the first, per mode, and the ratio portable / native. ``--plain``: also the plain 2-process PyTorch loop
(benchmarks/peers/run.py's, native kernels as a user's own script runs) on the vectorised benchmark's workload,
interleaved, and how many times faster the vectorised benchmark is (issue 48 item 4's target: >= 2.5x with 2 threads).

    python benchmarks/numerics_cost.py --rounds 6 --reps 2 [--json out.json]
    python benchmarks/numerics_cost.py --work vectorized --threads 2 --plain --rounds 6 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, statistics, sys
import raysim
from raysim.engine.loop import run_experiment
from raysim.io.results import ROUND_TIME
work, mode, rounds, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if work == "plain2":  # peers/run.py's plain PyTorch loop, 2 worker processes, workload (b) = the vectorised benchmark's
    import benchmarks.peers.run as pr
    base = pr.config
    pr.config = lambda *a, **k: {**base(*a, **k), "backend": {**base(*a, **k)["backend"], "numerics": mode}}
    s = pr.plain(pr.WORKLOADS["b"], rounds, 2)[1:]
    import torch
    print(json.dumps({"s_round": statistics.median(s), "capability": torch.backends.cpu.get_cpu_capability()}))
    sys.exit(0)
if work == "quickstart":
    cfg = raysim.load_config("configs/fedproto_mnist5k.yaml", [f"rounds={rounds}", "backend.name=sequential",
                             "output.progress=false", f"backend.numerics={mode}", f"eval.every={rounds}"])
else:
    from benchmarks.vectorized import config
    d = config("sequential", True, rounds, 100, 40, 0.5, "fedavg")
    d["backend"]["numerics"] = mode
    d["backend"]["torch_threads"] = threads
    cfg = raysim.make_config(d)
res = run_experiment(cfg, write=False)
t = res.table
s = t[(t["metric"] == ROUND_TIME)].sort_values("round")["value"].tolist()[1:-1]
print(json.dumps({"s_round": statistics.median(s), "capability": res.metadata["numerics"]["cpu_capability"]}))
"""


def one(work: str, mode: str, rounds: int, threads: int = 1) -> dict:
    from raysim import numerics

    numerics.unpin()  # this process's pins (import raysim) must not reach the child as if they were the machine's
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYSIM_NUMERICS")}
    env.update(PYTHONPATH=str(ROOT), RAYSIM_NUMERICS=mode)
    p = subprocess.run([sys.executable, "-c", CHILD, work, mode, str(rounds), str(threads)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", nargs="+", default=["quickstart", "vectorized"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the vectorised benchmark")
    ap.add_argument("--plain", action="store_true", help="also the plain 2-process PyTorch loop (native kernels, a "
                                                          "user's own script) on the vectorised benchmark's workload")
    args = ap.parse_args()
    from raysim.numerics import cpu_model

    out = {"cpu": cpu_model(), "rounds": args.rounds, "reps": args.reps, "results": {}}
    plain = []
    for work in args.work:
        times = {"portable": [], "native": []}
        caps = {}
        for _ in range(args.reps):
            for mode in ("native", "portable"):
                r = one(work, mode, args.rounds, args.threads if work == "vectorized" else 1)
                times[mode].append(r["s_round"])
                caps[mode] = r["capability"]
            if args.plain and work == "vectorized":  # interleaved with the raysim runs: the same machine state
                plain.append(one("plain2", "native", args.rounds)["s_round"])
        med = {m: statistics.median(v) for m, v in times.items()}
        out["results"][work] = {"s_round": times, "median": med, "capability": caps,
                                "portable_over_native": med["portable"] / med["native"]}
        print(f"{work}: native {med['native']:.3f} s/round ({caps['native']}), portable {med['portable']:.3f} "
              f"({caps['portable']}): ratio {med['portable'] / med['native']:.2f}", flush=True)
        if plain and work == "vectorized":
            pm = statistics.median(plain)
            out["results"]["plain2"] = {"s_round": plain, "median": pm}
            print(f"  plain 2-process loop (native) {pm:.3f} s/round: the vectorised benchmark ({args.threads} "
                  f"thread(s)) is {pm / med['portable']:.2f}x faster portable, {pm / med['native']:.2f}x native",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
