"""MAFML (seed 003) and its baselines on Rotated MNIST M0/M20/M40/M60, next to the seed's Table 1.

    PYTHONPATH=$PWD python benchmarks/mutual.py [--iterations 500] [--seeds 1] [--workers 2] [--out DIR]

Setting (seed §4.1.1): 4 nodes, one per domain (1000 MNIST base images, 100 per class, from mnist5k; rotated
clockwise by 0/20/40/60 degrees); each node's samples split private/public/val/test with public = alpha, val 10%,
test 15% (private + public = 75%); LeNet; Adam lr 1e-3, weight decay 1e-4; batch 32; validation every 50 iterations,
the checkpoint with the best validation ACC (all domains' validation splits) is tested. Scaled: ``--iterations``
(default 500) instead of the seed's 10,000, ``--seeds`` (default 1) seeds. What one iteration / exchange is, per method:

* MAFML: one round = 50 iterations, each with its own exchange (soft labels up, relayed down);
* IND / AGG: one round = 50 Adam steps (``train.local_steps``), no exchange;
* FedAvg: one round = ONE local step and one weight exchange (the seed keeps FedAvg's communication frequency equal
  to MAFML's: every iteration), evaluated every 50 rounds;
* FML / FedKD: one round = 50 local steps, then one exchange of the meme / compressed mentee;
* FedMD: transfer learning (3 epochs public + 3 epochs private, not counted in the iterations), then per round one
  alignment exchange, a digest epoch and 50 revisit steps.

Writes each run's table to ``--out`` and prints markdown tables (selected and last checkpoints) and traffic; figures
go to benchmarks/figures/mutual_*.png.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
EVERY = 50  # the seed's validation interval (iterations)

SEED_TABLE = {  # seed Table 1: averages over the 4 nodes (ACC / BWT / FWT, %)
    ("mafml", 0.05): (87.79, 94.00, 86.00), ("agg", 0.05): (85.13, 92.33, 82.73), ("fedmd", 0.05): (85.09, 91.50, 82.95),
    ("mafml", 0.10): (88.21, 92.67, 87.67), ("ind", 0.10): (68.45, 92.56, 60.47), ("agg", 0.10): (85.25, 92.00, 83.00),
    ("fedmd", 0.10): (85.09, 91.17, 83.06), ("fedavg", 0.10): (86.50, 86.50, 86.50),
    ("mafml", 0.15): (89.21, 92.33, 88.17), ("agg", 0.15): (87.83, 92.36, 86.22), ("fedmd", 0.15): (86.75, 91.33, 85.22),
}
SEED_PER_NODE = {  # seed Table 1 per node (M0, M20, M40, M60) at alpha = 10%: (ACC, BWT, FWT)
    "mafml": [(90.67, 93.33, 89.78), (90.00, 95.33, 88.67), (85.50, 90.67, 86.89), (86.67, 91.33, 85.33)],
    "ind": [(66.39, 91.33, 58.08), (78.11, 94.00, 72.82), (72.39, 93.11, 65.48), (56.89, 91.78, 45.48)],
    "agg": [(86.50, 90.00, 85.33), (87.17, 92.67, 85.33), (86.67, 94.00, 84.22), (80.67, 91.33, 77.11)],
    "fedmd": [(85.00, 88.67, 83.78), (87.67, 95.33, 85.11), (82.00, 90.67, 79.11), (85.67, 90.00, 84.22)],
    "fedavg": [(86.50, 77.33, 89.56), (86.50, 86.67, 86.44), (86.50, 92.67, 84.44), (86.50, 89.33, 85.56)],
}


def base_config(method: str, alpha: float, iterations: int, seed: int, archs=None) -> dict:
    steps = 1 if method == "fedavg" else EVERY
    rounds = iterations // steps
    cfg = {
        "name": f"mutual-{method}-a{int(round(alpha * 100))}-s{seed}" + ("-hetero" if archs else ""),
        "seed": seed,
        "rounds": rounds,
        "clients_per_round": 4,
        "data": {"dataset": "mnist5k", "num_clients": 4, "partition": "shared_base",
                 "partition_params": {"per_class": 100}, "rotations": [0, 20, 40, 60],
                 "local_split": {"public": alpha, "val": 0.10, "test": 0.15}},
        "model": {"arch": "lenet"} if not archs else {"per_client": [{"arch": a} for a in archs], "assign": "list"},
        "train": {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4, "batch_size": 32, "persist_optimizer": True,
                  "local_steps": steps},
        "algorithm": {"name": method, "params": {}},
        "eval": {"every": EVERY // steps},
        "backend": {"name": "sequential"},
        "output": {"progress": False},
    }
    if method == "mafml":
        cfg["algorithm"]["params"] = {"iterations": EVERY}
    if method == "fedmd":
        cfg["algorithm"]["params"] = {"transfer_public_epochs": 3, "transfer_private_epochs": 3}
    return cfg


@functools.lru_cache(maxsize=None)
def _mnist5k(root):
    from raysim.data.datasets import load_mnist5k

    return load_mnist5k(root)


def run_one(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from raysim.config import make_config
    from raysim.data import datasets
    from raysim.driver import run_experiment

    datasets.LOADERS["mnist5k"] = _mnist5k  # load the 5,000 digits once per worker process (8 s each otherwise)
    t0 = time.perf_counter()
    res = run_experiment(make_config(job["cfg"]), write=False, progress=False)
    path = Path(job["out"]) / f"{job['cfg']['name']}.parquet"
    res.table.to_parquet(path, index=False)
    return {**{k: v for k, v in job.items() if k != "cfg"}, "name": job["cfg"]["name"], "path": str(path),
            "seconds": time.perf_counter() - t0}


def jobs(iterations: int, seeds: int, out: str, hetero: bool) -> list[dict]:
    js = []
    for seed in range(1, seeds + 1):
        for alpha in (0.05, 0.10, 0.15):
            for m in ("mafml", "agg", "fedmd"):
                js.append({"method": m, "alpha": alpha, "seed": seed, "hetero": False})
        for m in ("ind", "fedavg", "fml", "fedkd"):  # private + public = 75% whatever alpha: one alpha suffices
            js.append({"method": m, "alpha": 0.10, "seed": seed, "hetero": False})
        if hetero:
            js.append({"method": "mafml", "alpha": 0.10, "seed": seed, "hetero": True})
    for j in js:
        archs = ["lenet", "cnn_mnist", "cnn4", "resnet_small"] if j["hetero"] else None
        j["cfg"] = base_config(j["method"], j["alpha"], iterations, j["seed"], archs)
        j["out"] = out
    js.sort(key=lambda j: -(j["method"] == "mafml"))  # the long ones first
    return js


def summarise(done: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per run and node: the selected (best validation ACC) and the last checkpoint's ACC/BWT/FWT, the projection
    share and the traffic."""
    from raysim.results import select_by_validation

    rows, traffic = [], []
    for d in done:
        df = pd.read_parquet(d["path"])
        sel = select_by_validation(df)
        c = df[df["scope"] == "client"]
        proj = c[c["metric"] == "projected"]["value"]
        for _, r in sel.iterrows():
            rows.append({"method": d["method"] + ("-hetero" if d["hetero"] else ""), "alpha": d["alpha"],
                         "seed": d["seed"], "node": int(r["client_id"]),
                         **{k: 100 * r[k] for k in r.index if k.startswith(("sel_test", "last_test"))},
                         "sel_iter": (int(r["sel_round"]) + 1) * (1 if d["method"] == "fedavg" else EVERY),
                         "projected": float(proj.mean()) if len(proj) else np.nan})
        tot = df[df["scope"] == "total"]
        upf = tot[(tot["metric"] == "up_floats") & (tot["round"] >= 0)]["value"].sum()
        dnf = tot[(tot["metric"] == "down_floats") & (tot["round"] >= 0)]["value"].sum()
        iters = d["cfg_iterations"]
        traffic.append({"method": d["method"] + ("-hetero" if d["hetero"] else ""), "alpha": d["alpha"],
                        "seed": d["seed"], "up_floats_total": upf, "down_floats_total": dnf,
                        "floats_per_iteration": (upf + dnf) / iters, "seconds": d["seconds"]})
    return pd.DataFrame(rows), pd.DataFrame(traffic)


def md(frame: pd.DataFrame, digits=2) -> str:
    cols = list(frame.columns)
    out = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        out.append("| " + " | ".join(f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in r) + " |")
    return "\n".join(out)


def report(per: pd.DataFrame, traffic: pd.DataFrame) -> str:
    lines = []
    avg = per.groupby(["method", "alpha"]).mean(numeric_only=True).reset_index()
    tab = []
    for _, r in avg.iterrows():
        ref = SEED_TABLE.get((r["method"], round(r["alpha"], 2)))
        tab.append({"method": r["method"], "alpha": f"{r['alpha']:.0%}",
                    "ACC sel": r["sel_test_acc_all"], "BWT sel": r["sel_test_bwt"], "FWT sel": r["sel_test_fwt"],
                    "ACC last": r["last_test_acc_all"], "BWT last": r["last_test_bwt"], "FWT last": r["last_test_fwt"],
                    "seed ACC/BWT/FWT": "/".join(f"{v:.2f}" for v in ref) if ref else "-",
                    "projected": r["projected"]})
    lines += ["### Averages over the 4 nodes (%, selected = best validation ACC; last = final checkpoint)", "",
              md(pd.DataFrame(tab)), ""]
    a10 = per[per["alpha"].round(2) == 0.10]
    pn = a10.groupby(["method", "node"]).mean(numeric_only=True).reset_index()
    tab = []
    for _, r in pn.iterrows():
        ref = SEED_PER_NODE.get(r["method"])
        tab.append({"method": r["method"], "node": f"M{20 * int(r['node'])}",
                    "ACC": r["sel_test_acc_all"], "BWT": r["sel_test_bwt"], "FWT": r["sel_test_fwt"],
                    "seed ACC/BWT/FWT": "/".join(f"{v:.2f}" for v in ref[int(r["node"])]) if ref else "-",
                    "sel. iteration": r["sel_iter"]})
    lines += ["### Per node, alpha = 10% (selected checkpoint, %)", "", md(pd.DataFrame(tab)), ""]
    tr = traffic.groupby(["method", "alpha"]).mean(numeric_only=True).reset_index().drop(columns="seed")
    tr["alpha"] = tr["alpha"].map(lambda a: f"{a:.0%}")
    ref = tr[tr["method"] == "mafml"]["floats_per_iteration"]
    if len(ref):
        tr["x MAFML"] = tr["floats_per_iteration"] / float(ref.iloc[0])
    lines += ["### Traffic (floats, all nodes, up + down, over the run; mean over seeds; seconds = wall per run)", "",
              md(tr, 1), ""]
    return "\n".join(lines)


def figure(per: pd.DataFrame, done: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    a10 = per[per["alpha"].round(2) == 0.10].groupby("method").mean(numeric_only=True)
    order = [m for m in ("mafml", "mafml-hetero", "ind", "agg", "fedmd", "fedavg", "fml", "fedkd") if m in a10.index]
    x = np.arange(len(order))
    for k, (col, lab) in enumerate((("sel_test_acc_all", "ACC"), ("sel_test_bwt", "BWT"), ("sel_test_fwt", "FWT"))):
        axes[0].bar(x + (k - 1) * 0.27, a10.loc[order, col], 0.27, label=lab)
    axes[0].set_xticks(x, order, rotation=20)
    axes[0].set_ylim(40, 100)
    axes[0].set_ylabel("% (mean of 4 nodes, selected checkpoint)")
    axes[0].set_title("Rotated MNIST, LeNet, alpha = 10%")
    axes[0].legend()
    for d in done:
        if round(d["alpha"], 2) != 0.10 or d["seed"] != 1:
            continue
        df = pd.read_parquet(d["path"])
        m = df[(df["scope"] == "mean") & (df["metric"] == "test_acc_all")].sort_values("round")
        steps = 1 if d["method"] == "fedavg" else EVERY
        axes[1].plot((m["round"] + 1) * steps, 100 * m["value"], label=d["method"] + ("-hetero" if d["hetero"] else ""))
    axes[1].set_xlabel("iteration")
    axes[1].set_ylabel("test ACC (all domains), mean of nodes, %")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="/tmp/mutual_runs")
    ap.add_argument("--no-hetero", action="store_true")
    ap.add_argument("--only", nargs="*", help="methods to run (default: all)")
    ap.add_argument("--report-only", action="store_true", help="summarise the runs already in --out (done.json)")
    a = ap.parse_args()
    if a.report_only:
        done = json.loads((Path(a.out) / "done.json").read_text())
        per, traffic = summarise(done)
        print(report(per, traffic))
        figure(per, done, HERE / "figures" / "mutual_rotated_mnist.png")
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    js = jobs(a.iterations, a.seeds, a.out, not a.no_hetero)
    if a.only:
        js = [j for j in js if j["method"] in a.only]
    t0 = time.perf_counter()
    done = []
    with ProcessPoolExecutor(a.workers) as ex:
        for res in ex.map(run_one, js):
            res["cfg_iterations"] = a.iterations
            done.append(res)
            print(f"[{time.perf_counter() - t0:7.1f}s] {res['name']} {res['seconds']:.1f}s", flush=True)
    with open(Path(a.out) / "done.json", "w") as f:
        json.dump(done, f, indent=1)
    per, traffic = summarise(done)
    per.to_csv(Path(a.out) / "per_node.csv", index=False)
    print(f"\n## Rotated MNIST, {a.iterations} iterations, {a.seeds} seed(s), wall {time.perf_counter() - t0:.0f} s\n")
    print(report(per, traffic))
    (HERE / "figures").mkdir(exist_ok=True)
    figure(per, done, HERE / "figures" / "mutual_rotated_mnist.png")
    print("figure: benchmarks/figures/mutual_rotated_mnist.png")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
