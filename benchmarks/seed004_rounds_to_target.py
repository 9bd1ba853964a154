"""Seed 004 (SlaugFL) in the seed's local regime: rounds to a target accuracy per seed, with paired 95 % intervals.

    PYTHONPATH=$PWD python benchmarks/seed004_rounds_to_target.py OUT/slaugfl_fmnist_a005_e10 [--md FILE]

Reads every ``<run slug>/seed<N>/`` of a ``raysim reproduce`` experiment directory (the global model's
``global_test_acc`` at every evaluated round, benchmarks/seed004_traffic.py's ``load_run``) and writes, per row, the
accuracy per round and the rounds to 30 % / 50 % (targets fixed before the runs); then the paired comparisons
(:func:`raysim.verdicts.judge`, fewer rounds is better; a seed in which a run never reaches the target counts as
rounds + 1, a lower bound, marked) and the last-round accuracy. Nothing here is typed by hand.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from raysim.app.verdicts import format_interval, judge  # noqa: E402
from seed004_traffic import first_reach, load_run  # noqa: E402

TARGETS = (0.30, 0.50)
PAIRS = [("SlaugFL s2", "VHL"), ("SlaugFL s2 selection test", "VHL"), ("SlaugFL s2 selection test", "SlaugFL s2"),
         ("SlaugFL s1 unseen candidates", "VHL"), ("SlaugFL s1 unseen candidates", "SlaugFL s2"),
         # slaugfl_fmnist_a005_e10_all (issue 51): every method of the seed's Table 2
         ("SlaugFL s1 upper bound", "VHL"), ("SlaugFL s1 upper bound", "SlaugFL s2"), ("SlaugFL s2", "FedAvg"),
         ("SlaugFL s2", "SCAFFOLD"), ("SlaugFL s2", "MOON")]
LABELS = {"slaugfl-s2": "SlaugFL s2", "slaugfl-s2-selection-test": "SlaugFL s2 selection test", "vhl": "VHL",
          "slaugfl-s1-unseen-candidates": "SlaugFL s1 unseen candidates", "slaugfl-s1-upper-bound": "SlaugFL s1 upper bound",
          "fedavg": "FedAvg", "scaffold": "SCAFFOLD", "fedprox": "FedProx", "moon": "MOON", "fedgen": "FedGen"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exp_dir", type=Path)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args()
    runs = {}
    for d in sorted(a.exp_dir.glob("*/seed*")):
        if d.name.endswith(".incomplete") or not (d / "run.json").exists():
            continue
        runs.setdefault(LABELS.get(d.parent.name, d.parent.name), {})[int(d.name[4:])] = load_run(d)
    out = [f"Rounds to target (global_test_acc on the full test set), from `{a.exp_dir}`:", "",
           "| row | seed | rounds | accuracy per round (%) | rounds to 30 % | rounds to 50 % | last round (%) |",
           "|---|---|---|---|---|---|---|"]
    rt = {}
    for lab, by_seed in runs.items():
        for s, r in sorted(by_seed.items()):
            reach = []
            for t in TARGETS:
                n = first_reach(r, t)
                reach.append(n)
                rt.setdefault((lab, t), {})[s] = n if math.isfinite(n) else r["rounds"] + 1
            out.append(f"| {lab} | {s} | {r['rounds']} | {' '.join(f'{100 * x:.1f}' for x in r['acc'])} | "
                       + " | ".join(f"{int(n)}" if math.isfinite(n) else f"not within {r['rounds']}" for n in reach)
                       + f" | {100 * r['acc'][-1]:.2f} |")
    out += ["", "Paired over seeds (better − worse in the claimed direction: fewer rounds, higher accuracy; a run that "
            "never reaches the target counts as rounds + 1):", "",
            "| comparison | measure | n | paired difference, mean ± 95 % [interval] | verdict |", "|---|---|---|---|---|"]
    for b, w in PAIRS:
        if b not in runs or w not in runs:
            continue
        for t in TARGETS:
            res = judge(rt[(b, t)], rt[(w, t)], lower_is_better=True)
            out.append(f"| {b} vs {w} | rounds to {int(100 * t)} % (fewer is better) | {res['n']} | "
                       f"{format_interval(res)} | {res['verdict']} |")
        acc_b = {s: 100 * r["acc"][-1] for s, r in runs[b].items()}
        acc_w = {s: 100 * r["acc"][-1] for s, r in runs[w].items()}
        res = judge(acc_b, acc_w)
        out.append(f"| {b} vs {w} | last-round accuracy (%) | {res['n']} | {format_interval(res)} | {res['verdict']} |")
    text = "\n".join(out) + "\n"
    print(text)
    if a.md:
        a.md.write_text(text)


if __name__ == "__main__":
    main()
