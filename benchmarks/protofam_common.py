"""Helpers for the prototype-family figure scripts (benchmarks, not tests): run a grid of configs in a few worker
processes (sequential backend, one torch thread each) and summarise final / best round accuracies and traffic."""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np


def run_one(cfg_dict: dict) -> dict:
    """Run one experiment in this process and return a JSON-able summary of its table."""
    import torch

    torch.set_num_threads(1)
    from raysim.config import make_config
    from raysim.driver import run_experiment

    t0 = time.perf_counter()
    cfg = make_config(cfg_dict)
    res = run_experiment(cfg, write=False, progress=False)
    df = res.table
    out = {"name": cfg.name, "seed": cfg.seed, "algorithm": cfg.algorithm.name, "params": dict(cfg.algorithm.params),
           "seconds": time.perf_counter() - t0, "metrics": {}}
    ev = df[df.scope.isin(["mean", "wmean"])]
    for (scope, metric), g in ev.groupby(["scope", "metric"]):
        g = g.sort_values("round")
        out["metrics"][f"{scope}:{metric}"] = {"final": float(g["value"].iloc[-1]), "best": float(g["value"].max()),
                                               "curve": [float(v) for v in g["value"]]}
    tot = df[df.scope == "total"]
    for m in ("up_floats", "down_floats"):
        v = tot[tot.metric == m]["value"]
        out[m + "_per_round"] = float(v.mean()) if len(v) else 0.0
    return out


def run_grid(cfgs: list[dict], workers: int, log_path: Path) -> list[dict]:
    """Run every config (``workers`` processes), appending each summary to ``log_path`` (JSON lines) as it ends;
    configs already in the log (same name and seed) are not run again, so a killed grid resumes."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["name"], r["seed"])] = r
    todo = [c for c in cfgs if (c["name"], c["seed"]) not in done]
    if todo:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            for r in ex.map(run_one, todo):
                done[(r["name"], r["seed"])] = r
                with log_path.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"  {r['name']} seed {r['seed']}: {r['seconds']:.0f}s", flush=True)
    return [done[(c["name"], c["seed"])] for c in cfgs]


def mean_std(values) -> str:
    v = np.asarray(values, dtype=float) * 100
    return f"{v.mean():.2f} ± {v.std(ddof=0):.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def default_workers() -> int:
    return int(os.environ.get("PROTOFAM_WORKERS", "2"))
