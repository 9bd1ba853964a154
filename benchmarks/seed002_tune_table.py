"""The equal-budget tuning table of seed 002 (issue 34 item 1) from the studies' trials tables.

    python benchmarks/seed002_tune_table.py [TUNE_ROOT]   (default /work/runs/tune_seed002)

Reads ``<root>/<method>/trials.parquet`` (``raysim tune`` with ``configs/tune_<method>_seed002.yaml``), copies each to
``benchmarks/results/seed000_002/tune_seed002/<method>_trials.parquet`` and writes ``tune_seed002.md`` there: per
method the completed trials (an interrupted trial that was retried with the same values counts once), every trial's
values and validation score, the chosen values (best validation score) and the study's wall time.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "seed000_002" / "tune_seed002"
METHODS = [("fedtgp", "FedTGP", "val_acc_proto"), ("fedproto", "FedProto", "val_acc_proto"),
           ("lgfedavg", "LG-FedAvg", "val_acc"), ("feddistill", "FedDistill", "val_acc"), ("fml", "FML", "val_acc"),
           ("fedkd", "FedKD", "val_acc"), ("fedgen", "FedGen (fedgen_ht)", "val_acc")]


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(root: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    summary, detail = [], []
    for key, label, metric in METHODS:
        f = root / key / "trials.parquet"
        if not f.exists():
            summary.append(f"| {label} | 0 (not run) | – | – | – | – |")
            continue
        shutil.copy(f, OUT / f"{key}_trials.parquet")
        d = pd.read_parquet(f)
        pcols = [c for c in d.columns if c.startswith("params_")]
        done = d[d["state"] == "COMPLETE"]
        failed = d[(d["state"] != "COMPLETE") & ~d["number"].isin(done["retry_of"].dropna())]
        best = done.loc[done["value"].idxmax()]
        chosen = ", ".join(f"{c[7:]} = {_fmt(best[c])}" for c in pcols)
        wall = pd.to_datetime(d["datetime_complete"]).max() - pd.to_datetime(d["datetime_start"]).min()
        summary.append(f"| {label} | {len(done) + len(failed)} ({len(failed)} failed) | {', '.join(c[7:] for c in pcols)} | "
                       f"{chosen} | {metric} {best['value']:.4f} | {wall.total_seconds() / 60:.1f} |")
        detail.append(f"\n**{label}** (`configs/tune_{key}_seed002.yaml`, objective {metric} at round 9):\n\n"
                      f"| trial | {' | '.join(c[7:] for c in pcols)} | state | {metric} | wall s |\n"
                      f"|---|{'---|' * len(pcols)}---|---|---|")
        for _, r in d.sort_values("number").iterrows():
            if r["state"] != "COMPLETE" and r["number"] in set(done["retry_of"].dropna()):
                continue  # interrupted by the operator, retried with the same values (retry_of)
            val = f"{r['value']:.4f}" if r["state"] == "COMPLETE" else f"– ({r['reason']})"
            detail.append(f"| {int(r['number'])} | {' | '.join(_fmt(r[c]) for c in pcols)} | {r['state']} | {val} | "
                          f"{_fmt(round(r['seconds'], 1)) if r['state'] == 'COMPLETE' else '–'} |")
    md = ["# Seed 002 equal-budget tuning (issue 34 item 1), validation only",
          "",
          "Every method: 5 trials on the pathological Fashion-MNIST zoo base (`configs/seed002_fedtgp/<method>_fmnist_zoo.yaml`),",
          "validation seed 100, each client's 20 % validation split, 10 rounds evaluated every 5, objective at round 9;",
          "TPE (seed 0, 5 start-up trials: the method's current value first, then 4 seeded random draws). Written by",
          "`python benchmarks/seed002_tune_table.py` from the studies' trials tables (copied beside this file).",
          "",
          "| method | trials | tuned | chosen (best validation) | validation score | study wall (min) |",
          "|---|---|---|---|---|---|", *summary, *detail, ""]
    (OUT / "tune_seed002.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/runs/tune_seed002"))
