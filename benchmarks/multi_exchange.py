"""Multi-exchange overhead (issue "Performance II", item 1): MAFML, PN-ICFL and FedMD against plain single-process
PyTorch loops doing the same work (``--methods mafml,pnicfl,fedmd``).

Setting: MAFML on Rotated MNIST M0/M20/M40/M60 (1,000 mnist5k base images, 100 per class, rotated per node), 4 LeNet
nodes, local split public 10 % / val 10 % / test 15 %, Adam lr 1e-3, weight decay 1e-4, batch 32, 50 iterations a
round. One iteration, per node: a private Adam step (CE on a random batch of x_train, its gradient kept as g_loc),
soft labels and batch accuracy of its model on a random batch of its public share; then per node a KL + CE step on
the other three nodes' public batches, projected against g_loc when they conflict (eq. 7), one Adam step.

* ``plain``: the loop above in one process: 4 models and 4 Adam optimisers kept alive, no messages, no state copies
  (the same maths: algorithms.mutual_maths).
* ``sequential`` / ``ray``: raysim's MAFML on the same data (``backend.name``; Ray with ``--actors`` client actors);
  seconds per iteration from the table's wall-time rows (``step_s@local + relay + global``, the first round
  a warm-up and evaluation excluded).

PN-ICFL (``pnicfl``): the seed's general setting (configs/seed001_pnicfl/table3_general_pnicfl.yaml: 48 users x
1,000 rotated Fashion-MNIST images, 2-fc body, every user every round, E = 1 epoch of B = 2 episodes of 5 x (5 + 5)).
One round = two exchanges: ``embed`` (download theta, embed all local data, per-class means and counts), server
E-step, ``update`` (episodic training from the downloaded theta), server M-step and FedAvg of theta. The plain twin:
one live body, the same pure functions (algorithms.pnicfl), no messages, no client state. Unit: one round.

FedMD (``fedmd``): MAFML's Rotated MNIST nodes (4 LeNets, public alpha 10 %); one round = ``logits`` on the alignment
set (the whole public set here), consensus, ``digest`` (1 epoch of L1 regression at batch 256, Adam) then 50
private Adam steps at batch 32. The plain twin: 4 live models with their two Adam optimisers. Unit: one round.

Prints seconds per iteration and the ratio to the plain loop, the median over ``--repeat`` sittings that each time
the plain loop right before each raysim run (on a loaded machine the ratio within a sitting is what means
something); ``--profile FILE`` writes a cProfile of the (first) sequential run (relative shares).

    PYTHONPATH=$PWD python benchmarks/multi_exchange.py [--methods mafml,pnicfl,fedmd] [--rounds 3]
        [--backends sequential,ray] [--actors 2] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from algorithms.mutual_maths import flat_grad, project_conflicting, set_flat_grad, weighted_kl

ITER = 50
STEPS = ("local", "relay", "global")


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


CONFIGS = {"pnicfl": "configs/seed001_pnicfl/table3_general_pnicfl.yaml", "fedmd": "configs/seed003_mafml/fedmd.yaml"}
STEPS_OF = {"mafml": STEPS, "pnicfl": ("embed", "assign", "update", "aggregate"),
            "fedmd": ("logits", "consensus", "digest", "next_round")}
UNIT = {"mafml": "iteration", "pnicfl": "round", "fedmd": "round"}


def make(method: str, rounds: int, backend: str, actors: int, extra=()):
    from pathlib import Path

    from raysim.config import load_config, make_config

    if method == "mafml":
        return make_config(config(rounds, backend, actors), list(extra))
    root = Path(__file__).resolve().parents[1]
    return load_config(root / CONFIGS[method], [f"rounds={rounds}", f"backend.name={backend}",
                                               f"backend.num_actors={actors}", "backend.num_cpus=1", "eval.every=1000",
                                               "output.progress=false", "name=mx-" + method, *extra])


def plain_pnicfl(prep, rounds: int, warmup: int) -> float:
    """Seconds per round of the plain PN-ICFL loop (after ``warmup`` rounds): every user every round."""
    import numpy as np

    from algorithms.pnicfl_maths import (body_state, e_step, embed_all, episode_losses, kmeans_init, m_step,
                                   sample_episode, user_embedding)
    from raysim.training import make_optimizer

    task = prep.task
    cfg, p = task.train, prep.algorithm.params
    c = task.num_classes
    data = [cl.to("cpu") for cl in prep.fed_data.clients]
    model = task.build_model(0)
    theta = body_state(model)
    k = p.num_clusters
    E, mask = torch.zeros(k, c, model.embed_dim), torch.zeros(k, c, dtype=torch.bool)
    rng = np.random.default_rng(1)
    classes = [sorted(torch.unique(d.y_train).tolist()) for d in data]
    t0 = None
    for r in range(warmup + rounds):
        if r == warmup:
            t0 = time.perf_counter()
        us, counts = [], []
        for d in data:  # embed
            model.body.load_state_dict(theta)
            u, cnt = user_embedding(embed_all(model.body, d.x_train), d.y_train, c)
            us.append(u)
            counts.append(cnt)
        u, counts = torch.stack(us), torch.stack(counts)
        if r == 0:
            E, mask, _ = kmeans_init(u, counts, k, rng, p.init, p.init_restarts)
        s = e_step(u, counts, E, mask)
        thetas, sizes = [], []
        for i, d in enumerate(data):  # update
            model.body.load_state_dict(theta)
            opt = make_optimizer(model.body.parameters(), cfg)
            model.body.train()
            for _ in range(cfg.local_epochs * p.tasks_per_epoch):
                episode = sample_episode(d.y_train, classes[i], p.n_way, p.n_support, p.n_query, rng)
                loss, _, _ = episode_losses(model.body, d.x_train, episode)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            thetas.append(body_state(model))
            sizes.append(d.num_train)
        E, mask = m_step(E, mask, s.tolist(), u, counts)
        w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        theta = {name: sum(wi * t[name].double() for wi, t in zip(w, thetas)).to(theta[name].dtype) for name in theta}
    return (time.perf_counter() - t0) / rounds


def plain_fedmd(prep, rounds: int, warmup: int) -> float:
    """Seconds per round of the plain FedMD loop (after ``warmup`` rounds)."""
    from algorithms.mutual_maths import step_batches
    from raysim.training import minibatches

    task = prep.task
    cfg, p = task.train, prep.algorithm.params
    n = task.num_clients
    data = [cl.to("cpu") for cl in prep.fed_data.clients]
    models = [task.build_model(i) for i in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay) for m in models]
    opts_d = [torch.optim.Adam(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay) for m in models]
    px = task.public.x.float()
    gen = torch.Generator().manual_seed(1)
    t0 = None
    for r in range(warmup + rounds):
        if r == warmup:
            t0 = time.perf_counter()
        idx = torch.randperm(len(px), generator=gen)[:min(p.n_alignment, len(px))].sort().values
        xa = px[idx]
        zs = []
        for m in models:
            m.eval()
            with torch.no_grad():
                zs.append(m(xa))
        consensus = torch.stack([z.double() for z in zs]).mean(0).float()
        for m, opt, opt_d, d in zip(models, opts, opts_d, data):
            m.train()
            for _ in range(p.digest_epochs):
                for b in minibatches(len(xa), p.digest_batch, gen):
                    opt_d.zero_grad(set_to_none=True)
                    F.l1_loss(m(xa[b]), consensus[b]).backward()
                    opt_d.step()
            for b in step_batches(d.num_train, cfg, gen):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(m(d.x_train[b]), d.y_train[b]).backward()
                opt.step()
    return (time.perf_counter() - t0) / rounds


def plain(method: str, prep, rounds: int) -> float:
    """Seconds per unit (MAFML: iteration; PN-ICFL, FedMD: round) of the plain twin, its first round a warm-up."""
    if method == "mafml":
        return plain_loop(prep, ITER * (rounds - 1), ITER)
    return {"pnicfl": plain_pnicfl, "fedmd": plain_fedmd}[method](prep, rounds - 1, 1)


def raysim_per_unit(method: str, res) -> float:
    """Seconds per unit from the wall-time rows: the exchanges of every round but the first (a warm-up)."""
    table = res.table
    t = table[(table["scope"] == "total") & (table["round"] >= 1)
              & table["metric"].isin([f"step_s@{s}" for s in STEPS_OF[method]])]
    rounds = t["round"].nunique()
    return float(t["value"].sum()) / (rounds * (ITER if method == "mafml" else 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="mafml", help="comma-separated: mafml, pnicfl, fedmd")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (MAFML: of 50 iterations); the first is a warm-up")
    ap.add_argument("--backends", default="sequential,ray")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="sittings (plain loop, then raysim); the median is printed")
    ap.add_argument("--profile", default=None, help="write a cProfile of the (first method's) sequential run here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override in raysim's runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import statistics

    from raysim.engine.prepare import prepare
    from raysim.engine.loop import run_experiment

    methods = [m for m in args.methods.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    out: dict = {}
    rows = []
    for mi, method in enumerate(methods):
        prep = prepare(make(method, args.rounds, "sequential", 1))
        runs: dict = {b: [] for b in backends}  # (plain s/unit, raysim s/unit) per sitting
        for rep in range(args.repeat):
            for backend in backends:
                base = plain(method, prep, args.rounds)
                cfg = make(method, args.rounds, backend, args.actors, args.set)
                if backend == "sequential" and args.profile and rep == 0 and mi == 0:
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                    res = run_experiment(cfg, write=False)
                    prof.disable()
                    prof.dump_stats(args.profile)
                else:
                    res = run_experiment(cfg, write=False)
                runs[backend].append((base, raysim_per_unit(method, res)))
        out[method] = {b: {"sittings": v, "median_ratio": statistics.median(r / p for p, r in v)}
                       for b, v in runs.items()}
        for backend in backends:
            label = f"raysim {backend}" + (f" ({args.actors} actors)" if backend == "ray" else "")
            v = runs[backend]
            rows.append(f"| {method} | {label} | {UNIT[method]} | {', '.join(f'{1e3 * p:.1f}' for p, _ in v)} | "
                        f"{', '.join(f'{1e3 * r:.1f}' for _, r in v)} | {', '.join(f'{r / p:.2f}' for p, r in v)} | "
                        f"{out[method][backend]['median_ratio']:.2f} |")
    print("| method | variant | unit | plain loop ms / unit | raysim ms / unit | x plain loop (per sitting) | median |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
