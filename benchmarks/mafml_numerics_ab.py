"""Where portable numerics' tax on MAFML comes from (issue 48), measured in one portable process, interleaved: MAFML's
plain loop (benchmarks/multi_exchange.py: 4 LeNet nodes, Adam, batch 32; ms per iteration) under kernel choices that
can be switched inside a process, one iteration block after another:

* ``sqrt``: aten::sqrt's CPU kernel — ``ieee`` (raysim.numerics.ieee_sqrt, what portable registers), ``corrected``
  (the 28-kernel float32 path it replaced, ``numerics._ieee_sqrt_corrected``: the same bits) or ``vml`` (torch's own,
  oneMKL VML: the registration dropped; vendor-dependent bits, for the cost only);
* ``mkldnn``: off (portable: ATen's unfold + GEMM convolutions) or on (oneDNN, native).

The rest of portable mode (ATen's AVX2 kernels, MKL's cross-vendor GEMM branch) is fixed when a process starts: the
whole native / portable ratio comes from fresh processes, alternated (``--processes``). CPU time of this process
(``time.process_time``) and wall time, median over the blocks.

    PYTHONPATH=$PWD python benchmarks/mafml_numerics_ab.py [--blocks 6 --iterations 10] [--processes 2 [--decompose]]
        [--raysim-pairs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def set_sqrt(kind: str) -> None:
    """aten::sqrt's CPU kernel in this process: ``ieee``, ``corrected`` or ``vml`` (module docstring)."""
    import torch

    from raysim import numerics

    if numerics._sqrt_library is not None:
        numerics._sqrt_library._destroy()
        numerics._sqrt_library = None
    if kind == "vml":
        return
    fn = numerics.ieee_sqrt if kind == "ieee" else numerics._ieee_sqrt_corrected
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("sqrt", fn, "CPU")
        lib.impl("sqrt.out", lambda x, *, out: out.copy_(fn(x)), "CPU")
        lib.impl("sqrt_", lambda x: x.copy_(fn(x)), "CPU")
    numerics._sqrt_library = lib


def blocks(variants: dict, n_blocks: int, iterations: int, prep) -> dict:
    """{variant: (median CPU ms / iteration, median wall ms / iteration)}, the variants' blocks interleaved."""
    import torch

    from multi_exchange import plain_loop

    cpu = {k: [] for k in variants}
    wall = {k: [] for k in variants}
    for b in range(n_blocks + 1):
        for name, (sqrt, mkldnn) in variants.items():
            set_sqrt(sqrt)
            torch.backends.mkldnn.enabled = mkldnn
            c0, t0 = time.process_time(), time.perf_counter()
            plain_loop(prep, iterations, 0)
            c, t = time.process_time() - c0, time.perf_counter() - t0
            if b:  # the first block warms every variant up
                cpu[name].append(1e3 * c / iterations)
                wall[name].append(1e3 * t / iterations)
    set_sqrt("ieee")
    torch.backends.mkldnn.enabled = False
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in variants}


CHILD = r"""
import json, sys, time
sys.path.insert(0, "benchmarks")
import raysim, torch
from raysim import numerics
from raysim.config import make_config
from raysim.engine.prepare import prepare
from multi_exchange import config, plain_loop
torch.set_num_threads(1)
numerics.enter(sys.argv[1])
prep = prepare(make_config(config(1, "sequential", 1)))
plain_loop(prep, 3, 0)
c0 = time.process_time(); plain_loop(prep, int(sys.argv[2]), 0)
print(json.dumps({"cpu_ms": 1e3 * (time.process_time() - c0) / int(sys.argv[2]),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


# native processes with one of portable's process-wide settings of their own (the user's environment, which native
# mode leaves as it is): what each costs alone
SETTINGS = {"native": {}, "native + MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
            "native + ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "portable": {}}


def process(mode: str, iterations: int, extra: Optional[dict] = None) -> dict:
    from raysim import numerics

    numerics.unpin()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYSIM_NUMERICS")}
    env.update(PYTHONPATH=str(ROOT), RAYSIM_NUMERICS=mode, **(extra or {}))
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(iterations)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def raysim_pairs(pairs: int) -> None:
    """raysim's MAFML run (multi_exchange.py's config, 2 rounds) under the corrected and the ieee sqrt, interleaved in
    one portable process: CPU seconds of whole runs and their ratio per pair."""
    import torch

    from raysim import numerics
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment
    from multi_exchange import config

    torch.set_num_threads(1)
    numerics.enter("portable")
    cfg = make_config(config(2, "sequential", 1))
    run_experiment(cfg, write=False, progress=False)  # warm-up
    cpu = {"corrected": [], "ieee": []}
    for _ in range(pairs):
        for kind in cpu:
            set_sqrt(kind)
            c0 = time.process_time()
            run_experiment(cfg, write=False, progress=False)
            cpu[kind].append(time.process_time() - c0)
    set_sqrt("ieee")
    ratios = [a / b for a, b in zip(cpu["ieee"], cpu["corrected"])]
    print(json.dumps({"raysim_mafml_cpu_s": cpu}))
    print(f"raysim MAFML run, ieee / corrected sqrt (CPU): median {statistics.median(ratios):.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--processes", type=int, default=0, help="native / portable pairs of fresh processes (0: none)")
    ap.add_argument("--raysim-pairs", type=int, default=0, help="also raysim's MAFML run (sequential, 2 rounds of 50 "
                                                                 "iterations) with the corrected and the ieee sqrt, "
                                                                 "this many interleaved pairs (CPU time)")
    ap.add_argument("--decompose", action="store_true", help="with --processes: also native processes with MKL_CBWR "
                                                              "or ATEN_CPU_CAPABILITY set as portable sets them")
    args = ap.parse_args()
    if args.processes:
        names = list(SETTINGS) if args.decompose else ["native", "portable"]
        times = {n: [] for n in names}
        for _ in range(args.processes):
            for name in names:
                mode = "portable" if name == "portable" else "native"
                times[name].append(process(mode, args.iterations, SETTINGS[name])["cpu_ms"])
        med = {m: statistics.median(v) for m, v in times.items()}
        print(json.dumps({"processes": times}))
        for name in names:
            print(f"plain MAFML loop, fresh processes: {name:36s} {med[name]:6.1f} ms CPU per iteration "
                  f"({med[name] / med['native']:.3f}x native)", flush=True)
    if args.raysim_pairs:
        raysim_pairs(args.raysim_pairs)
    if not args.blocks:
        return
    import torch

    from raysim import numerics
    from raysim.config import make_config
    from raysim.engine.prepare import prepare
    from multi_exchange import config

    torch.set_num_threads(1)
    numerics.enter("portable")
    prep = prepare(make_config(config(1, "sequential", 1)))
    variants = {"portable (ieee sqrt)": ("ieee", False), "portable, corrected sqrt (before)": ("corrected", False),
                "portable, VML sqrt": ("vml", False), "portable, VML sqrt, oneDNN": ("vml", True)}
    res = blocks(variants, args.blocks, args.iterations, prep)
    base = res["portable (ieee sqrt)"][0]
    for name, (c, w) in res.items():
        print(f"{name:36s} CPU {c:6.1f} ms / iteration ({c / base:.3f}x), wall {w:6.1f}", flush=True)


if __name__ == "__main__":
    main()
