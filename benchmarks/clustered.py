"""Clustered FL figures (issue 13): PN-ICFL, PN-ICFL+, IFCA, FedFoMo, FeSEM, FedAvg and Local on Rotated MNIST built
from mnist5k (N = 48 users, |D_i| = 100, alpha in {3, 100}, participation R in {1.0, 0.5}) and on the multi-source
digit set (alpha = 100, R in {1.0, 0.5}); optionally the general setting (|D_i| = 1000, alpha = 100, rotated
Fashion-MNIST). Mean test accuracy over users and the ARI of the clustering at the last round, mean +- std over seeds.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/clustered.py [--seeds 3] [--rounds 10] [--workers 2] [--general]

Scaled for a shared 2-core machine (what changed against the seed is printed and written to
benchmarks/CLUSTERED.md): rounds, the network's width, the server's pre-training episodes, evaluation every 5 rounds.
Every run is appended to benchmarks/results/clustered/runs.jsonl as it ends; a rerun skips finished runs.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "clustered"
METHODS = ["pnicfl", "pnicfl_plus", "ifca", "fedfomo", "fesem", "fedavg", "local"]
LABEL = {"pnicfl": "PN-ICFL", "pnicfl_plus": "PN-ICFL+", "ifca": "IFCA", "fedfomo": "FedFoMo", "fesem": "FeSEM",
         "fedavg": "FedAvg", "local": "Local"}
# the seed: a 3 conv + 2 fc prototypical network (+ 1 fc classifier for the end-to-end baselines); scaled for the
# shared 2-core machine to a 2 fc body 784-128-32 (+ fc 32-10): the conv net (``protonet``) costs ~5x more per round
MODEL = {"arch": "mlp", "params": {"hidden": 128, "embed_dim": 32}}
PUBLIC = {"dataset": "fashion_mnist", "size": 2000}  # the seed: Omniglot (not offline)


def setting_data(setting: str) -> tuple[dict, int, float]:
    """(data section, users, participation R) of a setting name like rot-a3-r1.0 / ms-a100-r0.5 / gen-a100-r1.0."""
    kind, a, r = setting.split("-")
    alpha, rate = float(a[1:]), float(r[1:])
    if kind == "rot":
        data = {"dataset": "mnist5k", "num_clients": 48, "partition": "domain_dirichlet",
                "partition_params": {"alpha": alpha, "samples_per_client": 100, "test_ratio": 1 / 3},
                "rotations": [0, 90, 180, 270]}
    elif kind == "ms":
        data = {"dataset": "multisource_digits", "num_clients": 48, "partition": "domain_dirichlet",
                "partition_params": {"alpha": alpha, "samples_per_client": 100, "test_ratio": 0.2}}
    elif kind == "gen":
        data = {"dataset": "fashion_mnist", "num_clients": 48, "partition": "domain_dirichlet",
                "partition_params": {"alpha": alpha, "samples_per_client": 1000, "test_ratio": 0.1},
                "rotations": [0, 90, 180, 270]}
    else:
        raise ValueError(setting)
    return data, 48, rate


def config(setting: str, method: str, seed: int, rounds: int, pretrain: int) -> dict:
    data, n, rate = setting_data(setting)
    kind = setting.split("-")[0]
    data = json.loads(json.dumps(data))
    params: dict = {}
    model = MODEL
    if method in ("pnicfl", "pnicfl_plus"):
        # general setting: the clients hold Fashion-MNIST, so the public set is MNIST-5k (digits), not Fashion
        data["public"] = {"dataset": "mnist5k", "size": 2000} if kind == "gen" else PUBLIC
        params = {"num_clusters": 4, "pretrain_episodes": pretrain, "tasks_per_epoch": 2}
        if method == "pnicfl_plus":  # the seed's lambda: 0.2 (R = 1) / 0.1 (R = 0.5); multi-source 1.0 / 2.0
            params["lam"] = ({1.0: 1.0, 0.5: 2.0} if kind == "ms" else {1.0: 0.2, 0.5: 0.1})[rate]
    elif method in ("ifca", "fesem"):
        params = {"num_clusters": 4}
    elif method == "fedfomo":
        data["val_fraction"] = 0.2  # the seed: 20% of local data as validation
    epochs = 1 if kind in ("ms", "gen") else 2  # the seed: E = 2 few-shot rotated, 1 multi-source / general
    # the seed: lr 0.01 for PN-ICFL (B = 2 tasks), lr 0.1 and batch 50 for the other algorithms (IFCA: its own
    # tau = 10 full-batch steps at lr 0.1); momentum is not given: the engine's default 0.5 for all
    lr, batch = (0.01, 10) if method in ("pnicfl", "pnicfl_plus") else (0.1, 50)
    return {"name": f"{setting}-{method}", "seed": seed, "rounds": rounds,
            "clients_per_round": int(round(rate * n)), "data": data, "model": model,
            "train": {"local_epochs": epochs, "batch_size": batch, "lr": lr, "momentum": 0.5},
            "algorithm": {"name": method, "params": params}, "eval": {"every": 5},
            "backend": {"name": "sequential", "torch_threads": 1}, "output": {"progress": False}}


def _cache_loaders() -> None:
    """Each worker process loads a dataset once (benchmark only: the runs just index the loaded arrays)."""
    import functools

    from raysim.data import datasets

    for k in ("mnist5k", "fashion_mnist"):
        if not hasattr(datasets.LOADERS[k], "cache_info"):
            datasets.LOADERS[k] = functools.lru_cache(maxsize=2)(datasets.LOADERS[k])


def run_one(cfg_dict: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    _cache_loaders()
    from raysim.config import make_config
    from raysim.driver import run_experiment

    t0 = time.perf_counter()
    res = run_experiment(make_config(cfg_dict), write=False, progress=False)
    t = res.table
    last = int(t[(t.scope == "mean") & (t.metric == "test_acc")]["round"].max())

    def at(scope, metric):
        v = t[(t.scope == scope) & (t.metric == metric) & (t["round"] == last)]["value"]
        return float(v.iloc[0]) if len(v) else None

    curve = t[(t.scope == "mean") & (t.metric == "test_acc")].sort_values("round")
    ari_curve = t[(t.scope == "server") & (t.metric == "ari")].sort_values("round")
    return {"name": cfg_dict["name"], "seed": cfg_dict["seed"], "rounds": cfg_dict["rounds"], "last_round": last,
            "test_acc": at("mean", "test_acc"), "ari": at("server", "ari"),
            "test_acc_local": at("mean", "test_acc_local"),
            "acc_curve": [[int(r), float(v)] for r, v in zip(curve["round"], curve["value"])],
            "ari_curve": [[int(r), float(v)] for r, v in zip(ari_curve["round"], ari_curve["value"])],
            "down_floats_per_user_round": float(t[(t.scope == "client") & (t.metric == "down_floats")]["value"].mean()),
            "pretrain_acc": (float(t[t.metric == "pretrain_acc"]["value"].iloc[0]) if (t.metric == "pretrain_acc").any()
                             else None),
            "seconds": time.perf_counter() - t0}


def run_grid(cfgs: list[dict], workers: int, log: Path, deadline: float) -> dict:
    log.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            done[(r["name"], r["seed"], r["rounds"])] = r
    todo = [c for c in cfgs if (c["name"], c["seed"], c["rounds"]) not in done]
    print(f"{len(cfgs) - len(todo)} runs done before, {len(todo)} to run", flush=True)
    with ProcessPoolExecutor(max_workers=workers) as ex:
        futs = {ex.submit(run_one, c): c for c in todo}
        for f in as_completed(futs):
            c = futs[f]
            try:
                r = f.result()
            except Exception as e:  # a failed run is reported, never silently dropped
                print(f"  FAILED {c['name']} seed {c['seed']}: {type(e).__name__}: {e}", flush=True)
                continue
            done[(r["name"], r["seed"], r["rounds"])] = r
            with log.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(f"  {r['name']} seed {r['seed']}: acc {r['test_acc']:.3f} ari {r['ari']} ({r['seconds']:.0f}s)",
                  flush=True)
            if time.time() > deadline:
                print("deadline reached: cancelling the remaining runs", flush=True)
                for g in futs:
                    g.cancel()
                break
    return done


def fmt(vals) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1):.3f}"


def table(done: dict, settings: list[str], seeds: list[int], rounds: dict) -> str:
    lines = ["| method | " + " | ".join(f"{s} acc | {s} ARI" for s in settings) + " |",
             "|---|" + "---|---|" * len(settings)]
    for m in METHODS:
        cells = []
        for s in settings:
            rs = [done.get((f"{s}-{m}", seed, rounds[s])) for seed in seeds]
            rs = [r for r in rs if r is not None]
            cells += [fmt([r["test_acc"] for r in rs]) + f" (n={len(rs)})", fmt([r["ari"] for r in rs])]
        lines.append(f"| {LABEL[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--general-rounds", type=int, default=10)
    ap.add_argument("--pretrain", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=25.0, help="stop collecting results after this wall time")
    ap.add_argument("--general", action="store_true", help="also the general setting (|D_i| = 1000, rotated Fashion)")
    ap.add_argument("--only", default="", help="comma-separated settings to run")
    ap.add_argument("--report", action="store_true", help="only print the tables of the runs already logged")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    ap.add_argument("--log", default="runs.jsonl", help="run log under benchmarks/results/clustered/")
    args = ap.parse_args()
    seeds = list(range(1, args.seeds + 1))
    rot = ["rot-a3-r1.0", "rot-a3-r0.5", "rot-a100-r1.0", "rot-a100-r0.5"]
    ms = ["ms-a100-r1.0", "ms-a100-r0.5"]
    gen = ["gen-a100-r1.0"] if args.general else []
    settings = rot + ms + gen
    if args.only:
        settings = [s for s in settings if s in args.only.split(",")]
    rounds = {s: (args.general_rounds if s.startswith("gen") else args.rounds) for s in settings}
    # rotated MNIST first, then the other settings; seed-major within each, so a cut-off grid is complete per seed
    groups = [[s for s in settings if s.startswith("rot")], [s for s in settings if not s.startswith("rot")]]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    cfgs = [config(s, m, seed, rounds[s], args.pretrain) for g in groups for seed in seeds for s in g for m in methods]
    t0 = time.time()
    if args.report:  # tables from the runs already logged, nothing run
        done = {}
        for line in (OUT / args.log).read_text().splitlines():
            r = json.loads(line)
            done[(r["name"], r["seed"], r["rounds"])] = r
    else:
        done = run_grid(cfgs, args.workers, OUT / args.log, t0 + 60 * args.minutes)
    print(f"\nwall time {time.time() - t0:.0f}s\n")
    rot_s = [s for s in settings if s.startswith("rot")]
    other = [s for s in settings if not s.startswith("rot")]
    for group in (rot_s, other):
        if group:
            print(table(done, group, seeds, rounds) + "\n")


if __name__ == "__main__":
    main()
