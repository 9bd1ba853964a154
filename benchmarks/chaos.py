"""Chaos run (issue "Fault tolerance"): a Ray run during which a random client actor is killed (``ray.kill``) in the
middle of a round every few rounds, on a seeded schedule; the run must complete with the table of an undisturbed
run (on_actor_failure: retry). Prints whether the tables are identical and what the retries cost.

    python benchmarks/chaos.py [--rounds 30] [--every 4] [--seed 0] [--config configs/fedproto_mnist5k.yaml]
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import pandas as pd
import ray

from raysim.config import load_config
from raysim.engine.callbacks import Callback
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing


class Chaos(Callback):
    """After round r ends, for the rounds of the schedule, start a timer that kills a random client actor part-way
    into round r+1 (while its client step runs)."""

    def __init__(self, rounds: int, every: int, seed: int, delay_s: tuple):
        rng = np.random.default_rng(seed)
        starts = list(range(every - 1, rounds - 1, every))
        self.plan = {r: (float(rng.uniform(*delay_s)), int(rng.integers(0, 1 << 30))) for r in starts}
        self.kills = []

    def on_round_end(self, run, round_idx, evaluated):
        if round_idx in self.plan:
            delay, pick = self.plan[round_idx]
            actors = run.backend.actors

            def kill():
                k = pick % len(actors)
                ray.kill(actors[k])
                self.kills.append({"after_round": round_idx, "actor": k, "delay_s": round(delay, 3)})

            threading.Timer(delay, kill).start()
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/fedproto_mnist5k.yaml")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ov = [f"rounds={args.rounds}", "eval.every=5", "backend.name=ray", "backend.num_actors=2"]
    cfg = load_config(args.config, ov)
    t0 = time.perf_counter()
    quiet = run_experiment(cfg, progress=False, write=False)
    t_quiet = time.perf_counter() - t0
    chaos = Chaos(args.rounds, args.every, args.seed, (0.05, 0.35))
    t0 = time.perf_counter()
    noisy = run_experiment(cfg, progress=False, write=False, callbacks=[chaos])
    t_noisy = time.perf_counter() - t0
    same = without_timing(quiet.table).equals(without_timing(noisy.table))  # wall-time rows differ run to run
    try:
        pd.testing.assert_frame_equal(without_timing(quiet.table), without_timing(noisy.table))
    except AssertionError as e:
        print("tables differ:", str(e)[:400])
    fails = noisy.metadata["actor_failures"]
    print(f"setting: {cfg.name}, {args.rounds} rounds, Ray backend with 2 client actors; kills planned after rounds "
          f"{sorted(chaos.plan)} (seed {args.seed}), each 0.05-0.35 s into the next round")
    print(f"kills done: {len(chaos.kills)} {chaos.kills}")
    print(f"actor deaths seen by the engine: {len(fails)}; actions: {[f['action'] + ' @ ' + f['where'] for f in fails]}")
    print(f"tables identical: {same}")
    print(f"wall time: undisturbed {t_quiet:.1f} s, with kills {t_noisy:.1f} s (+{t_noisy - t_quiet:.1f} s, "
          f"{(t_noisy - t_quiet) / max(len(fails), 1):.1f} s per retried actor); final test_acc "
          f"{noisy.final()[0]:.4f} vs {quiet.final()[0]:.4f}")


if __name__ == "__main__":
    main()
