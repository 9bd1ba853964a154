"""Clustered FL (issue 13): the domain data, the ARI plumbing, PN-ICFL / PN-ICFL+, IFCA and FedFoMo.

Hand-computed examples for each method's maths, accounting of what crosses the wire, ARI = 1 on separable domains,
and sequential == Ray."""
import math

import numpy as np
import pytest
import torch

from raysim.config import make_config
from raysim.errors import ConfigError, DataError
from raysim.data.federated import ClientData, build_federated_data
from raysim.data.arrays import Pools
from raysim.data.skew import domain_dirichlet
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing


def rows(table, metric, scope="client"):
    return table[(table["metric"] == metric) & (table["scope"] == scope)]


# -- data ------------------------------------------------------------------------------------------------------------

def test_domain_dirichlet_draws_each_domain_from_the_whole_base_set():
    y = np.repeat(np.arange(10), 60)  # 600 samples, 60 per class
    ty = np.repeat(np.arange(10), 30)
    p = domain_dirichlet(Pools(y, ty, 8, np.random.default_rng(0), 10), alpha=3.0, samples_per_client=50, test_ratio=0.25,
                         num_domains=4)
    assert [len(t) for t in p.train] == [50] * 8
    for k in range(4):
        a, b = p.train[k], p.train[k + 4]  # the two clients of domain k
        assert not set(a.tolist()) & set(b.tolist())  # never twice within one domain
        assert not set(p.test[k].tolist()) & set(p.test[k + 4].tolist())
        for tr, te in ((a, p.test[k]), (b, p.test[k + 4])):  # test follows the client's class proportions
            counts = np.bincount(y[tr], minlength=10)
            assert np.array_equal(np.bincount(ty[te], minlength=10), np.ceil(counts * 0.25).astype(int))
    # across domains the same image may appear (each domain draws from the whole set): 8 x 50 = 400 of 600 samples,
    # four independent domains overlap with certainty
    assert len(set(np.concatenate(p.train).tolist())) < 400
    # alpha controls the label skew: near-uniform at 100, skewed at 0.1
    flat = domain_dirichlet(Pools(y, ty, 4, np.random.default_rng(1), 10), alpha=100.0, samples_per_client=50,
                            test_ratio=0.0, num_domains=4)
    skew = domain_dirichlet(Pools(y, ty, 4, np.random.default_rng(1), 10), alpha=0.1, samples_per_client=50,
                            test_ratio=0.0, num_domains=4)
    assert min(len(c) for c in flat.classes) >= 9 and max(len(c) for c in skew.classes) <= 6


def test_domain_dirichlet_classes_per_client_gives_users_3_to_5_classes():
    from raysim.data.skew import user_label_counts

    y = np.repeat(np.arange(10), 400)
    ty = np.repeat(np.arange(10), 200)
    # the seed's few-shot Rotated MNIST: 48 users, |D_i| = 100, Dir(3), "3-5 classes per user"
    p = domain_dirichlet(Pools(y, ty, 48, np.random.default_rng(0), 10), alpha=3.0, samples_per_client=100, num_domains=4,
                         classes_per_client=[3, 5])
    held = [len(c) for c in p.classes]
    assert set(held) == {3, 4, 5}  # every user 3-5 classes, and each count occurs
    for t, c in zip(p.train, p.classes):
        assert len(t) == 100 and sorted(np.unique(y[t]).tolist()) == c
    # Dir(3) over all 10 classes (the default) gives users 9-10 classes: the reason for the parameter
    full = domain_dirichlet(Pools(y, ty, 48, np.random.default_rng(0), 10), alpha=3.0, samples_per_client=100, num_domains=4)
    assert min(len(c) for c in full.classes) >= 8 and np.mean([len(c) for c in full.classes]) > 9
    # by hand: the draws user_label_counts makes, replayed on the same stream
    r1, r2 = np.random.default_rng(5), np.random.default_rng(5)
    counts = user_label_counts(r1, 10, 100, 3.0, (3, 5))
    m = int(r2.integers(3, 6))
    cls = r2.choice(10, size=m, replace=False)
    sub = r2.multinomial(100, r2.dirichlet(np.full(m, 3.0)))
    while not (sub > 0).all():
        sub = r2.multinomial(100, r2.dirichlet(np.full(m, 3.0)))
    want = np.zeros(10, dtype=np.int64)
    want[cls] = sub
    assert np.array_equal(counts, want) and counts.sum() == 100
    for bad in ([5, 3], [0, 2], [3, 11], [3], "3-5"):
        with pytest.raises(DataError, match="classes_per_client"):
            domain_dirichlet(Pools(y, ty, 4, np.random.default_rng(0), 10), classes_per_client=bad)


def test_domain_dirichlet_refuses_what_does_not_fit():
    y = np.repeat(np.arange(2), 10)
    with pytest.raises(DataError, match="samples_per_client"):
        domain_dirichlet(Pools(y, y, 4, np.random.default_rng(0), 2), samples_per_client=30, num_domains=2)
    with pytest.raises(DataError, match="alpha"):
        domain_dirichlet(Pools(y, y, 4, np.random.default_rng(0), 2), alpha=0.0)


def test_rotated_domains_reach_the_driver_never_the_clients():
    cfg = make_config({"data": {"dataset": "mnist5k", "num_clients": 8, "partition": "domain_dirichlet",
                                "partition_params": {"alpha": 100, "samples_per_client": 30},
                                "rotations": [0, 90, 180, 270]}})
    fd = build_federated_data(cfg.data, 3)
    assert fd.domains == [0, 1, 2, 3, 0, 1, 2, 3]
    assert fd.summary()["domains"] == fd.domains
    assert "group" not in {f.name for f in __import__("dataclasses").fields(ClientData)}
    assert all(c.num_train == 30 for c in fd.clients)
    bad = make_config({"data": {"dataset": "mnist5k", "num_clients": 8, "partition": "domain_dirichlet",
                                "partition_params": {"num_domains": 2}, "rotations": [0, 90, 180, 270]}})
    with pytest.raises(DataError, match="num_domains"):
        build_federated_data(bad.data, 3)


def test_multisource_digits_one_source_per_domain():
    cfg = make_config({"data": {"dataset": "multisource_digits", "num_clients": 8, "partition": "domain_dirichlet",
                                "partition_params": {"alpha": 100, "samples_per_client": 40, "test_ratio": 0.2}}})
    fd = build_federated_data(cfg.data, 1)
    assert fd.domains == [0, 1, 2, 3, 0, 1, 2, 3] and fd.input_shape == (1, 28, 28)
    from raysim.data.multisource import load_multisource_digits

    ds = load_multisource_digits()
    assert sorted(set(ds.train.domain.tolist())) == [0, 1, 2, 3]
    # client 2 (domain 2: inverted MNIST) has a bright background, client 0 (MNIST) a dark one
    assert float(fd.clients[2].x_train.mean()) > 1.0 > float(fd.clients[0].x_train.mean())
    with pytest.raises(DataError, match="data.partition"):
        build_federated_data(make_config({"data": {"dataset": "multisource_digits", "num_clients": 8,
                                                   "partition": "iid"}}).data, 1)
    with pytest.raises(DataError, match="data.rotations"):
        build_federated_data(make_config({"data": {"dataset": "multisource_digits", "num_clients": 8,
                                                   "partition": "domain_dirichlet", "rotations": [0, 90]}}).data, 1)


# -- ARI ---------------------------------------------------------------------------------------------------------------

def rotated_tiny(tiny, name, params=None, **over):
    base = dict(rounds=2, data={"dataset": "synthetic", "num_clients": 8, "partition": "domain_dirichlet",
                               "partition_params": {"alpha": 100, "samples_per_client": 20},
                               "rotations": [0, 90]},
                algorithm={"name": name, "params": params or {}})
    base.update(over)
    return tiny(**base)


def test_ari_rows_are_sklearns_score_of_the_reported_clusters(tiny):
    from sklearn.metrics import adjusted_rand_score

    res = run_experiment(rotated_tiny(tiny, "fesem", {"num_clusters": 2}), write=False)
    t = res.table
    ari = rows(t, "ari", "server")
    assert list(ari["round"]) == [0, 1]
    for r in (0, 1):
        cl = rows(t, "cluster")
        cl = cl[cl["round"] == r].sort_values("client_id")
        truth = [c % 2 for c in cl["client_id"]]
        assert float(ari[ari["round"] == r]["value"].iloc[0]) == pytest.approx(adjusted_rand_score(truth, cl["value"]))
    assert res.metadata["data"]["domains"] == [0, 1] * 4
    # no domains (no rotations): no ari rows
    plain = run_experiment(tiny(rounds=1, algorithm={"name": "fesem", "params": {}}), write=False)
    assert rows(plain.table, "ari", "server").empty


# -- PN-ICFL -----------------------------------------------------------------------------------------------------------

def test_pnicfl_distance_and_e_step_by_hand():
    from algorithms.pnicfl_maths import cluster_distances, e_step

    # two users, C = 3 classes, d = 2; user 0 holds classes 0 (3 samples) and 1 (1 sample), user 1 only class 2
    u = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]],
                      [[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]]])
    counts = torch.tensor([[3, 1, 0], [0, 0, 2]])
    E = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]],  # cluster 0 holds all classes
                      [[9.0, 9.0], [0.0, 1.0], [1.0, 1.0]]])  # cluster 1 lacks class 0 (mask)
    mask = torch.tensor([[True, True, True], [False, True, True]])
    d = cluster_distances(u, counts, E, mask)
    # d_00 = 3/4 * 0 + 1/4 * ||(0,1)-(0,0)||^2 = 0.25; d_01: only class 1 shared -> p~ = 1, distance 0
    # d_10 = ||(5,5)-(5,5)||^2 = 0; d_11 = ||(5,5)-(1,1)||^2 = 32
    assert d.tolist() == [[0.25, 0.0], [0.0, 32.0]]
    assert e_step(u, counts, E, mask).tolist() == [1, 0]
    # no class in common: +inf, never chosen
    d2 = cluster_distances(u[1:], counts[1:], E, torch.tensor([[True, True, False], [False, False, True]]))
    assert math.isinf(float(d2[0, 0])) and e_step(u[1:], counts[1:], E, torch.tensor(
        [[True, True, False], [False, False, True]])).tolist() == [1]


def test_pnicfl_m_step_by_hand():
    from algorithms.pnicfl_maths import m_step

    E = torch.zeros(2, 2, 1)
    E[1, 1] = 7.0
    mask = torch.tensor([[False, False], [False, True]])
    u = torch.tensor([[[1.0], [2.0]], [[3.0], [0.0]], [[8.0], [8.0]]])
    counts = torch.tensor([[1, 2], [3, 0], [1, 1]])
    newE, newm = m_step(E, mask, [0, 0, 0], u, counts)
    # class 0: (1*1 + 3*3 + 1*8) / 5 = 3.6; class 1: (2*2 + 1*8) / 3 = 4
    assert newE[0, :, 0].tolist() == pytest.approx([3.6, 4.0]) and newm[0].tolist() == [True, True]
    assert newE[1, 1, 0] == 7.0 and newm[1].tolist() == [False, True]  # nobody joined cluster 1: unchanged


def test_pnicfl_m_step_uses_the_e_steps_embeddings(tiny):
    """The seed's Algorithm 1 / §3.4: the server aggregates the u_i the users sent before their local update (the
    ones the E-step used), not embeddings recomputed after it; 'updated' keeps the post-update variant."""
    from algorithms.pnicfl_maths import estep_embeddings
    from raysim.algorithm import ServerContext
    from raysim.engine.prepare import prepare
    from raysim.messages import Message

    cfg = pn_cfg(tiny, params={"num_clusters": 2, "pretrain_episodes": 0})
    prep = prepare(cfg)
    algo, task = prep.algorithm, prep.task
    ctx = ServerContext(round_idx=0, client_id=-1, seed=cfg.seed, device="cpu", task=task, step="assign")
    state = algo.init_server_state(ctx)
    C, d = state["E"].shape[1:]
    # users 0 and 1 each hold one class; E-step embeddings u, post-update embeddings u' = u + 10
    u = torch.zeros(2, C, d)
    u[0, 0], u[1, 1] = 1.0, 3.0
    counts = torch.zeros(2, C, dtype=torch.int64)
    counts[0, 0], counts[1, 1] = 2, 4
    emb = {i: {"embedding": Message("user_embedding", {"u": u[i], "counts": counts[i]})} for i in (0, 1)}
    state = algo.assign(state, emb, ctx).state
    assert state["live"].all() and state["round_u"]["ids"].tolist() == [0, 1]
    # the two users seeded the two clusters (random init from the round's users): each is its own centre
    k0, k1 = int(state["assign"][0]), int(state["assign"][1])
    assert {k0, k1} == {0, 1}
    theta = {k: v.clone() for k, v in state["theta"].items()}
    upd = {i: {"model": Message("weights", theta), "num_samples": Message("num_samples", {"n": torch.tensor([10])}),
               "embedding": Message("user_embedding", {"u": u[i] + 10.0, "counts": counts[i]})} for i in (0, 1)}
    mctx = ServerContext(round_idx=0, client_id=-1, seed=cfg.seed, device="cpu", task=task, step="aggregate")
    E = algo.m_step(state, upd, mctx).state["E"]
    assert E[k0, 0].tolist() == [1.0] * d and E[k1, 1].tolist() == [3.0] * d  # the E-step's u, not u' = u + 10
    import dataclasses

    algo2 = type(algo)(dataclasses.replace(algo.params, m_step_embeddings="updated"), task)
    E2 = algo2.m_step(state, upd, mctx).state["E"]
    assert E2[k0, 0].tolist() == [11.0] * d and E2[k1, 1].tolist() == [13.0] * d
    # a user whose update arrives without an E-step embedding is an error, never a silent zero
    with pytest.raises(RuntimeError, match="without an embedding"):
        estep_embeddings(state["round_u"], [0, 5])


def test_pnicfl_initial_centres():
    from algorithms.pnicfl_maths import initial_centres

    u = torch.tensor([[[0.0]], [[0.1]], [[10.0]], [[10.1]]])
    counts = torch.ones(4, 1, dtype=torch.int64)
    assert len(set(initial_centres(u, counts, 3, np.random.default_rng(0)))) == 3
    # k-means++ with two far-apart pairs almost surely takes one of each pair
    for s in range(5):
        picks = initial_centres(u, counts, 2, np.random.default_rng(s), "kmeans++")
        assert {p // 2 for p in picks} == {0, 1}


def test_pnicfl_kmeans_init_by_hand():
    """init_restarts = 0 is the seed's initialisation (the seeded users' embeddings are the E_k); with restarts the
    server refines each seeding by E/M steps and keeps the lowest total distance."""
    from algorithms.pnicfl_maths import initial_centres, kmeans_init

    # 1-d embeddings of 6 users, one class each: domains {0, 0.2, 0.4} and {10, 10.2, 10.4}
    u = torch.tensor([0.0, 0.2, 0.4, 10.0, 10.2, 10.4]).reshape(6, 1, 1)
    counts = torch.ones(6, 1, dtype=torch.int64)
    picks = initial_centres(u, counts, 2, np.random.default_rng(1), "random")
    E, mask, got = kmeans_init(u, counts, 2, np.random.default_rng(1), "random", 0)
    assert got == picks and E[:, 0, 0].tolist() == u[picks, 0, 0].tolist() and mask.all()
    # users 0 and 1 as seeds (both in the first domain): the first E/M step gives {0} (mean 0) and {1..5} (mean
    # 6.24), the second {0, 1, 2} / {3, 4, 5}: the two domains' means 0.2 and 10.2
    from algorithms.pnicfl_maths import e_step, m_step

    E, mask = u[[0, 1]].clone(), counts[[0, 1]] > 0
    for _ in range(20):
        E, mask = m_step(E, mask, e_step(u, counts, E, mask).tolist(), u, counts)
    assert sorted(E[:, 0, 0].tolist()) == pytest.approx([0.2, 10.2])
    for r in range(5):  # with restarts, whichever the seedings: the two domains
        E, mask, _ = kmeans_init(u, counts, 2, np.random.default_rng(r), "random", 10)
        assert sorted(E[:, 0, 0].tolist()) == pytest.approx([0.2, 10.2])
        assert sorted(e_step(u, counts, E, mask).tolist()) == [0, 0, 0, 1, 1, 1]


def pn_cfg(tiny, name="pnicfl", params=None, **over):
    p = {"num_clusters": 2, "pretrain_episodes": 10, **(params or {})}
    return rotated_tiny(tiny, name, p, data__public={"dataset": "synthetic", "size": 400}, **over)


def test_pnicfl_finds_separable_domains_and_accounts_one_model(tiny):
    from raysim.models import build_model
    from raysim.config import ArchSpec

    res = run_experiment(pn_cfg(tiny, rounds=3), write=False)
    t = res.table
    ari = rows(t, "ari", "server")
    assert float(ari[ari["round"] == 2]["value"].iloc[0]) == 1.0  # rotations 0 / 90 of the synthetic clusters
    m = build_model(ArchSpec("mlp", {"hidden": 32, "embed_dim": 16}), (1, 8, 8), 10)
    theta = sum(p.numel() for p in m.body.parameters())
    c, d = 10, 16
    down = rows(t, "down_floats")
    up = rows(t, "up_floats")
    # every participant, every round: theta once (embed) + its own cluster's prototypes (update), never K models
    assert set(down["value"]) == {theta + c * d}
    assert set(rows(t, "down_floats@embed")["value"]) == {theta}
    assert set(rows(t, "down_floats@update")["value"]) == {c * d}
    assert set(up["value"]) == {c * d + theta}  # u (C x d, once: the M-step reuses the E-step's) and theta
    upd = run_experiment(pn_cfg(tiny, params={"m_step_embeddings": "updated"}, rounds=1), write=False).table
    assert set(rows(upd, "up_floats")["value"]) == {2 * c * d + theta}  # 'updated': u' (C x d) too
    assert set(rows(t, "down_bytes:cluster_id")["value"]) == {8}
    assert (rows(t, "pretrain_loss", "server")["round"] == -1).all()


def test_pnicfl_partition_local_update_steps_over_all_of_d(tiny, monkeypatch):
    import algorithms.pnicfl as pn

    seen = []
    real = pn.task_losses

    def spy(body, x, task, cluster=None, cluster_mask=None):
        seen.append((len(x), [int(i) for part in (task.support, task.query) for idx in part for i in idx]))
        return real(body, x, task, cluster, cluster_mask)

    monkeypatch.setattr(pn, "task_losses", spy)
    res = run_experiment(pn_cfg(tiny, params={"local_update": "partition", "tasks_per_epoch": 3}, rounds=1,
                                clients_per_round=2, train__local_epochs=2), write=False)
    assert len(seen) == 2 * 2 * 3  # 2 users x E = 2 epochs x B = 3 tasks, one step each
    for user in range(2):
        calls = seen[user * 6:(user + 1) * 6]
        first, second = calls[:3], calls[3:]
        assert [c[1] for c in first] == [c[1] for c in second]  # one partition per local round, every epoch
        assert sorted(i for c in first for i in c[1]) == list(range(calls[0][0]))  # all of D, each sample once
    assert (rows(res.table, "train_loss")["value"] > 0).all()
    with pytest.raises(ConfigError, match="local_update"):
        run_experiment(pn_cfg(tiny, params={"local_update": "all"}), write=False)


def test_pnicfl_plus_uses_lg_and_new_users_get_a_cluster(tiny):
    res = run_experiment(pn_cfg(tiny, "pnicfl_plus", {"lam": 0.5, "init": "kmeans++"}, rounds=1,
                                clients_per_round=3), write=False)
    t = res.table
    assert (rows(t, "train_g")["value"] > 0).all()
    cl = rows(t, "cluster")
    assert len(cl) == 8 and set(cl["value"]) <= {0.0, 1.0}  # 5 never-sampled users assigned as new users
    with pytest.raises(ConfigError, match="lam"):
        run_experiment(pn_cfg(tiny, "pnicfl_plus", {"lam": 0.0}), write=False)
    with pytest.raises(ConfigError, match="data.public"):
        run_experiment(rotated_tiny(tiny, "pnicfl", {"num_clusters": 2}), write=False)


# -- IFCA --------------------------------------------------------------------------------------------------------------

def test_ifca_assignment_and_averaging_by_hand():
    from algorithms.ifca import choose_cluster, cluster_average, model_losses
    from raysim.config import ArchSpec
    from raysim.models import build_model

    # a linear model (mlp1 with 1 hidden unit is not linear; take the head of a tiny mlp1 with identity-ish body)
    m = build_model(ArchSpec("mlp1", {"hidden": 2}), (1, 1, 2), 2)
    base = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    base["body.1.weight"] = torch.eye(2)  # hidden = relu(x)
    good, bad = dict(base), dict(base)
    good["head.weight"] = torch.eye(2) * 5  # predicts argmax(x)
    bad["head.weight"] = torch.tensor([[0.0, 5.0], [5.0, 0.0]])  # predicts the other class
    x = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])
    y = torch.tensor([0, 1])
    losses = model_losses(m, [bad, good], x, y)
    # CE of the good model: -log softmax([5, 0])[0] = log(1 + e^-5); the bad one: log(1 + e^5)
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(5)), math.log(1 + math.exp(-5))], rel=1e-6)
    assert choose_cluster(losses) == 1
    assert choose_cluster(torch.tensor([0.3, 0.1, 0.1])) == 1  # ties: the lower k
    a, b, c = ({"w": torch.tensor([v])} for v in (1.0, 3.0, 10.0))
    out = cluster_average([a, b, c], [0, 0, 2], [{"w": torch.tensor([0.0])}] * 3)
    assert [float(s["w"]) for s in out] == [2.0, 0.0, 10.0]  # plain mean; cluster 1 unchanged


def test_ifca_seed_protocol_picks_the_cluster_on_the_held_out_share(tiny):
    """The seed's IFCA: the K losses on a seeded 20 % held-out share of the training data; recomputed by hand for
    round 0 (the K initial models) and compared with the run's choice and its reported loss."""
    from algorithms.ifca import holdout_split, model_losses
    from raysim import rng as rngmod
    from raysim.engine.prepare import prepare

    # by hand: 10 samples, 20 % -> 2 held out, chosen by the seeded permutation; the rest trains
    tr, ho = holdout_split(10, 0.2, np.random.default_rng(3))
    perm = np.random.default_rng(3).permutation(10)
    assert ho.tolist() == sorted(perm[:2].tolist()) and tr.tolist() == sorted(perm[2:].tolist())
    assert holdout_split(3, 0.01, np.random.default_rng(0))[1].size == 1  # at least one held out
    assert holdout_split(3, 0.99, np.random.default_rng(0))[0].size == 1  # at least one trains

    cfg = rotated_tiny(tiny, "ifca", {"num_clusters": 3}, rounds=1)
    prep = prepare(cfg)
    res = run_experiment(cfg, write=False)
    t = res.table
    models = prep.algorithm.init_server_state(None)["models"]
    model = prep.task.build_model(0)
    for cid in (0, 3, 6):
        c = prep.fed_data.clients[cid]
        _, ho = holdout_split(c.num_train, 0.2, rngmod.numpy_rng(cfg.seed, rngmod.NO_ROUND, cid, "ifca_holdout"))
        assert len(ho) == 4  # 20 % of 20
        losses = model_losses(model, models, c.x_train[torch.as_tensor(ho)], c.y_train[torch.as_tensor(ho)])
        got = rows(t, "cluster_loss")
        got = got[(got["client_id"] == cid) & (got["round"] == 0)]["value"].iloc[0]
        assert got == pytest.approx(float(losses.min()), rel=1e-5)
        full = model_losses(model, models, c.x_train, c.y_train)
        assert float(full.min()) != pytest.approx(got, rel=1e-5)  # not the loss on all training data
    # the official protocol: the loss on all training data, tau full-batch steps
    off = run_experiment(rotated_tiny(tiny, "ifca", {"num_clusters": 3, "protocol": "official"}, rounds=1),
                         write=False).table
    c = prep.fed_data.clients[0]
    got = rows(off, "cluster_loss")
    got = got[(got["client_id"] == 0) & (got["round"] == 0)]["value"].iloc[0]
    assert got == pytest.approx(float(model_losses(model, models, c.x_train, c.y_train).min()), rel=1e-5)
    with pytest.raises(ConfigError, match="holdout"):
        run_experiment(rotated_tiny(tiny, "ifca", {"holdout": 1.0}), write=False)


def test_ifca_downloads_k_models_and_finds_separable_domains(tiny):
    from raysim.config import ArchSpec
    from raysim.models import build_model

    res = run_experiment(rotated_tiny(tiny, "ifca", {"num_clusters": 2, "protocol": "official"}, rounds=3),
                         write=False)
    t = res.table
    m = build_model(ArchSpec("mlp", {"hidden": 32, "embed_dim": 16}), (1, 8, 8), 10)
    size = sum(p.numel() for p in m.parameters())
    assert set(rows(t, "down_floats")["value"]) == {2 * size}  # K models down, every round
    assert set(rows(t, "up_floats")["value"]) == {size}
    ari = rows(t, "ari", "server")
    assert float(ari[ari["round"] == 2]["value"].iloc[0]) == 1.0


def test_ifca_best_of_n_initialisations_by_training_loss(tiny):
    """init_restarts: N gives IFCA the budget PN-ICFL's k-means restarts get: a setup phase sends N candidate
    initialisations of the K models to every user; the server keeps the candidate with the lowest sample-weighted
    mean of min_k loss_k on the users' training data (recomputed here by hand) and round 0 starts from it."""
    from algorithms.ifca import model_losses
    from raysim.config import ArchSpec
    from raysim.engine.prepare import prepare
    from raysim.models import build_model

    assert prepare(rotated_tiny(tiny, "ifca", {"num_clusters": 2})).algorithm.setup_schedule() is None  # default
    cfg = rotated_tiny(tiny, "ifca", {"num_clusters": 2, "init_restarts": 3}, rounds=1)
    prep = prepare(cfg)
    alg = prep.algorithm
    for a, b in zip(alg._candidate(0), alg.init_server_state(None)["models"]):  # candidate 0: the default init
        assert all(torch.equal(a[n], b[n]) for n in a)
    model = prep.task.build_model(0)
    totals = []
    for n in range(3):
        cand = alg._candidate(n)
        num = den = 0.0
        for c in prep.fed_data.clients:
            num += c.num_train * float(model_losses(model, cand, c.x_train, c.y_train).min())
            den += c.num_train
        totals.append(num / den)
    assert len(set(totals)) == 3  # the candidates differ
    res = run_experiment(cfg, write=False)
    t = res.table
    srv = t[(t["scope"] == "server") & (t["round"] == -1)]
    val = {m: float(srv[srv["metric"] == m]["value"].iloc[0]) for m in
           ("ifca_init_chosen", "ifca_init_loss", "ifca_init_loss_first")}
    best = int(np.argmin(totals))
    assert val["ifca_init_chosen"] == best
    assert val["ifca_init_loss"] == pytest.approx(totals[best], rel=1e-6)
    assert val["ifca_init_loss_first"] == pytest.approx(totals[0], rel=1e-6)
    # round 0's cluster losses are those of the kept candidate (the held-out share, the seed's protocol)
    from algorithms.ifca import holdout_split
    from raysim import rng as rngmod

    c = prep.fed_data.clients[0]
    _, ho = holdout_split(c.num_train, 0.2, rngmod.numpy_rng(cfg.seed, rngmod.NO_ROUND, 0, "ifca_holdout"))
    ho = torch.as_tensor(ho)
    got = rows(t, "cluster_loss")
    got = got[(got["client_id"] == 0) & (got["round"] == 0)]["value"].iloc[0]
    assert got == pytest.approx(float(model_losses(model, alg._candidate(best), c.x_train[ho], c.y_train[ho]).min()),
                                rel=1e-5)
    # accounting: N x K models down once per user in the setup phase, N losses + the sample count up
    m = build_model(ArchSpec("mlp", {"hidden": 32, "embed_dim": 16}), (1, 8, 8), 10)
    size = sum(p.numel() for p in m.parameters())
    setup = rows(t, "down_floats@init_losses")
    assert set(setup["value"]) == {3 * 2 * size} and len(setup) == 8
    assert set(rows(t, "up_floats@init_losses")["value"]) == {3}


# -- FeSEM -------------------------------------------------------------------------------------------------------------

def test_fesem_why_clients_never_move_and_how_they_can():
    """By hand: FeSEM's E-step sends a client back to the centre it trained from unless its local model drifted past
    the midpoint towards another centre; with two random initialisations 10 apart and a drift of 1 (ratio 0.1 < 1/2)
    nobody moves. With centres that descend from one model (init: clients) the same drift crosses the midpoint."""
    from algorithms.fesem import drift_ratio, fesem_step

    far = [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([10.0, 0.0])}]
    local = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([9.0, 0.0])}]  # trained from centre 0 and 1
    _, a = fesem_step(local, far)
    assert a.tolist() == [0, 1]
    assert drift_ratio(local, far, far) == pytest.approx(0.1)  # max drift 1 / gap 10
    near = [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([1.5, 0.0])}]
    local = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.5, 0.0])}]  # client 0 from 0, client 1 from 1
    cents, a = fesem_step(local, near)
    # client 0 (at 1.0) is nearer centre 1 (0.5 away) than its own centre 0 (1.0 away): it moves; client 1 too
    assert a.tolist() == [1, 0] and drift_ratio(local, near, near) == pytest.approx(1.0 / 1.5)
    assert float(cents[0]["w"][0]) == 0.5 and float(cents[1]["w"][0]) == 1.0


def test_fesem_random_init_never_moves_clients_warm_start_does(tiny):
    res = run_experiment(rotated_tiny(tiny, "fesem", {"num_clusters": 2}, rounds=4), write=False)
    t = res.table
    assert set(rows(t, "fesem_moved", "server")["value"]) == {0.0}
    assert rows(t, "fesem_drift_ratio", "server")["value"].max() < 0.5  # why: the drift never reaches the midpoint
    ari = rows(t, "ari", "server")["value"]
    assert ari.nunique() == 1  # the random first assignment, kept for good
    # the warm start: the centres descend from one model and lie close enough for a move (drift ratio above 1/2)
    warm = run_experiment(rotated_tiny(tiny, "fesem", {"num_clusters": 2, "init": "clients"}, rounds=3),
                          write=False).table
    assert rows(warm, "fesem_drift_ratio", "server")["value"].max() > 0.5
    # a client sampled after the warm start downloads the shared model until its first E-step
    late = run_experiment(rotated_tiny(tiny, "fesem", {"num_clusters": 2, "init": "clients"}, rounds=2,
                                       clients_per_round=4), write=False).table
    cl = rows(late, "cluster")
    assert len(cl[cl["round"] == 0]) == 4  # unassigned users report no cluster


# -- FedFomo -----------------------------------------------------------------------------------------------------------

def test_fedfomo_weights_and_peers_by_hand():
    from algorithms.fedfomo import fomo_weights, top_peers

    raw, used = fomo_weights(1.0, [0.5, 1.5, 0.0], [0.5, 1.0, 2.0])
    # w = (1 - 0.5)/0.50001, (1 - 1.5)/1.00001, (1 - 0)/2.00001
    assert raw.tolist() == pytest.approx([0.5 / 0.50001, -0.5 / 1.00001, 1.0 / 2.00001])
    s = 0.5 / 0.50001 + 1.0 / 2.00001
    assert used.tolist() == pytest.approx([0.5 / 0.50001 / s, 0.0, 1.0 / 2.00001 / s])
    raw, used = fomo_weights(0.1, [0.5, 0.7], [1.0, 1.0])
    assert used.tolist() == [0.0, 0.0]  # none helps: the client keeps its old model
    P = torch.tensor([0.0, 2.0, 1.0, 2.0, 5.0])
    assert top_peers(P, [1, 2, 3], 2) == [1, 3] and top_peers(P, [1, 2], 5) == [1, 2]


def test_fedfomo_accounting_and_affinity(tiny):
    from raysim.config import ArchSpec
    from raysim.models import build_model

    res = run_experiment(tiny(rounds=3, clients_per_round=6, data__val_fraction=0.2,
                              algorithm={"name": "fedfomo", "params": {"num_peers": 2}}), write=False)
    t = res.table
    m = build_model(ArchSpec("mlp", {"hidden": 32, "embed_dim": 16}), (1, 8, 8), 10)
    size = sum(p.numel() for p in m.parameters())
    down = rows(t, "down_floats")
    assert set(down[down["round"] == 0]["value"]) == {0}  # nothing held yet
    assert set(down[down["round"] > 0]["value"]) == {2 * size}  # M = 2 peers
    up = rows(t, "up_floats")
    assert set(up[up["round"] == 0]["value"]) == {size}
    assert set(up[up["round"] > 0]["value"]) == {size + 2}  # + the two raw weights
    with pytest.raises(ConfigError, match="data.val_fraction"):
        run_experiment(tiny(rounds=1, algorithm={"name": "fedfomo", "params": {}}), write=False)


@pytest.mark.ray
@pytest.mark.parametrize("name", ["pnicfl_plus", "ifca"])
def test_clustered_sequential_equals_ray_with_ari(ray_session, tiny, name):
    import pandas as pd

    def cfg(**over):
        if name == "ifca":
            return rotated_tiny(tiny, name, {"num_clusters": 2, "protocol": "official"}, **over)
        return pn_cfg(tiny, name, **over)

    seq = run_experiment(cfg(), write=False).table
    ray = run_experiment(cfg(backend={"name": "ray", "num_actors": 2, "num_cpus": 1, "state_memory_mb": 0}),
                         write=False).table
    assert not rows(seq, "ari", "server").empty
    pd.testing.assert_frame_equal(without_timing(seq), without_timing(ray), check_exact=True)
