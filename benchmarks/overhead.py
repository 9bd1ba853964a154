"""Engine overhead benchmark (issue 2, figure 11a).

FedProto on mnist5k, 20 clients, one local epoch per round, evaluated only at the end. Compares wall time per round of
  (1) a plain single-process PyTorch loop doing the same work (same data, model, batches, loss, prototype maths),
  (2) a plain two-process loop (one persistent worker process per core, each owning half of the clients),
  (3) raysim's sequential backend and (4) raysim's Ray backend with 2 client actors.
Every variant uses 1 torch thread per process. The first round of each variant is a warm-up and not timed.

    python benchmarks/overhead.py [--rounds 6] [--config configs/fedproto_mnist5k.yaml]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch
import torch.nn.functional as F

from raysim.config import load_config
from raysim.shared_maths import aggregate_prototypes, class_prototypes, prototype_regulariser
from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.training import forward_all


def plain_client_round(model, state, x, y, protos, mask, lam, cfg, gen):
    """Load the client's weights, train one epoch of CE + lam * MSE(z, P_y), return new weights and prototypes."""
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    use = bool(mask.any())
    perm = torch.randperm(len(y), generator=gen)
    for s in range(0, len(y), cfg.batch_size):
        idx = perm[s:s + cfg.batch_size]
        xb, yb = x[idx], y[idx]
        opt.zero_grad(set_to_none=True)
        logits, z = model(xb, return_embedding=True)
        loss = F.cross_entropy(logits, yb)
        if use:
            loss = loss + lam * prototype_regulariser(z, yb, protos, mask)
        loss.backward()
        opt.step()
    _, z = forward_all(model, x)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, class_prototypes(z, y, protos.shape[0])


def _worker(conn, prep, client_ids, lam):
    torch.set_num_threads(1)
    task = prep.task
    model = task.build_model(client_ids[0])
    states = {}
    for cid in client_ids:
        torch.manual_seed(cid)
        states[cid] = {k: v.clone() for k, v in task.build_model(cid).state_dict().items()}
    data = {c.client_id: c.to("cpu") for c in prep.fed_data.clients if c.client_id in client_ids}  # decoded floats
    while True:
        msg = conn.recv()
        if msg is None:
            break
        round_idx, protos, mask = msg
        out = []
        for cid in client_ids:
            gen = torch.Generator().manual_seed(round_idx * 1000 + cid)
            states[cid], up = plain_client_round(model, states[cid], data[cid].x_train, data[cid].y_train, protos, mask,
                                                 lam, task.train, gen)
            out.append(up)
        conn.send(out)


def plain_loop(prep, rounds, lam, processes: int) -> list[float]:
    task = prep.task
    C = task.num_classes
    d = task.build_model(0).embed_dim
    protos, mask = torch.zeros(C, d), torch.zeros(C, dtype=torch.bool)
    ids = list(range(task.num_clients))
    times = []
    if processes == 1:
        torch.set_num_threads(1)
        model = task.build_model(0)
        states = {cid: {k: v.clone() for k, v in task.build_model(cid).state_dict().items()} for cid in ids}
        data = {c.client_id: c.to("cpu") for c in prep.fed_data.clients}  # decoded floats
        for r in range(rounds):
            t0 = time.perf_counter()
            ups = []
            for cid in ids:
                gen = torch.Generator().manual_seed(r * 1000 + cid)
                states[cid], up = plain_client_round(model, states[cid], data[cid].x_train, data[cid].y_train, protos,
                                                     mask, lam, task.train, gen)
                ups.append(up)
            protos, mask = aggregate_prototypes(ups, C, d, "weighted")
            times.append(time.perf_counter() - t0)
        return times
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for w in range(processes):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b, prep, ids[w::processes], lam), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    for r in range(rounds):
        t0 = time.perf_counter()
        for a in pipes:
            a.send((r, protos, mask))
        ups = [u for a in pipes for u in a.recv()]
        protos, mask = aggregate_prototypes(ups, C, d, "weighted")
        times.append(time.perf_counter() - t0)
    for a in pipes:
        a.send(None)
    for p in procs:
        p.join()
    return times


def raysim_loop(config, rounds, backend, actors=2) -> tuple[list[float], float]:
    overrides = [f"rounds={rounds}", f"eval.every={rounds}", f"backend.name={backend}", f"backend.num_actors={actors}"]
    cfg = load_config(config, overrides)
    res = run_experiment(cfg, progress=False, write=False)
    # the last round also evaluates every client; exclude it like the warm-up so all variants time the same work
    return res.timing["round_s"][:-1], res.timing["setup_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/fedproto_mnist5k.yaml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config, ["backend.name=sequential"])
    prep = prepare(cfg)
    lam = cfg.algorithm.params.get("lam", 1.0)
    n_train = sum(c.num_train for c in prep.fed_data.clients)
    print(f"setting: {cfg.algorithm.name} on {cfg.data.dataset}, {cfg.data.num_clients} clients, {n_train} train samples "
          f"in all, batch {cfg.train.batch_size}, {cfg.train.local_epochs} local epoch; {args.rounds} rounds, first one "
          f"not timed; torch threads 1 per process")
    res = {}
    res["plain_1proc"] = plain_loop(prep, args.rounds, lam, 1)[1:]
    res["plain_2proc"] = plain_loop(prep, args.rounds, lam, 2)[1:]
    res["raysim_sequential"], _ = raysim_loop(args.config, args.rounds + 1, "sequential")
    res["raysim_sequential"] = res["raysim_sequential"][1:]
    rs, setup = raysim_loop(args.config, args.rounds + 1, "ray", 2)
    res["raysim_ray_2actors"] = rs[1:]
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{'variant':<22}{'median s/round':>16}{'mean s/round':>14}")
    for k, v in res.items():
        print(f"{k:<22}{med[k]:>16.3f}{statistics.mean(v):>14.3f}")
    print(f"ray setup (ray.init + actors): {setup:.1f} s")
    r1 = med["raysim_sequential"] / med["plain_1proc"]
    r2 = med["raysim_ray_2actors"] / med["plain_2proc"]
    sp = med["raysim_sequential"] / med["raysim_ray_2actors"]
    print(f"sequential / plain 1-process = {r1:.3f}  (target <= 1.10)")
    print(f"ray(2) / plain 2-process     = {r2:.3f}  (target <= 1.15)")
    print(f"speed-up ray(2) over sequential = {sp:.2f}x (target >= 1.6)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s_per_round": med, "ratios": {"seq_vs_plain1": r1, "ray_vs_plain2": r2, "ray_speedup": sp}}, f, indent=1)


if __name__ == "__main__":
    main()
