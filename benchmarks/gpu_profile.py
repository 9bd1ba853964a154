"""Where a client's time goes on the device (the H100 sat at ~3.5 % utilisation, ~5 ms per local step of cnn4 at
batch 10: benchmarks/PERFORMANCE.md, "On an H100"). One warm-up run, then one profiled 2-round run of
benchmarks/gpu.py's cnn4 workload (sequential backend) under torch.profiler: the top operators by self CPU time, the
CUDA runtime calls that block the host (synchronisations, pageable copies) with their counts per trained client, and
the rounds' times (``round_s``: client steps and aggregation; ``wall_s`` and ``ms_per_step_wall`` also hold data and
model building and the final evaluation), in both numerics modes (each mode in a fresh process). On a machine without
a GPU the same on the CPU.

    python benchmarks/gpu_profile.py [--clients 200 --cohort 50] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize",
            "cudaMalloc", "cudaFree", "cudaHostAlloc")


def profile(args) -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    import gpu
    from raysim import register_dataset
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    register_dataset("cifar_twin", "benchmarks.gpu:cifar_twin")
    cuda = torch.cuda.is_available()
    backend = {"torch_threads": 1, "device": "cuda" if cuda else "cpu", "numerics": args.numerics,
               "vectorize": args.vectorize}
    cfg = make_config(gpu.config("cnn4", args.clients, args.cohort, 2, None, backend))
    run_experiment(cfg, write=False, progress=False)  # warm-up: CUDA context, cuDNN handles, allocator
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with tprofile(activities=acts) as prof:
        res = run_experiment(cfg, write=False, progress=False)
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    steps = 2 * args.cohort * 5  # 2 rounds x cohort x 5 local steps (50 images, batch 10)
    out = {"numerics": args.numerics, "vectorize": args.vectorize, "device": "cuda" if cuda else "cpu",
           "wall_s": wall, "round_s": res.timing["round_s"], "ms_per_step_wall": 1e3 * wall / steps,
           "top_self_cpu_ms": [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top],
           "blocking_calls_per_client": {e.key: e.count / (2 * args.cohort) for e in ev if e.key in BLOCKING},
           "cuda_kernel_ms": round(sum(getattr(e, "self_device_time_total", 0) for e in ev) / 1e3, 2) if cuda else None}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--numerics", default=None, help="one mode in this process (internal); default: both, each fresh")
    ap.add_argument("--vectorize", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.numerics:
        print(json.dumps(profile(args)), flush=True)
        return
    rows = []
    for mode in ("portable", "native"):
        for vec in ((False, True)):
            env = dict(os.environ, RAYSIM_NUMERICS=mode)
            cmd = [sys.executable, __file__, "--numerics", mode, "--clients", str(args.clients), "--cohort",
                   str(args.cohort)] + (["--vectorize"] if vec else [])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            row = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {
                "numerics": mode, "vectorize": vec, "error": p.stderr[-1500:]}
            rows.append(row)
            print(json.dumps(row, indent=None)[:3000], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
