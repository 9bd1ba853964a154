"""Why the official FedGen diverges on the seed-002 stand-in (REPRODUCTION_seed000_002.md): the mean norm of the
generated features G(eps, y) in the server's generator steps against the clients' real embeddings f(x), per round.

    PYTHONPATH=$PWD python benchmarks/seed002_fedgen_norms.py [--rounds 21] [--set algorithm.params.eta=0]

Sequential backend (the hooks below live in this process); the run stops with the divergence error if it diverges.
"""
from __future__ import annotations

import argparse

import torch

import algorithms.fedgen as fedgen
from raysim.config import load_config
from raysim.engine.loop import run_experiment
from raysim.runner.safety import NonFiniteError

CONFIG = "configs/seed002_fedtgp/fedgen_fmnist_zoo.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    gen_norms, real_norms = [], []
    diversity, aggregate, objective = fedgen.fedgen_diversity, fedgen.FedGen.aggregate, fedgen.FedGen.objective

    def div(eps, z):
        gen_norms.append(float(z.detach().norm(dim=1).mean()))
        return diversity(eps, z)

    def agg(self, state, uploads, ctx):
        gen_norms.clear()
        out = aggregate(self, state, uploads, ctx)
        real = sum(real_norms) / max(len(real_norms), 1)
        print(f"| {ctx.round_idx} | {gen_norms[0]:.1f} | {gen_norms[-1]:.1f} | {real:.1f} |", flush=True)
        real_norms.clear()
        return out

    def obj(self, start):
        loss_fn = objective(self, start)

        def wrapped(model, xb, yb):
            with torch.no_grad():
                _, emb = model(xb, return_embedding=True)
            real_norms.append(float(emb.norm(dim=1).mean()))
            return loss_fn(model, xb, yb)

        return wrapped

    fedgen.fedgen_diversity, fedgen.FedGen.aggregate, fedgen.FedGen.objective = div, agg, obj
    cfg = load_config(CONFIG, overrides=[f"rounds={args.rounds}", "eval.every=1000", "backend.name=sequential"] + args.set)
    print("| round | ‖G(eps, y)‖ first step | last step | real ‖f(x)‖ (clients' batches) |\n|---|---|---|---|")
    try:
        run_experiment(cfg, progress=False, write=False)
    except NonFiniteError as e:
        print(f"diverged: {e}")


if __name__ == "__main__":
    main()
