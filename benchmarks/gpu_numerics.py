"""What holds of "same seed, same table" on a GPU (issue "Same table on any machine", item 5).

The quick start (``configs/fedproto_mnist5k.yaml``: FedProto, 20 clients, cnn_mnist) for ``--rounds`` rounds, evaluated
every round, sequential backend, each run in a fresh process (a process computes in one numerics mode), the runs
side by side:

- ``cuda-portable`` twice: deterministic algorithms, no TF32, cuBLAS workspace pinned (what ``portable`` sets) — must
  give the same table bit for bit, run to run;
- ``cuda-native`` twice: torch's defaults on the GPU (cuDNN may autotune, TF32 allowed where torch allows it) —
  whether it is run-to-run identical is reported, not assumed;
- ``cuda-portable-vectorised`` twice: the vectorised executor on the GPU (the path that crashed before);
- ``cpu-portable`` once: the same config on the CPU, the table every other machine gives in portable mode.

Reported: per pair whether the tables are identical; the largest difference of any client's test accuracy, loss and
prototype metric between the GPU and the CPU table (the stated tolerance); the final mean accuracies; wall times.
Without a GPU only the CPU run and the CUDA-less checks run.

    python benchmarks/gpu_numerics.py --rounds 20 --out /tmp/gpu_numerics
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name: (device, numerics, vectorize)
    "cuda-portable": ("cuda", "portable", False),
    "cuda-native": ("cuda", "native", False),
    "cuda-portable-vectorised": ("cuda", "portable", True),
    "cpu-portable": ("cpu", "portable", False),
}


def child(name: str, rounds: int, out: Path, tag: str) -> None:
    sys.path.insert(0, str(ROOT))
    import yaml

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment
    from raysim.io.tables import without_timing

    device, numerics, vectorize = VARIANTS[name]
    cfg = yaml.safe_load((ROOT / "configs" / "fedproto_mnist5k.yaml").read_text())
    cfg.update(rounds=rounds, eval={"every": 1}, output={"progress": False})
    cfg["backend"] = {"name": "sequential", "device": device, "numerics": numerics, "vectorize": vectorize}
    t0 = time.perf_counter()
    res = run_experiment(make_config(cfg), write=False, progress=False)
    wall = time.perf_counter() - t0
    table = without_timing(res.table).drop(columns=["run_id"])
    path = out / f"{name}.{tag}.parquet"
    table.to_parquet(path, index=False)
    digest = hashlib.sha256(table.to_csv(index=False).encode()).hexdigest()[:16]
    (out / f"{name}.{tag}.json").write_text(json.dumps({"wall_s": wall, "final_acc": res.final()[0], "digest": digest,
                                                        "numerics": res.metadata.get("numerics")}))


def spawn(name: str, rounds: int, out: Path, tag: str) -> dict:
    for suffix in ("parquet", "json"):  # never compare a table left by an earlier invocation
        (out / f"{name}.{tag}.{suffix}").unlink(missing_ok=True)
    env = dict(os.environ)
    if VARIANTS[name][1] == "native":
        env["RAYSIM_NUMERICS"] = "native"
    r = subprocess.run([sys.executable, __file__, "--child", name, "--tag", tag, "--rounds", str(rounds),
                        "--out", str(out)], env=env, capture_output=True, text=True)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-2000:]}
    return json.loads((out / f"{name}.{tag}.json").read_text())


def differences(a, b) -> dict:
    """The largest |a - b| per client metric (rows matched by round, client and metric)."""
    keys = ["round", "client_id", "scope", "metric"]
    m = a.merge(b, on=keys, suffixes=("_a", "_b"))
    m = m[m["scope"] == "client"] if "scope" in m.columns else m
    out = {}
    for metric, g in m.groupby("metric"):
        d = (g["value_a"].astype(float) - g["value_b"].astype(float)).abs()
        out[metric] = float(d.max())
    return {k: v for k, v in out.items() if v}  # counts and bytes are equal everywhere: only what differs


def curve_difference(a, b, metric: str = "test_acc") -> dict:
    """The clients' mean ``metric`` per evaluated round in both tables: its largest |a - b| and the last round's."""
    def curve(t):
        return t[(t["scope"] == "client") & (t["metric"] == metric)].groupby("round")["value"].mean()

    d = (curve(a) - curve(b)).abs().dropna()
    return {"max_over_rounds": float(d.max()), "final": float(d.iloc[-1])} if len(d) else {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default="gpu_numerics")
    ap.add_argument("--child", default=None)
    ap.add_argument("--tag", default="a")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args.child, args.rounds, out, args.tag)
    import pandas as pd
    import torch

    gpu = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'no GPU'}; torch {torch.__version__}", flush=True)
    runs = [("cpu-portable", "a")]
    if gpu:
        runs += [(n, t) for n in ("cuda-portable", "cuda-native", "cuda-portable-vectorised") for t in ("a", "b")]
    summary = {"gpu": torch.cuda.get_device_name(0) if gpu else None, "torch": torch.__version__,
               "rounds": args.rounds, "runs": {}, "same": {}, "vs_cpu": {}}
    with ThreadPoolExecutor(len(runs)) as pool:  # fresh processes side by side: one GPU, its own numbers each
        done = dict(zip(runs, pool.map(lambda nt: spawn(nt[0], args.rounds, out, nt[1]), runs)))
    for (name, tag), r in done.items():
        summary["runs"][f"{name}.{tag}"] = r
        print(name, tag, json.dumps(r)[:400], flush=True)

    def table(name, tag):
        p = out / f"{name}.{tag}.parquet"
        ok = f"{name}.{tag}" in summary["runs"] and "error" not in summary["runs"][f"{name}.{tag}"]
        return pd.read_parquet(p) if ok and p.exists() else None

    for name in ("cuda-portable", "cuda-native", "cuda-portable-vectorised"):
        a, b = table(name, "a"), table(name, "b")
        if a is not None and b is not None:
            summary["same"][name] = bool(a.equals(b))
            if not a.equals(b):
                summary["same"][name + " max diff"] = {"per_client_max": differences(a, b),
                                                       "mean_test_acc": curve_difference(a, b)}
    cpu = table("cpu-portable", "a")
    for name in ("cuda-portable", "cuda-native", "cuda-portable-vectorised"):
        a = table(name, "a")
        if a is not None and cpu is not None:
            summary["vs_cpu"][name] = {"per_client_max": differences(a, cpu),
                                       "mean_test_acc": curve_difference(a, cpu),
                                       "mean_test_acc_proto": curve_difference(a, cpu, "test_acc_proto")}
    print(json.dumps({k: summary[k] for k in ("same", "vs_cpu")}, indent=1), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
