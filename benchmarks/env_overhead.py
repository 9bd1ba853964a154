"""Environment-layer overhead (issue 3, figure 1): the share of round wall time spent simulating the environment.

(A) In a real run: FedProto on mnist5k (configs/fedproto_mnist5k.yaml) with the mobile-heterogeneous preset, the
    sequential backend, evaluated only at the last round. The round loop times ``env.select`` + ``env.outcome`` + writing
    the env rows (RunResult.timing["env_s"]) against the whole round (timing["round_s"]); round 0 (warm-up) is left out.
(B) Scaling, without training: select + outcome + rows per round for populations of 100 .. 10,000 clients with 10%
    selected per round (synthetic reports carrying FedAvg-sized messages), to show where the cost would start to matter.

    python benchmarks/env_overhead.py [--rounds 10] [--backend sequential] [--populations 100 1000 10000]
"""
from __future__ import annotations

import argparse
import statistics
import time

from envs import Environment, parse_env
from raysim.config import load_config
from raysim.runner.runners import ClientReport
from raysim.engine.loop import run_experiment


def in_run(config: str, rounds: int, backend: str, preset: str) -> dict:
    overrides = [f"rounds={rounds}", f"eval.every={rounds}", f"backend.name={backend}", f"env.preset={preset}",
                 "output.progress=false"]
    cfg = load_config(config, overrides)
    res = run_experiment(cfg, write=False, progress=False)
    env_s, round_s = res.timing["env_s"][1:], res.timing["round_s"][1:]
    return {"command": f"raysim run {config} " + " ".join(f"--set {o}" for o in overrides),
            "rounds_timed": len(round_s), "mean_round_s": statistics.mean(round_s),
            "mean_env_ms": 1e3 * statistics.mean(env_s), "share": sum(env_s) / sum(round_s),
            "max_share": max(e / r for e, r in zip(env_s, round_s))}


def scaling(population: int, rounds: int = 20, preset: str = "mobile-heterogeneous") -> dict:
    env = Environment(parse_env({"preset": preset}), 1, [100] * population, 1)
    k = max(1, population // 10)
    times = []
    for t in range(rounds):
        t0 = time.perf_counter()
        sel = env.select(t, k)
        t_sel = time.perf_counter() - t0
        reports = [ClientReport(c, t, "update", up={"weights": (21840, 87360)}, down={"weights": (21840, 87360)})
                   for c in sel]
        t1 = time.perf_counter()
        list(env.outcome(t, reports).rows())
        times.append(t_sel + time.perf_counter() - t1)
    return {"population": population, "selected_per_round": len(sel), "ms_per_round": 1e3 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/fedproto_mnist5k.yaml")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="sequential", choices=["sequential", "ray"])
    ap.add_argument("--preset", default="mobile-heterogeneous")
    ap.add_argument("--populations", type=int, nargs="*", default=[100, 1000, 10000])
    args = ap.parse_args()
    r = in_run(args.config, args.rounds, args.backend, args.preset)
    print(f"(A) {r['command']}")
    print(f"    {r['rounds_timed']} timed rounds: mean round {r['mean_round_s'] * 1e3:.1f} ms, environment "
          f"{r['mean_env_ms']:.3f} ms/round -> share {100 * r['share']:.3f}% (worst round {100 * r['max_share']:.3f}%; "
          f"target <= 2%)")
    print("(B) population  selected/round  env ms/round (select + outcome + rows, median of 20 rounds)")
    for n in args.populations:
        s = scaling(n, preset=args.preset)
        print(f"    {s['population']:>10}  {s['selected_per_round']:>14}  {s['ms_per_round']:>10.2f}")


if __name__ == "__main__":
    main()
