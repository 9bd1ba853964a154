"""Optimiser steps per device per round of every run of a seed-004 reproduce experiment (issue 51 item 4: the work
behind each method's numbers), counted from the runs' own records, not assumed.

    python benchmarks/seed004_steps.py RUNS_DIR/<experiment> [--md OUT.md]

A device that trains in a round takes ``local_epochs x ceil(n / batch)`` SGD steps (``raysim.training``: no
dropped last batch), n = its training images (run.json ``data.train_sizes``) plus, for SlaugFL, the synthetic images it
generated once in the preparation (``syn_samples``, round -1). The devices that trained in a round are those with a
client-scope ``train_loss`` row in that round. Printed per row: mean (and max) steps per device per round over every
participation of every seed, and the mean training images per participating device.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd
import yaml


def run_steps(run: Path) -> tuple[list[int], list[int]]:
    meta = json.loads((run / "run.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    epochs, batch = int(cfg["train"]["local_epochs"]), int(cfg["train"]["batch_size"])
    sizes = meta["data"]["train_sizes"]
    df = pd.read_parquet(run / "results.parquet", columns=["round", "client_id", "scope", "metric", "value"])
    cl = df[df["scope"] == "client"]
    syn = {int(r.client_id): int(r.value) for r in cl[(cl["metric"] == "syn_samples")].itertuples()}
    part = cl[(cl["metric"] == "train_loss") & (cl["round"] >= 0)]
    steps, imgs = [], []
    for r in part.itertuples():
        n = sizes[int(r.client_id)] + syn.get(int(r.client_id), 0)
        steps.append(epochs * math.ceil(n / batch))
        imgs.append(n)
    return steps, imgs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exp_dir")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    lines = ["| row | seeds | SGD steps per device per round, mean (max) | training images per participating device, mean |",
             "|---|---|---|---|"]
    for row in sorted(p for p in Path(args.exp_dir).iterdir() if p.is_dir()):
        seeds = sorted(s for s in row.iterdir() if s.is_dir() and not s.name.endswith(".incomplete")
                       and (s / "run.json").exists())
        if not seeds:
            continue
        st, im = [], []
        for s in seeds:
            a, b = run_steps(s)
            st += a
            im += b
        lines.append(f"| {row.name} | {len(seeds)} | {sum(st) / len(st):.1f} ({max(st)}) | {sum(im) / len(im):.1f} |")
    out = "\n".join(lines) + "\n"
    print(out, end="")
    if args.md:
        Path(args.md).write_text(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
