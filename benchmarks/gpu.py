"""pfl-research's CIFAR-10 benchmark shape on raysim (issue "GPU-first execution", item 6): clients of 50 images
3x32x32, a cohort per round, batch 10, one local epoch, FedAvg; cnn4 and ResNet-18. CIFAR-10 when it is under
``--root`` (torchvision's ``cifar-10-batches-py``), a synthetic twin of the same shape otherwise (the speed is the
same). Reported per workload and variant: seconds per round (median after the first round), client updates per
second, time per local step, and on a GPU its utilisation and peak memory (NVML when pynvml is installed; torch's
allocator peak always). Variants: sequential; Ray with one actor; on a GPU the fraction sweep (1, 0.5, 0.25, 0.125
GPU per actor: 1, 2, 4, 8 actors); for cnn4 also the vectorised executor (``backend.vectorize``). On a machine
without a GPU it says "no GPU" and runs the CPU rows (the same
threads for sequential and Ray: ``backend.torch_threads``), which give the Ray-vs-sequential ratio.

Beside raysim's rows, in the same process and sitting, its plain-PyTorch twins (benchmarks/twin.py): the
hand-written per-client loop (both models) and, for cnn4, the cohort as one ``vmap`` (on a GPU also at cohorts 200
and 1,000), then the ratios raysim / twin. Work counted instead of timed: benchmarks/op_count.py.

    python benchmarks/gpu.py [--clients 1000 --cohort 50 --rounds 5] [--models cnn4 resnet18] [--json out.json]
    python benchmarks/gpu.py --clients 100 --cohort 20 --rounds 4        # a 2-core CPU machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def cifar_twin(root, clients: int = 100):
    """CIFAR-10's shape (3x32x32 float images, 10 classes) as Gaussian class clusters: enough images for ``clients``
    clients of 50 (and 10 test images each)."""
    import numpy as np

    rng = np.random.default_rng(0)
    per = 5 * clients + 10
    centres = rng.normal(size=(10, 3 * 32 * 32)).astype(np.float32)

    def make(n):
        y = np.repeat(np.arange(10), n)
        x = centres[y] + rng.normal(size=(len(y), 3 * 32 * 32)).astype(np.float32)
        return x.reshape(-1, 3, 32, 32), y.astype(np.int64)

    xtr, ytr = make(per)
    xte, yte = make(clients + 1)
    return {"x_train": xtr, "y_train": ytr, "x_test": xte, "y_test": yte, "num_classes": 10}


def config(model: str, clients: int, cohort: int, rounds: int, root, backend: dict) -> dict:
    data = ({"dataset": "cifar10", "root": root} if root and (Path(root) / "cifar-10-batches-py").is_dir() else
            {"dataset": "cifar_twin", "dataset_params": {"clients": clients}})
    data.update({"num_clients": clients, "partition": "iid",
                 "partition_params": {"samples_per_client": 50, "test_per_client": 10}})
    arch = {"cnn4": {"arch": "cnn4"}, "resnet18": {"arch": "resnet18"}}[model]
    return {"name": f"gpu-{model}", "seed": 1, "rounds": rounds, "clients_per_round": cohort, "data": data,
            "model": arch, "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.05, "momentum": 0.9},
            "algorithm": {"name": "fedavg"}, "eval": {"every": rounds},
            "backend": {"name": "sequential", **backend}, "output": {"progress": False}}


class GpuSampler:
    """NVML utilisation samples every 50 ms while a run is on (None without pynvml or a GPU)."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.h, self.nv = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:
            self.h = None

    def __enter__(self):
        if self.h is not None:
            self.t = threading.Thread(target=self._run, daemon=True)
            self.t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            u = self.nv.nvmlDeviceGetUtilizationRates(self.h)
            m = self.nv.nvmlDeviceGetMemoryInfo(self.h)
            self.samples.append((u.gpu, m.used))

    def __exit__(self, *exc):
        self._stop.set()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {"gpu_util_pct_mean": statistics.mean(s[0] for s in self.samples),
                "gpu_mem_used_mb_max": max(s[1] for s in self.samples) / 2**20}


def _store_mb(meta) -> float | None:
    """Mean MB of training traffic through Ray's object store per round (payload reads + uploads)."""
    rows = [r for r in meta.get("object_store_bytes", []) if r["round"] >= 0]
    return statistics.mean((r["train_down"] + r["train_up"]) / 1e6 for r in rows) if rows else None


def _model_mb(cfg) -> float:
    from raysim.engine.prepare import prepare
    from raysim.messages import tensor_bytes

    return tensor_bytes(prepare(cfg).task.build_model(0).state_dict()) / 1e6


def twin_rows(model: str, args, device) -> list[dict]:
    """The plain-PyTorch twins (benchmarks/twin.py) on the same work, in this process: the per-client loop, and for
    cnn4 the cohort as one vmap at this cohort (on a GPU also at 200 and 1,000 clients a round)."""
    import torch

    import twin
    from raysim.models import cnn4, resnet18

    data = cifar_twin(None, args.clients)
    x, y = twin.client_tensors(data["x_train"], data["y_train"], args.clients, 50, device)
    work = twin.Work(x, y)
    build = {"cnn4": lambda: cnn4((3, 32, 32), 10), "resnet18": lambda: resnet18((3, 32, 32), 10)}[model]
    variants = [("plain loop (twin)", args.cohort, lambda: twin.PlainLoop(build().to(device), work))]
    if model == "cnn4":
        cohorts = [args.cohort] + ([c for c in (200, 1000) if c <= args.clients and c != args.cohort]
                                   if device.type == "cuda" else [])
        variants += [(f"vmap cohort {c} (twin)", c, lambda: twin.VmapCohort(build().to(device), work))
                     for c in cohorts]
    rows = []
    for name, cohort, make in variants:
        torch.manual_seed(0)
        runner, gen = make(), torch.Generator().manual_seed(1)
        times = []
        for _ in range(args.rounds):
            ids = torch.randperm(args.clients, generator=gen)[:cohort].tolist()
            _sync(device)
            t0 = time.perf_counter()
            runner.round(ids)
            _sync(device)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times[1:]) if len(times) > 1 else times[0]
        out = {"model": model, "variant": name, "cohort": cohort, "s_round": s, "client_updates_per_s": cohort / s,
               "ms_per_step": 1e3 * s / (cohort * 5)}
        print(json.dumps(out), flush=True)
        rows.append(out)
    return rows


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def ratios(rows: list[dict], model: str) -> list[str]:
    """raysim's rows over their twins (seconds per round at the same cohort: > 1 is slower than the twin)."""
    def row(v):
        return next((r for r in rows if r["model"] == model and r["variant"] == v and "error" not in r), None)

    out = []
    plain, seq = row("plain loop (twin)"), row("sequential")
    vm, vec = row(f"vmap cohort {seq['cohort'] if seq else 0} (twin)"), row("sequential, vectorised")
    ray1 = row("ray 1 actor, partial aggregates")
    if plain and seq:
        out.append(f"{model}: sequential (loop executor) / plain loop = {seq['s_round'] / plain['s_round']:.2f} "
                   f"({seq['client_updates_per_s'] / plain['client_updates_per_s']:.2f}x its client updates/s)")
    if ray1 and seq:
        out.append(f"{model}: Ray (1 actor) / sequential = {ray1['s_round'] / seq['s_round']:.2f}")
    if vm and vec:
        out.append(f"{model}: vectorised executor / vmap twin = {vec['s_round'] / vm['s_round']:.2f} "
                   f"({vec['client_updates_per_s'] / vm['client_updates_per_s']:.2f}x its client updates/s)")
    return out


def one(model, variant, backend, args) -> dict:
    """One variant's row; a variant that fails is a row with its error (the others still run)."""
    import traceback

    try:
        return _one(model, variant, backend, args)
    except Exception as e:
        traceback.print_exc()
        out = {"model": model, "variant": variant, "error": f"{type(e).__name__}: {e}", "s_round": float("nan")}
        print(json.dumps(out), flush=True)
        return out


def _one(model, variant, backend, args) -> dict:
    import torch

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    cfg = make_config(config(model, args.clients, args.cohort, args.rounds, args.root, backend))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with GpuSampler() as gs:
        res = run_experiment(cfg, write=False, progress=False)
    wall = time.perf_counter() - t0
    s = statistics.median(res.timing["round_s"][1:]) if args.rounds > 1 else res.timing["round_s"][0]
    steps = 5  # 50 images, batch 10, one epoch
    out = {"model": model, "variant": variant, "cohort": args.cohort, "s_round": s,
           "client_updates_per_s": args.cohort / s,
           "ms_per_step": 1e3 * s / (args.cohort * steps), "wall_s": wall, "final_test_acc": res.final()[0],
           "object_store_mb_per_round": _store_mb(res.metadata), "model_mb": _model_mb(cfg), **gs.summary()}
    if torch.cuda.is_available():
        out["torch_peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["cnn4", "resnet18"])
    ap.add_argument("--root", default=None)
    ap.add_argument("--threads", type=int, default=1, help="backend.torch_threads of every variant")
    ap.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.5, 0.25, 0.125])
    ap.add_argument("--numerics", default="portable", choices=["portable", "native"],
                    help="backend.numerics of every variant (portable: deterministic CUDA kernels, no TF32)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-twin", action="store_true", help="skip the plain-PyTorch twins (benchmarks/twin.py)")
    args = ap.parse_args(argv)
    import torch

    from raysim import register_dataset

    register_dataset("cifar_twin", "benchmarks.gpu:cifar_twin")
    gpu = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'no GPU (CPU rows only)'}", flush=True)
    # the loop executor's rows say so (vectorize: auto, the default, batches on a GPU: the vectorised rows ask for it)
    common = {"torch_threads": args.threads, "device": "cuda" if gpu else "cpu", "numerics": args.numerics,
              "vectorize": False}
    on_ray = dict(common, device="auto")  # the client actors see their GPU share; the server actor (no share) the CPU
    rows = []
    device = torch.device("cuda" if gpu else "cpu")
    torch.set_num_threads(args.threads)  # the twins run in this process, with the variants' thread count ...
    from raysim import numerics

    numerics.enter(args.numerics, device)  # ... and the variants' kernels (portable: ATen's own convolutions, MKL's
    # cross-vendor branch, deterministic CUDA kernels; a process keeps one mode, so raysim's sequential rows share it)
    for model in args.models:
        if not args.no_twin:
            rows += twin_rows(model, args, device)
        rows.append(one(model, "sequential", dict(common), args))
        rows.append(one(model, "ray 1 actor, an upload per client", dict(
            on_ray, name="ray", num_actors=1, num_cpus=1, num_gpus=1.0 if gpu else 0.0, partial_aggregate=False), args))
        ray1 = rows[-1]
        rows.append(one(model, "ray 1 actor, partial aggregates", dict(  # the default (auto) with one actor
            on_ray, name="ray", num_actors=1, num_cpus=1, num_gpus=1.0 if gpu else 0.0), args))
        try:  # ResNet-18 needs the vectorised executor's BatchNorm support (a ConfigError names the key without it)
            rows.append(one(model, "sequential, vectorised", dict(common, vectorize=True), args))
        except Exception as e:
            print(f"{model}: sequential, vectorised: not run ({type(e).__name__}: {e})", flush=True)
        if gpu:  # issue 49: the fraction sweep with the batched executor on each actor (where fractions still help)
            for f in args.fractions:
                n = int(round(1 / f))
                rows.append(one(model, f"ray {n} x {f:g} GPU, vectorised, partial aggregates", dict(
                    on_ray, name="ray", num_actors=n, num_cpus=1, num_gpus=f, partial_aggregate=True,
                    vectorize=True), args))
        seq = next(r for r in rows if r["model"] == model and r["variant"] == "sequential")
        part = next(r for r in rows if r["model"] == model and r["variant"] == "ray 1 actor, partial aggregates")
        print(f"{model}: Ray (1 actor) / sequential = {part['s_round'] / seq['s_round']:.2f} (the default: partial "
              f"aggregates); an upload per client {ray1['s_round'] / seq['s_round']:.2f}", flush=True)
        for line in ratios(rows, model):
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
