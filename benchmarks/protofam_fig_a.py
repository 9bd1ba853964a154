"""Figure 5a: heterogeneous-model FL on Fashion-MNIST, 20 clients, Dirichlet alpha = 0.1, the 4-architecture zoo
(cnn_mnist, cnn4, resnet_small, mobilenet_small, cycled over clients): FedTGP, FedProto, LG-FedAvg, FedDistill, Local.
Prints mean ± std over seeds of the client test accuracy (sample-weighted over clients = HtFLlib's sum correct / sum
samples, at the final round and at the best round) and the floats communicated per round.

Scaled to a 2-core machine (the FedTGP paper uses CIFAR-10, HtFE8, 75/25 splits and up to 2000 rounds): each client's
training set is subsampled to ``--samples`` (default 200) images, local test sets have the client's label proportions
and 1/3 of its train size, ``--rounds`` (default 30) rounds, 1 local epoch, batch 10, SGD lr 0.01 (HtFLlib), all
clients every round; FedTGP server_epochs ``--server-epochs`` (default 100), tau 100, lambda 10 for FedTGP and FedProto.

    nice -n 10 python benchmarks/protofam_fig_a.py --seeds 1 2 3 --rounds 30 --samples 200
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protofam_common import default_workers, mean_std, run_grid  # noqa: E402

ZOO = [{"arch": "cnn_mnist", "params": {"out_channels": 20, "embed_dim": 50, "dropout": 0.0}},
       {"arch": "cnn4", "params": {"channels": 16, "hidden": 128, "embed_dim": 50}},
       {"arch": "resnet_small", "params": {"width": 8, "embed_dim": 50}},
       {"arch": "mobilenet_small", "params": {"width": 8, "embed_dim": 50}}]


def methods(server_epochs: int, lam: float, server_lr=None) -> dict:
    return {
        "FedTGP": ("fedtgp", {"lam": lam, "server_epochs": server_epochs, "margin_threshold": 100.0,
                              "restrict_local_classes": False, "server_lr": server_lr}),
        "FedProto": ("fedproto", {"lam": lam, "restrict_local_classes": False}),
        "LG-FedAvg": ("lgfedavg", {}),
        "FedDistill": ("feddistill", {"lam": 1.0}),
        "Local": ("local", {}),
    }


def config(label, algo, params, seed, args) -> dict:
    return {
        "name": f"fig5a-{label}", "seed": seed, "rounds": args.rounds,
        "data": {"dataset": "fashion_mnist", "num_clients": 20, "partition": "dirichlet",
                 "partition_params": {"alpha": 0.1, "samples_per_client": args.samples, "min_samples": 20,
                                      "test_ratio": 1 / 3}},
        "model": {"assign": "cycle", "per_client": ZOO},
        "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.01, "momentum": 0.0},
        "algorithm": {"name": algo, "params": params},
        "eval": {"every": args.eval_every},
        "backend": {"name": "sequential"},
        "output": {"progress": False},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--server-epochs", type=int, default=100)
    ap.add_argument("--lam", type=float, default=10.0)
    ap.add_argument("--server-lr", type=float, default=None, help="FedTGP server lr (default: the client lr, official)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None, help="run only these method labels")
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--log", default=None, help="JSON-lines log (default benchmarks/out/fig5a-r<rounds>-n<samples>.jsonl)")
    args = ap.parse_args(argv)
    meths = methods(args.server_epochs, args.lam, args.server_lr)
    if args.only:
        meths = {k: v for k, v in meths.items() if k in args.only}
    # seed-major order: a grid cut short still holds complete seeds
    cfgs = [config(label, a, p, s, args) for s in args.seeds for label, (a, p) in meths.items()]
    log = args.log or f"benchmarks/out/fig5a-r{args.rounds}-n{args.samples}-e{args.server_epochs}.jsonl"
    res = run_grid(cfgs, args.workers, Path(log))
    print(f"\nFashion-MNIST, 20 clients, Dir(0.1), zoo x4 cycled, {args.samples} train samples/client, "
          f"{args.rounds} rounds, seeds {args.seeds}")
    print("| method | acc final (%) | acc best (%) | classifier acc final (%) | up floats/round | down floats/round |")
    print("|---|---|---|---|---|---|")
    for label in meths:
        rs = [r for r in res if r["name"] == f"fig5a-{label}"]
        if not rs:
            continue
        key = "wmean:test_acc_proto" if "wmean:test_acc_proto" in rs[0]["metrics"] else "wmean:test_acc"
        fin = mean_std([r["metrics"][key]["final"] for r in rs])
        best = mean_std([r["metrics"][key]["best"] for r in rs])
        cls = mean_std([r["metrics"]["wmean:test_acc"]["final"] for r in rs])
        up = rs[0]["up_floats_per_round"]
        down = rs[0]["down_floats_per_round"]
        tag = " (nearest prototype)" if key.endswith("proto") else ""
        print(f"| {label}{tag} | {fin} | {best} | {cls} | {up:,.0f} | {down:,.0f} |")


if __name__ == "__main__":
    main()
