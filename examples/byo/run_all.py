"""The bring-your-own example end to end: writes digits.npz, then runs FedAvg and FedProto with the CNN of mycnn.py
on the npz file and through the loader mydata:digits, on the sequential backend and on a local Ray cluster, and
prints the final accuracies. Run it from anywhere (it works inside this directory, which holds the user modules and
is neither installed nor on PYTHONPATH):

    python examples/byo/run_all.py [--rounds 10] [--backends sequential,ray] [--set train.local_epochs=1 ...]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(rounds: int = 10, backends=("sequential", "ray"), algorithms=("fedavg", "fedproto"),
        datasets=("npz", "loader"), out: str | None = None, verbose: bool = True, overrides=()) -> list[dict]:
    import raysim
    from raysim.engine.loop import run_experiment

    old = os.getcwd()
    os.chdir(HERE)  # the user's modules live in the working directory
    try:
        if "npz" in datasets and not Path("digits.npz").exists():
            import mydata  # noqa: E402  (found in the working directory)

            mydata.write_npz("digits.npz")
        rows = []
        for backend in backends:
            for algo in algorithms:
                for data in datasets:
                    ov = [f"rounds={rounds}", f"algorithm.name={algo}", f"backend.name={backend}", *overrides]
                    if data == "loader":
                        ov += ["data.dataset=mydata:digits", "data.root=null"]
                    cfg = raysim.load_config("digits.yaml", ov)
                    res = run_experiment(cfg, progress=False, write=out is not None,
                                         out_dir=None if out is None else f"{out}/{backend}-{algo}-{data}")
                    acc, sd = res.final("test_acc")
                    row = {"backend": backend, "algorithm": algo, "data": data, "test_acc": acc, "std": sd,
                           "table": res.table}
                    if algo == "fedproto":
                        row["test_acc_proto"] = res.final("test_acc_proto")[0]
                    rows.append(row)
                    if verbose:
                        extra = f"  (with prototypes {row['test_acc_proto']:.4f})" if "test_acc_proto" in row else ""
                        print(f"{backend:<10} {algo:<8} {data:<6} final mean test accuracy {acc:.4f} ± {sd:.4f}{extra}",
                              flush=True)
        return rows
    finally:
        os.chdir(old)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backends", default="sequential,ray")
    ap.add_argument("--out", default=None, help="write the run directories here (default: nothing written)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as raysim run's")
    args = ap.parse_args(argv)
    rows = run(args.rounds, tuple(args.backends.split(",")), out=args.out, overrides=tuple(args.set))
    from raysim.io.results import without_timing  # wall-time rows differ run to run

    by = {(r["backend"], r["algorithm"], r["data"]): without_timing(r["table"]).drop(columns="run_id") for r in rows}
    for (b, a, d), t in by.items():
        if d == "loader" and (b, a, "npz") in by:
            print(f"{b} {a}: npz and loader tables identical: {t.equals(by[(b, a, 'npz')])}")
        if b == "ray" and ("sequential", a, d) in by:
            print(f"{a} {d}: sequential and ray tables identical: {t.equals(by[('sequential', a, d)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
