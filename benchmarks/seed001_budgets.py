"""Seed 001 under equal budgets (issue 34): PN-ICFL with the seed's initialisation and with 10 k-means++ restarts,
IFCA with one random initialisation and the best of 10 by training loss, from the stored 5-seed tables.

    python benchmarks/seed001_budgets.py            # markdown on stdout

Reads ``benchmarks/results/seed001/<experiment>.json`` (``raysim reproduce``'s reproduction.json: per-run records)
and prints, per experiment, the four rows (ARI and accuracy: mean ± sample std and the per-seed values) and every
claim of the experiment with its paired 95 % interval and verdict (as ``raysim reproduce`` computed them)."""
from __future__ import annotations

import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "seed001"
EXPERIMENTS = ("seed001_table1_multisource", "seed001_table2_rotated", "seed001_table3_general",
               "seed001_table3_general_a3", "seed001_table3_general_scaled", "seed001_table3_general_a3_scaled")
ROWS = ("PN-ICFL", "PN-ICFL k-means++ x10", "IFCA", "IFCA best of 10")


def _stats(vals):
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "–"
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else float("nan")
    return f"{m:.3f} ± {sd:.3f}"


def main() -> None:
    for name in EXPERIMENTS:
        f = RESULTS / f"{name}.json"
        if not f.exists():
            print(f"### {name}\n\nnot run (no {f.name})\n")
            continue
        rec = json.loads(f.read_text())
        runs = rec["runs"]
        print(f"### {name} (n = {len(rec['seeds'])} seeds: {', '.join(map(str, rec['seeds']))})\n")
        print("| row | ARI | ARI per seed | acc | acc per seed | wall s/run |")
        print("|---|---|---|---|---|---|")
        for label in ROWS:
            rs = sorted((r for r in runs if r["label"] == label), key=lambda r: r["seed"])
            if not rs:
                continue
            ari = [r.get("server:ari") for r in rs]
            acc = [r.get("test_acc") for r in rs]
            wall = sum(r.get("wall_s", 0.0) for r in rs) / len(rs)
            print(f"| {label} | {_stats(ari)} | {', '.join(f'{v:.2f}' for v in ari)} | {_stats(acc)} | "
                  f"{', '.join(f'{v:.3f}' for v in acc)} | {wall:.1f} |")
        print("\n| claim | metric | n | paired difference, mean ± 95 % [interval] | verdict |")
        print("|---|---|---|---|---|")
        for c in rec["claims"]:
            iv = (f"{c['ours']:+.3f} ± {c['half']:.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"
                  if c.get("half") is not None and not math.isnan(c["half"]) else f"{c['ours']:+.3f}")
            print(f"| {c['text']} | {c['metric']} | {c['n']} | {iv} | {c['verdict']} |")
        print()


if __name__ == "__main__":
    main()
