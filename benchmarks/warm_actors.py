"""Cold vs warm Ray actors (issue "Performance II"): a tiny run (tests/conftest.py's tiny config, 3 rounds) on Ray
four times in one Ray session (declared as the test session declares it: 2 CPUs, 2 fake GPUs), with
``keep_actors_warm`` on (``--warm``) or off; prints each run's wall time and ``backend.start`` time, and checks that
the tables equal the sequential one.

    PYTHONPATH=$PWD python benchmarks/warm_actors.py [--warm]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pandas as pd  # noqa: E402
import ray  # noqa: E402

from raysim.config import make_config  # noqa: E402
from raysim.engine.loop import run_experiment  # noqa: E402
from raysim.io.results import without_timing  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    print(f"ray.init {time.perf_counter() - t0:.2f} s", flush=True)
    if args.warm:
        from raysim.backends.ray_actors import keep_actors_warm

        keep_actors_warm(True)
    for i, (algo, actors) in enumerate([("fedavg", 2), ("fedavg", 2), ("fedproto", 2), ("fedproto", 1)]):
        over = dict(algorithm={"name": algo, "params": {}})
        cfg = make_config(tiny_config(**over, backend={"name": "ray", "num_actors": actors, "num_cpus": 1}))
        t0 = time.perf_counter()
        r = run_experiment(cfg, write=False)
        wall = time.perf_counter() - t0
        seq = run_experiment(make_config(tiny_config(**over)), write=False).table
        pd.testing.assert_frame_equal(without_timing(seq), without_timing(r.table))
        print(f"run {i}: {algo}, {actors} actor(s): {wall:.2f} s (backend.start {r.timing['setup_s']:.2f} s, rounds "
              f"{sum(r.timing['round_s']):.2f} s); table == sequential", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
