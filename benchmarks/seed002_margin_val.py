"""Issue 51 item 5: the validation table behind seed002_table_fmnist_zoo_margin_val (FedTGP's tau, FedProto's lambda).

Reads finished validation runs (seed 100, each client's 20 % validation split, evaluated every round) and prints, per
run: the score the choice is made on -- the client mean of ``val_acc_proto`` averaged over the last ``window``
evaluated rounds of the first ``rounds`` (the verdict rule of issue 51 item 2, applied on validation) -- the last
round's value beside it, and for FedTGP the margin's trace: D(t) (``tgp_max_dist``), the rounds in which tau binds
(``tgp_margin_capped`` = 1) and whether delta adapts in any round. No test metric is read.

    python benchmarks/seed002_margin_val.py /work/runs/i51b/val/fedtgp_tau1 /work/runs/i51b/val/fedtgp_tau3 ... \
        --rounds 10 --window 5 --json benchmarks/results/seed000_002/seed002_margin_val.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd


def _curve(t: pd.DataFrame, metric: str, scope: str, rounds: int) -> pd.Series:
    sel = t[(t.metric == metric) & (t.scope == scope) & (t["round"] < rounds)]
    return sel.groupby("round")["value"].mean().sort_index()


def summarise(run_dir: Path, rounds: int, window: int) -> dict:
    """One validation run's row: score (window mean of val_acc_proto), final round, the margin's trace."""
    t = pd.read_parquet(run_dir / "results.parquet")
    val = _curve(t, "val_acc_proto", "client", rounds)
    row = {"run": run_dir.parent.name, "rounds_read": int(val.index.max()) + 1, "window": min(window, len(val)),
           "val_window_mean": float(val.iloc[-window:].mean()), "val_last": float(val.iloc[-1]),
           "config": json.loads((run_dir / "run.json").read_text()).get("config_hash")}
    dist = _curve(t, "tgp_max_dist", "server", rounds)
    if len(dist):
        capped = _curve(t, "tgp_margin_capped", "server", rounds)
        row["D_t"] = [round(float(v), 2) for v in dist]
        row["capped_rounds"] = [int(r) for r, v in capped.items() if v >= 0.5]
        row["delta_adapts"] = len(row["capped_rounds"]) < len(capped)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| run | D(t), rounds 0 → last | rounds τ binds | δ adapts | val_acc_proto, mean of last rounds | last round |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        trace = ", ".join(f"{v:.2f}" for v in r.get("D_t", [])) or "–"
        binds = r.get("capped_rounds")
        binds = "–" if binds is None else (", ".join(map(str, binds)) or "none")
        adapts = {True: "yes", False: "no"}.get(r.get("delta_adapts"), "–")
        lines.append(f"| {r['run']} | {trace} | {binds} | {adapts} | {r['val_window_mean']:.4f} "
                     f"(rounds {r['rounds_read'] - r['window']}-{r['rounds_read'] - 1}) | {r['val_last']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run parents (each holding seed100/)")
    ap.add_argument("--rounds", type=int, default=10, help="read the first ROUNDS rounds")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--seed", default="seed100")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = [summarise(Path(r) / a.seed, a.rounds, a.window) for r in a.runs]
    print(markdown(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
