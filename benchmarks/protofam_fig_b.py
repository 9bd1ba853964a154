"""Figure 5b: the seed's semi-supervised table (000, Fig. 4, MNIST rows) on ``mnist5k``: FedProto and FedAvg with the
FedPU loss, positive_rate in {1, 0.5, 0.2, 0.1} x pu_weight in {0, 0.5, 1}, n = 3 ways, printed next to the seed's
numbers.

Scaled setting (the seed: full MNIST, k = 100 shots, 100 rounds): mnist5k (400 train / 100 test images per class),
20 clients, FedProto's n-way k-shot split with ways = 3, stdev = 2 (n_i in 2..5), shots = 25 (k_i in 24..25), 15 local test
images per held class (test sets may overlap across clients), FedProto's CNN (cnn_mnist, 20 channels, embedding 50),
1 local epoch, batch 4, SGD lr 0.01 momentum 0.5 (FedProto's defaults), ``--rounds`` rounds (default 30), all clients
every round. positive_rate = 1 hides no label, so the PU term is zero and one run serves every pu_weight.
Accuracy: the mean over clients of local test accuracy at the final round (FedProto: its own classifier, "w/o
protos"; the nearest-prototype accuracy among the client's classes is printed too).

    nice -n 10 python benchmarks/protofam_fig_b.py --seeds 1 --rounds 30

``--split official`` (issue 10, the seed's setting: "each client can label a limited amount of data only in part of
its classes"): FedPU's ``puSpilt_index`` — a seeded subset of ``--labelled-classes`` (default 2) of the client's 3
classes is positive, a positive class keeps floor(rate * n_c) labels when n_c >= ``--min-class`` (FedPU's 40 for its
100+ images per class; scaled here to 10 for k = 25 shots: 40 x 25 / 100), every other sample is unlabelled, and the
indicator m covers all 10 classes. There is unlabelled data even at rate 1 (the non-positive class), so every
(rate, pu_weight) cell is its own run.

    nice -n 10 python benchmarks/protofam_fig_b.py --split official --seeds 1 2 3 --rounds 30
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protofam_common import default_workers, mean_std, run_grid  # noqa: E402

RATES = [1.0, 0.5, 0.2, 0.1]
WEIGHTS = [0.0, 0.5, 1.0]
# seed 000, Fig. 4, MNIST (n = 3): method -> pu_weight -> accuracy (%) at positive_rate 1, 0.5, 0.2, 0.1
SEED = {
    "fedproto": {0.0: [98.392, 97.156, 94.053, 91.433], 0.5: [98.392, 96.935, 92.808, 89.447],
                 1.0: [98.392, 96.076, 90.21, 84.488]},
    "fedavg": {0.0: [98.282, 79.328, 78.145, 74.909], 0.5: [98.282, 82.046, 79.329, 75.19],
               1.0: [98.282, 84.769, 81.884, 76.737]},
}


def config(algo, rate, weight, seed, rounds, split="held", labelled_classes=2, min_class=10) -> dict:
    params = {"positive_rate": rate, "pu_weight": weight}
    if split == "official":
        params.update({"pu_split": "official", "labelled_classes": labelled_classes, "pu_min_class": min_class})
    if algo == "fedproto":
        params.update({"lam": 1.0, "restrict_local_classes": True})
    return {
        "name": f"fig5b-{algo}-r{rate}-w{weight}" + ("" if split == "held" else f"-{split}{labelled_classes}m{min_class}"),
        "seed": seed, "rounds": rounds,
        "data": {"dataset": "mnist5k", "num_clients": 20, "partition": "nway_kshot",
                 "partition_params": {"ways": 3, "shots": 25, "stdev": 2, "test_shots": 15, "test_overlap": True},
                 "test_fraction": 0.2},
        "model": {"arch": "cnn_mnist", "params": {"out_channels": 20, "embed_dim": 50}},
        "train": {"local_epochs": 1, "batch_size": 4, "lr": 0.01, "momentum": 0.5},
        "algorithm": {"name": algo, "params": params},
        "eval": {"every": rounds},
        "backend": {"name": "sequential"},
        "output": {"progress": False},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--split", choices=["held", "official"], default="held")
    ap.add_argument("--labelled-classes", type=int, default=2)
    ap.add_argument("--min-class", type=int, default=10)
    ap.add_argument("--log", default=None, help="JSON-lines log (default benchmarks/out/fig5b-r<rounds>.jsonl)")
    args = ap.parse_args(argv)
    cells = {}
    cfgs = []
    for algo in ("fedproto", "fedavg"):
        for rate in RATES:
            for w in WEIGHTS:
                # rate 1 with every held class labelled: the PU term vanishes, one run serves every weight
                run_w = 1.0 if rate >= 1.0 and args.split == "held" else w
                extra = (args.split, args.labelled_classes, args.min_class)
                cells[(algo, rate, w)] = config(algo, rate, run_w, 0, 1, *extra)["name"]
                for s in args.seeds:
                    c = config(algo, rate, run_w, s, args.rounds, *extra)
                    if all((c["name"], c["seed"]) != (x["name"], x["seed"]) for x in cfgs):
                        cfgs.append(c)
    res = run_grid(cfgs, args.workers, Path(args.log or f"benchmarks/out/fig5b-r{args.rounds}"
                                                                 f"{'' if args.split == 'held' else '-' + args.split}.jsonl"))
    by = {}
    for r in res:
        by.setdefault(r["name"], []).append(r)
    split = ("" if args.split == "held" else f", pu_split official ({args.labelled_classes} labelled classes per "
             f"client, n_c >= {args.min_class})")
    print(f"\nmnist5k, 20 clients, ways 3, shots 25, {args.rounds} rounds, seeds {args.seeds}{split}; "
          f"ours (seed 000 in brackets), accuracy %")
    print("| method | pu_weight | " + " | ".join(f"rate {r:g}" for r in RATES) + " |")
    print("|---|---|" + "---|" * len(RATES))
    for algo in ("fedproto", "fedavg"):
        for w in WEIGHTS:
            row = []
            for j, rate in enumerate(RATES):
                rs = by[cells[(algo, rate, w)]]
                row.append(f"{mean_std([x['metrics']['mean:test_acc']['final'] for x in rs])} ({SEED[algo][w][j]:.1f})")
            print(f"| {algo} | {w:g} | " + " | ".join(row) + " |")
    print("\nFedProto nearest-prototype accuracy (client's own classes), %")
    for w in WEIGHTS:
        row = [mean_std([x["metrics"]["mean:test_acc_proto"]["final"] for x in by[cells[("fedproto", rate, w)]]])
               for rate in RATES]
        print(f"| fedproto (proto) | {w:g} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
