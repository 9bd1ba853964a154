"""PN-ICFL's initialisation, isolated (benchmarks/REPRODUCTION_seed001.md): pre-train the prototypical network as
the run's setup phase does, embed every user once under it, print the model distances within and between domains,
then the round-0 ARI of the three initialisations over 10 server seeds (theta fixed: no local training).

    PYTHONPATH=$PWD python benchmarks/seed001_init_ablation.py configs/seed001_pnicfl/table2_rotated_pnicfl.yaml seed=100
"""
import sys

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score

from algorithms.pnicfl_maths import cluster_distances, e_step, embed_all, kmeans_init, user_embedding
from raysim.algorithm import ServerContext
from raysim.config import load_config
from raysim.engine.prepare import prepare
from raysim.runner.runners import ModelCache


def main() -> None:
    cfg = load_config(sys.argv[1], sys.argv[2:])
    prep = prepare(cfg)
    algo, task = prep.algorithm, prep.task
    ctx = ServerContext(round_idx=-1, client_id=-1, seed=cfg.seed, device="cpu", task=task,
                        models=ModelCache(task, "cpu"), step="pretrain")
    st = algo.init_server_state(ctx)
    if algo.params.pretrain_episodes:
        st = algo.pretrain(st, None, ctx).state
    m = ctx.model(0)
    m.body.load_state_dict(st["theta"])
    U, N = [], []
    for c in (c.to("cpu") for c in prep.fed_data.clients):
        u, n = user_embedding(embed_all(m.body, c.x_train), c.y_train, task.num_classes)
        U.append(u)
        N.append(n)
    U, N = torch.stack(U), torch.stack(N)
    dom = np.array(prep.fed_data.domains)
    D = cluster_distances(U, N, U, N > 0).numpy()
    off = ~np.eye(len(dom), dtype=bool)
    same, diff = D[(dom[:, None] == dom[None]) & off], D[dom[:, None] != dom[None]]
    same, diff = same[np.isfinite(same)], diff[np.isfinite(diff)]
    print(f"model distance within a domain: mean {same.mean():.3f} max {same.max():.3f}; between domains: mean "
          f"{diff.mean():.3f} min {diff.min():.3f} (finite pairs)")
    for meth, restarts in (("random", 0), ("kmeans++", 0), ("kmeans++", 10)):
        aris = []
        for r in range(10):
            E, mask, _ = kmeans_init(U, N, algo.params.num_clusters, np.random.default_rng(r), meth, restarts)
            aris.append(adjusted_rand_score(dom, e_step(U, N, E, mask).numpy()))
        print(f"init {meth}, init_restarts {restarts}: round-0 ARI over 10 server seeds: mean {np.mean(aris):.2f} "
              f"min {np.min(aris):.2f}")


if __name__ == "__main__":
    main()
