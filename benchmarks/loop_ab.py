"""The loop executor against its plain-PyTorch twin, interleaved round by round in one process (issue 48): on a
machine shared with other work, a ratio of two runs measured minutes apart says more about the load than about raysim.
Here raysim's sequential run (benchmarks/gpu.py's workload: cnn4, 50 images 3x32x32 a client, batch 10, one epoch,
FedAvg, 1 torch thread, the given numerics) runs one round, then a callback runs one round of the twin
(benchmarks/twin.py's PlainLoop, same cohort size) outside raysim's round timer, and so on; each raysim round is
paired with the twin round right after it. Reported: per run the median of the paired ratios (raysim / twin) over the
rounds after the first (the last, which evaluates, left out), and over all runs the median and the spread; by wall
time and by the process's CPU time (``time.process_time``: on a machine other processes load, the CPU time this
process spent is the steadier measure of its own work).

    PYTHONPATH=$PWD python benchmarks/loop_ab.py [--runs 3 --rounds 8 --clients 100 --cohort 20] [--model cnn4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--cohort", type=int, default=20)
    ap.add_argument("--model", default="cnn4", choices=["cnn4", "resnet18"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--numerics", default="portable", choices=["portable", "native"])
    args = ap.parse_args(argv)

    import torch

    import gpu
    import twin
    from raysim import numerics, register_dataset
    from raysim.config import make_config
    from raysim.engine.callbacks import Callback
    from raysim.engine.loop import run_experiment
    from raysim.models import cnn4, resnet18

    register_dataset("cifar_twin", "benchmarks.gpu:cifar_twin")
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    numerics.enter(args.numerics, device)
    data = gpu.cifar_twin(None, args.clients)
    x, y = twin.client_tensors(data["x_train"], data["y_train"], args.clients, 50, device)
    build = {"cnn4": lambda: cnn4((3, 32, 32), 10), "resnet18": lambda: resnet18((3, 32, 32), 10)}[args.model]
    torch.manual_seed(0)
    plain = twin.PlainLoop(build().to(device), twin.Work(x, y))
    gen = torch.Generator().manual_seed(1)
    plain.round(torch.randperm(args.clients, generator=gen)[:args.cohort].tolist())  # warm (torch.optim's imports)

    class TwinRound(Callback):
        def __init__(self):
            self.times, self.cpu, self.raysim_cpu = [], [], []
            self.mark = time.process_time()

        def on_run_start(self, run):
            self.mark = time.process_time()

        def on_setup_end(self, run):
            self.mark = time.process_time()

        def on_round_end(self, run, round_idx, evaluated):
            c0 = time.process_time()
            self.raysim_cpu.append(c0 - self.mark)  # raysim's round (and the engine's work between rounds)
            ids = torch.randperm(args.clients, generator=gen)[:args.cohort].tolist()
            t0 = time.perf_counter()
            plain.round(ids)
            self.times.append(time.perf_counter() - t0)
            self.mark = time.process_time()
            self.cpu.append(self.mark - c0)

    backend = {"torch_threads": args.threads, "device": "cpu", "numerics": args.numerics}
    cfg = make_config(gpu.config(args.model, args.clients, args.cohort, args.rounds, None, backend))
    per_run, pairs, per_run_cpu, pairs_cpu = [], [], [], []
    for r in range(args.runs):
        cb = TwinRound()
        res = run_experiment(cfg, write=False, progress=False, callbacks=[cb])
        rs = res.timing["round_s"]
        ratios = [a / b for a, b in zip(rs[1:-1], cb.times[1:-1])]
        cpu = [a / b for a, b in zip(cb.raysim_cpu[1:-1], cb.cpu[1:-1])]
        pairs += ratios
        pairs_cpu += cpu
        per_run.append(statistics.median(ratios))
        per_run_cpu.append(statistics.median(cpu))
        print(json.dumps({"run": r, "raysim_s": [round(v, 4) for v in rs], "twin_s": [round(v, 4) for v in cb.times],
                          "raysim_cpu_s": [round(v, 4) for v in cb.raysim_cpu],
                          "twin_cpu_s": [round(v, 4) for v in cb.cpu],
                          "median_ratio": round(per_run[-1], 4), "median_cpu_ratio": round(per_run_cpu[-1], 4)}),
              flush=True)
    for what, runs, allp in (("wall", per_run, pairs), ("CPU", per_run_cpu, pairs_cpu)):
        print(f"raysim loop / twin ({args.model}, {args.numerics}, {args.threads} thread(s)), {what} time: median of "
              f"runs {statistics.median(runs):.3f} (runs {', '.join(f'{v:.3f}' for v in runs)}); median of all "
              f"{len(allp)} paired rounds {statistics.median(allp):.3f}", flush=True)


if __name__ == "__main__":
    main()
