"""Clustered FL (issue 13): the domain data, the ARI plumbing, PN-ICFL / PN-ICFL+, IFCA and FedFoMo.

Hand-computed examples for each method's maths, accounting of what crosses the wire, ARI = 1 on separable domains,
and sequential == Ray."""
import math

import numpy as np
import pytest
import torch

from raysim.config import ConfigError, make_config
from raysim.data.datasets import DataError
from raysim.data.federated import ClientData, build_federated_data
from raysim.data.partition import domain_dirichlet
from raysim.driver import run_experiment


def rows(table, metric, scope="client"):
    return table[(table["metric"] == metric) & (table["scope"] == scope)]


# -- data ------------------------------------------------------------------------------------------------------------

def test_domain_dirichlet_draws_each_domain_from_the_whole_base_set():
    y = np.repeat(np.arange(10), 60)  # 600 samples, 60 per class
    ty = np.repeat(np.arange(10), 30)
    p = domain_dirichlet(y, ty, 8, np.random.default_rng(0), 10, alpha=3.0, samples_per_client=50, test_ratio=0.25,
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
    flat = domain_dirichlet(y, ty, 4, np.random.default_rng(1), 10, alpha=100.0, samples_per_client=50,
                            test_ratio=0.0, num_domains=4)
    skew = domain_dirichlet(y, ty, 4, np.random.default_rng(1), 10, alpha=0.1, samples_per_client=50,
                            test_ratio=0.0, num_domains=4)
    assert min(len(c) for c in flat.classes) >= 9 and max(len(c) for c in skew.classes) <= 6


def test_domain_dirichlet_refuses_what_does_not_fit():
    y = np.repeat(np.arange(2), 10)
    with pytest.raises(DataError, match="samples_per_client"):
        domain_dirichlet(y, y, 4, np.random.default_rng(0), 2, samples_per_client=30, num_domains=2)
    with pytest.raises(DataError, match="alpha"):
        domain_dirichlet(y, y, 4, np.random.default_rng(0), 2, alpha=0.0)


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
