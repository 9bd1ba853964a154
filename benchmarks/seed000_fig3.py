"""Seed 000 Fig. 3 (issue 34): "当客户端可用的样本较少时,测试准确率会持续下降,但 FedProto 的准确率下降速度比 FedAvg 更慢"
— as the clients hold fewer samples, accuracy falls, and FedProto's falls more slowly than FedAvg's.

Scaled: mnist5k (5,000 digits) for MNIST, n = 3 ways, k shots per class per client (the seed's default 100; here
25 and 5, stdev 2), 20 clients; FedProto at the seed's settings (lambda 1, lr 0.01, 100 rounds) and FedAvg at its
validation-chosen lr 0.03 and 130 rounds (configs/tune_fedavg_seed000.yaml; chosen at k = 25, validation seed 100:
FedAvg has 4 tuning trials, FedProto none, as in fig2_mnist5k_n3_fedavg_tuned). Seeds 1-3 (never used for a choice).
The claim's statistic, per seed: drop = acc(k_hi) - acc(k_lo) for each method, and the paired difference
drop(FedAvg) - drop(FedProto): "held" when its 95 % interval is above 0 (raysim/app/verdicts.py), "tie" when it
contains 0, "reversed" when below.

    python benchmarks/seed000_fig3.py --seeds 1 2 3 --shots 25 5 --out /work/runs/fig3 \
        --json benchmarks/results/seed000_002/fig3_shots.json

Issue 51 (equal tuning): ``--fedproto-tuned`` runs FedProto at its own validation-chosen lr 0.03 / 30 rounds (the
same 4 trials FedAvg got, at k = 25: configs/tune_fedproto_seed000.yaml, tune_fedproto_seed000.md) instead of the
seed's lr 0.01 / 100 rounds; ``--window 5`` evaluates every round and takes each run's value as the mean of its last
5 evaluated rounds (the final round kept beside it as ``test_acc_final``), the window the other seed-000 claims use:

    python benchmarks/seed000_fig3.py --seeds 1 2 3 --shots 25 5 --fedproto-tuned --window 5 --out runs/fig3_tuned \
        --json benchmarks/results/seed000_002/fig3_shots_fedproto_tuned.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from raysim.app.verdicts import format_interval, interval  # noqa: E402
from raysim.config import load_config  # noqa: E402
from raysim.engine.loop import run_experiment  # noqa: E402
from raysim.io import results  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs", "seed000_fedproto")
UH = "FedAvg-UH (lr 0.03, 130 rounds)"
METHODS = {"FedProto": ("fedproto_mnist5k.yaml", []),
           "FedAvg (lr 0.03, 130 rounds)": ("fedavg_mnist5k.yaml", ["train.lr=0.03", "rounds=130"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--shots", type=int, nargs="+", default=[25, 5])
    ap.add_argument("--out", default="runs/fig3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--uh", action="store_true",
                    help="also FedAvg-UH (the fixed orthogonal head) at the largest k: claim 9, 'UH lowers FedAvg's "
                         "accuracy', paired FedAvg minus FedAvg-UH")
    ap.add_argument("--fedproto-tuned", action="store_true",
                    help="FedProto at its validation-chosen lr 0.03 / 30 rounds (issue 51) instead of the seed's")
    ap.add_argument("--window", type=int, default=0,
                    help="evaluate every round; a run's value is the mean of its last N evaluated rounds (0: final)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more overrides (a smoke test: rounds=1)")
    args = ap.parse_args()
    records = []
    hi = max(args.shots)
    methods = dict(METHODS)
    if args.fedproto_tuned:
        methods = {"FedProto (lr 0.03, 30 rounds)": ("fedproto_mnist5k.yaml", ["train.lr=0.03", "rounds=30"]),
                   **{k: v for k, v in METHODS.items() if k != "FedProto"}}
    win = ["eval.every=1"] if args.window else []
    plan = [(seed, k, label, f, e) for seed in args.seeds for k in args.shots for label, (f, e) in methods.items()]
    if args.uh:
        plan += [(seed, hi, UH, "fedavg_uh_mnist5k.yaml", ["train.lr=0.03", "rounds=130"]) for seed in args.seeds]
    for seed, k, label, file, extra in plan:
        ov = [f"seed={seed}", f"data.partition_params.shots={k}", "output.progress=false"] + extra + win + args.extra
        cfg = load_config(os.path.join(CONFIGS, file), ov)
        out = os.path.join(args.out, f"{cfg.algorithm.name}-k{k}-s{seed}")
        t0 = time.perf_counter()
        res = run_experiment(cfg, out_dir=out, progress=False) if not os.path.exists(
            os.path.join(out, "results.parquet")) else None
        wall = time.perf_counter() - t0
        if res is None:
            df, meta = results.load(out), results.load_metadata(out)
        else:
            df, meta = res.table, res.metadata
        final = float(results.final(df, "test_acc")["mean"].iloc[-1])
        pr = results.per_round(df, "test_acc").sort_values("round")
        acc = float(pr["mean"].iloc[-args.window:].mean()) if args.window else final
        rec = {"method": label, "shots": k, "seed": seed, "test_acc": acc,
               "wall_s": None if res is None else round(wall, 1), "reused": res is None,  # a finished run in --out
               "config_hash": cfg.run_id(), "out": out, "code": meta.get("versions", {}).get("code"),
               "numerics": meta.get("numerics", {}).get("mode"), "cpu": platform.processor() or
               meta.get("versions", {}).get("cpu")}
        if args.window:
            rec.update({"test_acc_final": final, "window": args.window,
                        "curve": {int(r): float(v) for r, v in zip(pr["round"], pr["mean"])}})
        records.append(rec)
        print(f"{label:30s} k={k:3d} seed {seed}: test_acc {acc:.4f} ({wall:.0f} s)", flush=True)
    lo = min(args.shots)
    acc = {(r["method"], r["shots"], r["seed"]): r["test_acc"] for r in records}
    names = list(methods)
    drops = {m: [acc[(m, hi, s)] - acc[(m, lo, s)] for s in args.seeds] for m in names}
    diff = [a - p for a, p in zip(drops[names[1]], drops[names[0]])]  # FedAvg's drop minus FedProto's
    iv = interval([100 * d for d in diff])
    verdict = ("n too small" if len(diff) < 3 else "held" if iv["lo"] > 0 else "reversed" if iv["hi"] < 0
               else "tie")
    lines = ["| method | " + " | ".join(f"k = {k}" for k in args.shots) + f" | drop k {hi} -> {lo} |",
             "|---|" + "---|" * (len(args.shots) + 1)]
    for m in names:
        cells = []
        for k in args.shots:
            v = interval([100 * acc[(m, k, s)] for s in args.seeds])
            cells.append(f"{v['mean']:.2f} ± {v['sd']:.2f}")
        d = interval([100 * x for x in drops[m]])
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {format_interval(d)} |")
    summary = {"records": records, "drop_diff_pp": iv, "verdict": verdict, "n": len(diff), "window": args.window,
               "claim": "FedProto's accuracy falls more slowly than FedAvg's as the clients' samples shrink",
               "table": "\n".join(lines)}
    if args.uh:
        base = names[1]
        d_uh = interval([100 * (acc[(base, hi, s)] - acc[(UH, hi, s)]) for s in args.seeds])
        v_uh = ("n too small" if len(args.seeds) < 3 else "held" if d_uh["lo"] > 0 else "reversed" if d_uh["hi"] < 0
                else "tie")
        u = interval([100 * acc[(UH, hi, s)] for s in args.seeds])
        summary["uh"] = {"claim": "the fixed head UH lowers FedAvg's accuracy (claim 9)", "k": hi,
                         "fedavg_uh_acc": u, "diff_pp": d_uh, "verdict": v_uh}
        lines.append(f"| {UH} | {u['mean']:.2f} ± {u['sd']:.2f} (k = {hi}) | | |")
        summary["table"] = "\n".join(lines)
        print(f"FedAvg - FedAvg-UH at k = {hi}, pp, paired: {format_interval(d_uh)} -> {v_uh}")
    print("\n".join(lines))
    print(f"drop(FedAvg) - drop(FedProto), percentage points, paired over {len(diff)} seeds: "
          f"{format_interval(iv)} -> {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
