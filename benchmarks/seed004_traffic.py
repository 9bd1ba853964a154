"""Seed 004 (SlaugFL): rounds to target accuracy and the traffic crossover — the round from which SlaugFL's one-time
setup traffic (preparation models up, prototypes, generator down) is repaid versus FedAvg — read from the result
tables of a ``raysim reproduce`` experiment (``<out>/<experiment>/<run slug>/seed<N>/``).

Every traffic number comes from the tables' own accounting (``raysim.io.results.communication``: ``setup`` = round -1
floats, ``per_round`` = mean floats per round, up + down, all clients); accuracy is the server metric
``global_test_acc`` (the global model on the full test set) at the evaluated rounds.

Crossover, per SlaugFL run and per seed: at SlaugFL's evaluated round n (rounds completed) with accuracy a, FedAvg
(same seed) needs n_F(a) rounds, the first evaluated round at which its accuracy reaches a. SlaugFL has sent
T_S(n) = setup + per_round_S * n floats, FedAvg T_F = per_round_F * n_F(a). The setup is repaid at n when
T_S(n) <= T_F; the crossover round is the first such n. When FedAvg never reaches a in its R rounds, T_F > per_round_F
* R, so n counts as repaid only if T_S(n) <= per_round_F * R (a lower bound; marked ">="). Targets for rounds-to-
target were fixed before the runs: 30 % (the seed's CIFAR-10 alpha = 0.05 target) and 50 %.

    PYTHONPATH=$PWD python benchmarks/seed004_traffic.py /work/runs/reproduce/slaugfl_fmnist_a005 \
        [--plot benchmarks/figures/seed004_fmnist_a005.png] [--md out.md]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raysim import results  # noqa: E402
from raysim.app.seed_experiments import load_experiments  # noqa: E402

TARGETS = (0.30, 0.50)
BASE = "FedAvg"


def load_run(path: Path) -> dict:
    df = results.load(path)
    acc = df[(df["scope"] == "server") & (df["metric"] == "global_test_acc") & (df["round"] >= 0)]
    acc = acc.sort_values("round")
    com = results.communication(df).set_index("metric")
    floats = lambda col: float(com.loc["up_floats", col] + com.loc["down_floats", col])  # noqa: E731
    rounds = int(df["round"].max()) + 1
    return {"n": (acc["round"].to_numpy() + 1).astype(int), "acc": acc["value"].to_numpy(float),
            "setup": floats("setup"), "per_round": floats("per_round"), "total": floats("total"), "rounds": rounds}


def first_reach(run: dict, a: float) -> float:
    hit = np.flatnonzero(run["acc"] >= a)
    return float(run["n"][hit[0]]) if len(hit) else math.nan


def repaid_rounds(s: dict, f: dict) -> list[tuple[int, bool]]:
    """SlaugFL's evaluated rounds n at which its traffic to accuracy a(n) is at most FedAvg's traffic to a(n), each
    with whether that rests on FedAvg never reaching a(n) within its rounds (a lower bound on FedAvg's traffic)."""
    out = []
    for n, a in zip(s["n"], s["acc"]):
        t_s = s["setup"] + s["per_round"] * n
        n_f = first_reach(f, a)
        if math.isnan(n_f):
            if t_s <= f["per_round"] * f["rounds"]:
                out.append((int(n), True))
        elif t_s <= f["per_round"] * n_f:
            out.append((int(n), False))
    return out


def crossover(s: dict, f: dict) -> tuple[float, bool]:
    """(the first repaid round, whether it is a lower-bound case); NaN when no evaluated round is repaid."""
    rep = repaid_rounds(s, f)
    return (float(rep[0][0]), rep[0][1]) if rep else (math.nan, False)


def fmt(vals, scale=1.0, digits=1) -> str:
    v = [x * scale for x in vals if not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "never"
    s = f"{np.mean(v):.{digits}f}"
    if len(v) > 1:
        s += f" ± {np.std(v, ddof=1):.{digits}f}"
    return s + (f" ({len(v)}/{len(vals)})" if len(v) < len(vals) else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exp_dir", help="<out>/<experiment> of raysim reproduce")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    exp_dir = Path(args.exp_dir)
    exp = load_experiments()[exp_dir.name]
    runs = {}
    for r in exp.runs:
        seeds = {}
        for d in sorted((exp_dir / r.slug).glob("seed*")):
            if (d / "results.parquet").exists():
                seeds[int(d.name[4:])] = load_run(d)
        if seeds:
            runs[r.label] = seeds
    lines = [f"Experiment `{exp.name}` ({exp_dir}); accuracy = global_test_acc, traffic in floats (up + down) from "
             f"results.communication; mean ± sample std over seeds.\n",
             "| method | seeds | acc at round 10 (%) | acc at round 50 (%) | acc at last round (%) | mean of the last 3 evaluations (%) | rounds to 30 % | rounds to 50 % | setup floats | floats / round "
             "| setup = FedAvg rounds | extra floats vs FedAvg over the run (seed eq. 18's R) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_pr = np.mean([r["per_round"] for r in runs[BASE].values()]) if BASE in runs else math.nan
    base_tot = np.mean([r["total"] for r in runs[BASE].values()]) if BASE in runs else math.nan
    for label, seeds in runs.items():
        rs = list(seeds.values())
        at = lambda r, n: float(r["acc"][list(r["n"]).index(n)]) if n in list(r["n"]) else math.nan  # noqa: E731
        cells = [label, str(len(rs)), fmt([at(r, 10) for r in rs], 100), fmt([at(r, 50) for r in rs], 100),
                 fmt([r["acc"][-1] for r in rs], 100), fmt([float(np.mean(r["acc"][-3:])) for r in rs], 100)]
        cells += [fmt([first_reach(r, t) for r in rs], 1, 1) for t in TARGETS]
        setup, pr = np.mean([r["setup"] for r in rs]), np.mean([r["per_round"] for r in rs])
        tot = np.mean([r["total"] for r in rs])
        cells += [f"{setup:,.0f}", f"{pr:,.0f}", f"{setup / base_pr:.1f}" if setup and np.isfinite(base_pr) else "0",
                  f"{100 * (tot - base_tot) / base_tot:+.1f} %" if np.isfinite(base_tot) else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    if BASE in runs:
        lines += ["", f"Traffic crossover versus {BASE} (first SlaugFL round n with setup + n x floats/round <= "
                      f"{BASE}'s floats to reach SlaugFL's round-n accuracy; per seed):", "",
                  "| method | per seed: first repaid round; evaluated rounds at which it is repaid | first repaid round, mean over seeds |", "|---|---|---|"]
        for label, seeds in runs.items():
            if not label.lower().startswith("slaugfl"):
                continue
            per = []
            for sd, r in sorted(seeds.items()):
                if sd not in runs[BASE]:
                    continue
                rep = repaid_rounds(r, runs[BASE][sd])
                per.append((sd, rep[0][0] if rep else math.nan, rep, len(r["n"])))
            cells = "; ".join(f"seed {sd}: " + ("never" if not rep else
                                               f"round {n:.0f}; repaid at {len(rep)}/{k} evaluated rounds ("
                                               + ", ".join(f"{m}" + ("*" if b else "") for m, b in rep) + ")")
                              for sd, n, rep, k in per)
            got = [n for _, n, _, _ in per if not math.isnan(n)]
            lines.append(f"| {label} | {cells} | {fmt(got, 1, 1) if got else 'never'} ({len(got)}/{len(per)}) |")
        lines.append("\n`*`: FedAvg never reached SlaugFL's accuracy of that round within its run; the comparison "
                     "uses FedAvg's whole run's traffic (a lower bound).")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.plot:
        plot(runs, args.plot, exp.name)


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, seeds in runs.items():
        rs = list(seeds.values())
        n = rs[0]["n"]
        accs = np.array([r["acc"] for r in rs if len(r["acc"]) == len(n)]) * 100
        m = accs.mean(0)
        sd = accs.std(0, ddof=1) if len(accs) > 1 else np.zeros_like(m)
        x_f = np.mean([r["setup"] for r in rs]) + np.mean([r["per_round"] for r in rs]) * n
        style = "-" if label.lower().startswith("slaugfl") else "--"
        for ax, x in ((axes[0], n), (axes[1], x_f)):
            ax.plot(x, m, style, marker="o", ms=3, label=label)
            ax.fill_between(x, m - sd, m + sd, alpha=0.12)
    axes[0].set_xlabel("rounds")
    axes[1].set_xlabel("floats communicated (up + down, setup included)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("global test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{title}: accuracy vs rounds (mean ± std over seeds)")
    axes[1].set_title("accuracy vs traffic")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
