"""Engine v2 figures: bytes per client in the state store, and the round time with every client state spilled to
disk (backend.state_memory_mb: 0) against the default in-memory store, on the FedProto quick-start config.

    python benchmarks/engine_v2.py [--rounds 6] [--reps 2] [--config configs/fedproto_mnist5k.yaml]

Variants are interleaved (A B A B ...) so that background load hits both alike; the first round of each run is a
warm-up and the last (which evaluates every client) is excluded, as in benchmarks/overhead.py.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from raysim.config import ArchSpec, load_config
from raysim.engine.loop import run_experiment
from raysim.models import build_model
from raysim.runner.store import state_nbytes
from raysim.training import clone_state


def timed(config, rounds, backend, mem, state_dir):
    ov = [f"rounds={rounds}", f"eval.every={rounds}", f"backend.name={backend}", "backend.num_actors=2",
          f"backend.state_memory_mb={mem}", f"backend.state_dir={state_dir}"]
    res = run_experiment(load_config(config, ov), progress=False, write=False)
    return res.timing["round_s"][1:-1], res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/fedproto_mnist5k.yaml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backends", default="sequential,ray")
    args = ap.parse_args()
    cfg = load_config(args.config)
    m = build_model(ArchSpec(cfg.model.arch, dict(cfg.model.params)), (1, 28, 28), 10)
    n_params = sum(p.numel() for p in m.parameters())
    print(f"store bytes per client, {cfg.model.arch} {dict(cfg.model.params)}: {state_nbytes({'model': clone_state(m)}):,} "
          f"({n_params:,} float32 parameters; x2 with train.persist_optimizer and SGD momentum)")
    for backend in args.backends.split(","):
        times = {"default (1024 MB)": [], "state_memory_mb=0": []}
        for _ in range(args.reps):
            for label, mem in (("default (1024 MB)", 1024), ("state_memory_mb=0", 0)):
                with tempfile.TemporaryDirectory() as d:
                    t, res = timed(args.config, args.rounds + 2, backend, mem, d)
                times[label] += t
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"[{backend}] median s/round over {len(times['default (1024 MB)'])} timed rounds: "
              + ", ".join(f"{k}: {v:.3f}" for k, v in med.items())
              + f"; ratio spill/default = {med['state_memory_mb=0'] / med['default (1024 MB)']:.3f}")


if __name__ == "__main__":
    main()
