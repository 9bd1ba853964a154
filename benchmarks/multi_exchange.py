"""Multi-exchange overhead (issue "Performance II", item 1): MAFML against a plain single-process PyTorch loop doing
the same work.

Setting: MAFML on Rotated MNIST M0/M20/M40/M60 (1,000 mnist5k base images, 100 per class, rotated per node), 4 LeNet
nodes, local split public 10 % / val 10 % / test 15 %, Adam lr 1e-3, weight decay 1e-4, batch 32, 50 iterations a
round. One iteration, per node: a private Adam step (CE on a random batch of x_train, its gradient kept as g_loc),
soft labels and batch accuracy of its model on a random batch of its public share; then per node a KL + CE step on
the other three nodes' public batches, projected against g_loc when they conflict (eq. 7), one Adam step.

* ``plain``: the loop above in one process: 4 models and 4 Adam optimisers kept alive, no messages, no state copies
  (the same maths: algorithms.mutual_ops).
* ``sequential`` / ``ray``: raysim's MAFML on the same data (``backend.name``; Ray with ``--actors`` client actors);
  seconds per iteration from the table's wall-time rows (``step_s@local + relay + global + sync``, the first round
  a warm-up and evaluation excluded).

Prints seconds per iteration and the ratio to the plain loop, the median over ``--repeat`` sittings that each time
the plain loop right before each raysim run (on a loaded machine the ratio within a sitting is what means
something); ``--profile FILE`` writes a cProfile of the (first) sequential run (relative shares).

    PYTHONPATH=$PWD python benchmarks/multi_exchange.py [--rounds 3] [--backends sequential,ray] [--actors 2] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from algorithms.mutual_ops import flat_grad, project_conflicting, set_flat_grad, weighted_kl

ITER = 50
STEPS = ("local", "relay", "global", "sync")


def config(rounds: int, backend: str, actors: int) -> dict:
    return {"name": "mx-mafml", "seed": 1, "rounds": rounds, "clients_per_round": 4,
            "data": {"dataset": "mnist5k", "num_clients": 4, "partition": "shared_base",
                     "partition_params": {"per_class": 100}, "rotations": [0, 20, 40, 60],
                     "local_split": {"public": 0.10, "val": 0.10, "test": 0.15}},
            "model": {"arch": "lenet"},
            "train": {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4, "batch_size": 32,
                      "persist_optimizer": True, "local_steps": ITER},
            "algorithm": {"name": "mafml", "params": {"iterations": ITER}},
            "eval": {"every": 1000},  # only the last round is evaluated
            "backend": {"name": backend, "num_actors": actors, "num_cpus": 1},
            "output": {"progress": False}}


def plain_loop(prep, iterations: int, warmup: int) -> float:
    """Seconds per iteration of the plain loop (after ``warmup`` iterations)."""
    task = prep.task
    cfg = task.train
    n = task.num_clients
    data = [c.to("cpu") for c in prep.fed_data.clients]  # decoded floats, as a plain script would hold them
    models = [task.build_model(i) for i in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay) for m in models]
    px, py = task.public.x.float(), task.public.y
    own = [torch.nonzero(task.public.owner == i).flatten() for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    b = cfg.batch_size
    t0 = None
    for it in range(warmup + iterations):
        if it == warmup:
            t0 = time.perf_counter()
        ups, g_locs = [], []
        for i, (m, opt, d) in enumerate(zip(models, opts, data)):
            idx = torch.randperm(d.num_train, generator=gen)[:b]
            m.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(d.x_train[idx]), d.y_train[idx]).backward()
            g_locs.append(flat_grad(m).detach().clone())
            opt.step()
            pick = own[i][torch.randperm(len(own[i]), generator=gen)[:b]]
            m.eval()
            with torch.no_grad():
                logits = m(px[pick])
            ups.append((float((logits.argmax(1) == py[pick]).float().mean()), pick, F.softmax(logits, dim=1)))
        for i, (m, opt) in enumerate(zip(models, opts)):
            teachers = [u for j, u in enumerate(ups) if j != i]
            m.train()
            opt.zero_grad(set_to_none=True)
            logits = [m(px[idx]) for _, idx, _ in teachers]
            kl = weighted_kl(logits, [p for _, _, p in teachers], [a for a, _, _ in teachers])
            ce = torch.stack([F.cross_entropy(s, py[idx]) for s, (_, idx, _) in zip(logits, teachers)]).mean()
            (kl + ce).backward()
            g, _ = project_conflicting(flat_grad(m), g_locs[i])
            set_flat_grad(m, g)
            opt.step()
    return (time.perf_counter() - t0) / iterations


def raysim_per_iteration(res) -> float:
    """Seconds per iteration from the wall-time rows: the exchanges of every round but the first. (An engine without
    these rows: the wall time of the rounds between the first and the evaluated last one; needs --rounds >= 3.)"""
    table = res.table
    t = table[(table["scope"] == "total") & (table["round"] >= 1)
              & table["metric"].isin([f"step_s@{s}" for s in STEPS])]
    if t.empty:
        middle = res.timing["round_s"][1:-1]
        return sum(middle) / (len(middle) * ITER)
    rounds = t["round"].nunique()
    return float(t["value"].sum()) / (rounds * ITER)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds of 50 iterations; the first is a warm-up")
    ap.add_argument("--backends", default="sequential,ray")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="sittings (plain loop, then raysim); the median is printed")
    ap.add_argument("--profile", default=None, help="write a cProfile of the sequential run here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from raysim.config import make_config
    from raysim.driver import prepare, run_experiment

    import statistics

    prep = prepare(make_config(config(args.rounds, "sequential", 1)))
    backends = [b for b in args.backends.split(",") if b]
    runs: dict = {b: [] for b in backends}  # (plain s/iter, raysim s/iter) per sitting
    for rep in range(args.repeat):
        for backend in backends:
            plain = plain_loop(prep, ITER * (args.rounds - 1), ITER)
            cfg = make_config(config(args.rounds, backend, args.actors))
            if backend == "sequential" and args.profile and rep == 0:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
                res = run_experiment(cfg, write=False)
                prof.disable()
                prof.dump_stats(args.profile)
            else:
                res = run_experiment(cfg, write=False)
            runs[backend].append((plain, raysim_per_iteration(res)))
    out = {b: {"sittings": v, "median_ratio": statistics.median(r / p for p, r in v)} for b, v in runs.items()}
    print("| variant | plain loop ms / iteration | raysim ms / iteration | x plain loop (per sitting) | median |")
    print("|---|---|---|---|---|")
    for backend in backends:
        label = f"raysim {backend}" + (f" ({args.actors} actors)" if backend == "ray" else "")
        v = runs[backend]
        print(f"| {label} | {', '.join(f'{1e3 * p:.1f}' for p, _ in v)} | {', '.join(f'{1e3 * r:.1f}' for _, r in v)} | "
              f"{', '.join(f'{r / p:.2f}' for p, r in v)} | {out[backend]['median_ratio']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
