"""FedProto vs FedAvg under a heterogeneous mobile environment (issue 3, figure 2).

Runs configs/fedproto_mnist5k.yaml and configs/fedavg_mnist5k.yaml (mnist5k, 20 clients, 4-way 25-shot) with the
``mobile-heterogeneous`` preset through ``--set`` overrides (sequential backend, fewer rounds), then prints mean local
test accuracy against simulated time, simulated time-to-target accuracy, and the per-round simulated compute and
communication time of each method; writes a PNG of accuracy vs simulated time.

    python benchmarks/env_fedproto_vs_fedavg.py [--rounds 30] [--eval-every 3] [--clients-per-round 10]
        [--targets 0.7 0.8 0.9] [--out runs/env_fig]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from raysim.io import results
from raysim.config import load_config
from raysim.engine.loop import run_experiment

CONFIGS = {"FedProto": "configs/fedproto_mnist5k.yaml", "FedAvg": "configs/fedavg_mnist5k.yaml"}


def overrides(args) -> list[str]:
    out = [f"rounds={args.rounds}", f"eval.every={args.eval_every}", "backend.name=sequential",
           f"env.preset={args.preset}", f"seed={args.seed}"]
    if args.clients_per_round:
        out.append(f"clients_per_round={args.clients_per_round}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=3)
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--preset", default="mobile-heterogeneous")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--targets", type=float, nargs="*", default=[0.7, 0.8, 0.9])
    ap.add_argument("--out", default="runs/env_fig")
    args = ap.parse_args()
    out = Path(args.out)
    tables = {}
    for method, path in CONFIGS.items():
        ov = overrides(args)
        print(f"$ raysim run {path} --no-progress --out {out / method} " + " ".join(f"--set {o}" for o in ov))
        res = run_experiment(load_config(path, ov), out_dir=out / method, progress=False)
        tables[method] = res.table.assign(method=method)
    df = pd.concat(tables.values(), ignore_index=True)
    names = dict(df[["run_id", "method"]].drop_duplicates().itertuples(index=False))

    avt = results.accuracy_vs_sim_time(df).assign(method=lambda d: d["run_id"].map(names))
    print("\nmean local test accuracy (test_acc) vs simulated time")
    wide = avt.pivot_table(index="round", columns="method", values=["sim_time", "mean"])
    print(wide.to_string(float_format=lambda v: f"{v:.3f}"))

    print("\nsimulated time-to-target (first evaluated round whose mean test_acc >= target)")
    for target in args.targets:
        ttt = results.sim_time_to_target(df, "test_acc", target).assign(method=lambda d: d["run_id"].map(names))
        for row in ttt.itertuples():
            reached = "not reached" if pd.isna(row.sim_time) else (
                f"{row.sim_time:8.1f} s at round {int(row.round):>3}, {row.bytes / 1e6:7.2f} MB sent")
            print(f"  target {target:.2f}  {row.method:<9} {reached}")

    print("\nper round (mean over rounds): simulated round length; per selected client compute and comm time")
    for method, t in tables.items():
        env = t[t.scope == "env"].pivot(index="round", columns="metric", values="value")
        cl = t[t.scope == "client"]
        comp = cl[cl.metric == "sim_compute_s"]["value"].mean()
        comm = cl[cl.metric == "sim_comm_s"]["value"].mean()
        up = t[(t.scope == "total") & (t.metric == "up_bytes")]["value"].mean()
        print(f"  {method:<9} round {env['sim_round_s'].mean():6.2f} s; compute {comp:5.2f} s, comm {comm:5.2f} s per "
              f"client; uploads {up / 1e3:8.1f} kB/round; selected {env['selected'].mean():.1f}, kept "
              f"{env['kept'].mean():.1f}, dropped {env['dropped'].mean():.2f}, late {env['late'].mean():.2f}; "
              f"total {env['sim_time'].iloc[-1]:.0f} s simulated")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, g in avt.groupby("method"):
        ax.errorbar(g["sim_time"], g["mean"], yerr=g["std"], marker="o", capsize=2, label=method)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("mean local test accuracy")
    ax.set_title(f"mnist5k, {args.preset}, {args.rounds} rounds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = out / "accuracy_vs_sim_time.png"
    fig.savefig(png, dpi=120)
    print(f"\nfigure: {png}")


if __name__ == "__main__":
    main()
