"""Seed 004, Fig. 7 (local epochs H at equal total epochs): the claim's parts on an equal span of local epochs.

    PYTHONPATH=$PWD python benchmarks/seed004_fig7_equal_epochs.py [--epochs 25] [--md FILE]

The counted table (``slaugfl_fmnist_fig7_h_window``) values a run by the mean of its last 5 evaluated rounds, the rule
fixed in advance for every counted claim (issue 51). At equal total epochs those 5 rounds are different stretches of
training: the last 5 local epochs at H = 1 (rounds 146-150), the last 25 at H = 5 (rounds 26-30), the last 100 of 160
at H = 20 (rounds 4-8, where accuracy still rises). This check (a sensitivity reading, not a verdict: it is computed
after the runs) values each run instead by the mean of its rounds covering the last ``--epochs`` local epochs (at least
one round: H = 1 the last 25 rounds, H = 5 the last 5, H = 20 the last round only) and judges the same parts with the
same paired interval (:func:`raysim.app.verdicts.judge`). Reads the stored per-run records' per-round values
(benchmarks/stored_verdicts.py's ``attach_curves``); nothing here is typed by hand.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from raysim.app.verdicts import format_interval, judge  # noqa: E402

TABLE = ROOT / "benchmarks" / "results" / "seed004" / "slaugfl_fmnist_fig7_h_window.json"
PARTS = [("SlaugFL s2", 5, 1), ("SlaugFL s2", 5, 20), ("VHL", 5, 1), ("VHL", 5, 20)]


def span_value(curve: dict, h: int, epochs: int) -> tuple[float, int]:
    """The mean of the last rounds covering ``epochs`` local epochs at ``h`` epochs a round (at least one round)."""
    k = max(1, round(epochs / h))
    rounds = sorted(int(r) for r in curve)[-k:]
    return sum(float(curve[r] if r in curve else curve[str(r)]) for r in rounds) / len(rounds), len(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=25, help="the span of local epochs each run is valued over")
    ap.add_argument("--md", type=Path, help="also write the table here")
    a = ap.parse_args(argv)
    import stored_verdicts as sv

    rec = sv.attach_curves(TABLE, json.loads(TABLE.read_text()))
    curves = {(r["label"], int(r["seed"])): r["curve"] for r in rec["runs"] if r.get("curve")}
    lines = [f"# Seed 004 Fig. 7 on an equal span of the last {a.epochs} local epochs (a sensitivity reading)", "",
             f"`PYTHONPATH=$PWD python benchmarks/seed004_fig7_equal_epochs.py --epochs {a.epochs}` from "
             f"`{TABLE.relative_to(ROOT)}` (per-round values of the global model's accuracy, %).", "",
             "| part | rounds averaged (better / worse) | better - worse, pp | verdict |", "|---|---|---|---|"]
    for method, hb, hw in PARTS:
        vals = {}
        used = {}
        for h in (hb, hw):
            lab = f"{method} H={h}"
            got = {s: span_value(c, h, a.epochs) for (lb, s), c in curves.items() if lb == lab}
            vals[h] = {s: v for s, (v, _) in got.items()}
            used[h] = sorted({k for _, k in got.values()})
        res = judge(vals[hb], vals[hw])
        lines.append(f"| {method}: H = {hb} beats H = {hw} | {used[hb]} / {used[hw]} | {format_interval(res)} | "
                     f"{res['verdict']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        a.md.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
