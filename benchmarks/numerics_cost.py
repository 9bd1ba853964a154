"""What portable numerics costs (issue "Same table on any machine"): seconds per round of portable against native
kernels, each in a fresh process (a process keeps one numerics mode), alternated so both see the same machine load.

Workloads: the quick start (configs/fedproto_mnist5k.yaml: FedProto, cnn_mnist, 20 clients; sequential backend, 1
torch thread) and the vectorised benchmark's setting (benchmarks/vectorized.py: 100 clients x 40 MNIST-5k images,
cnn_mnist, batch 4, FedAvg, ``backend.vectorize: true``, sequential). Reported: median s/round over the rounds after
the first, per mode, and the ratio portable / native.

    python benchmarks/numerics_cost.py --rounds 6 --reps 2 [--json out.json]
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
work, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
if work == "quickstart":
    cfg = raysim.load_config("configs/fedproto_mnist5k.yaml", [f"rounds={rounds}", "backend.name=sequential",
                             "output.progress=false", f"backend.numerics={mode}", f"eval.every={rounds}"])
else:
    from benchmarks.vectorized import config
    d = config("sequential", True, rounds, 100, 40, 0.5, "fedavg")
    d["backend"]["numerics"] = mode
    cfg = raysim.make_config(d)
res = run_experiment(cfg, write=False)
t = res.table
s = t[(t["metric"] == ROUND_TIME)].sort_values("round")["value"].tolist()[1:-1]
print(json.dumps({"s_round": statistics.median(s), "capability": res.metadata["numerics"]["cpu_capability"]}))
"""


def one(work: str, mode: str, rounds: int) -> dict:
    from raysim import numerics

    numerics.unpin()  # this process's pins (import raysim) must not reach the child as if they were the machine's
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYSIM_NUMERICS")}
    env.update(PYTHONPATH=str(ROOT), RAYSIM_NUMERICS=mode)
    p = subprocess.run([sys.executable, "-c", CHILD, work, mode, str(rounds)], cwd=ROOT, env=env,
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
    args = ap.parse_args()
    from raysim.numerics import cpu_model

    out = {"cpu": cpu_model(), "rounds": args.rounds, "reps": args.reps, "results": {}}
    for work in args.work:
        times = {"portable": [], "native": []}
        caps = {}
        for _ in range(args.reps):
            for mode in ("native", "portable"):
                r = one(work, mode, args.rounds)
                times[mode].append(r["s_round"])
                caps[mode] = r["capability"]
        med = {m: statistics.median(v) for m, v in times.items()}
        out["results"][work] = {"s_round": times, "median": med, "capability": caps,
                                "portable_over_native": med["portable"] / med["native"]}
        print(f"{work}: native {med['native']:.3f} s/round ({caps['native']}), portable {med['portable']:.3f} "
              f"({caps['portable']}): ratio {med['portable'] / med['native']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
