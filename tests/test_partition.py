"""Partitioners: class and shot counts, disjointness, determinism, clear errors."""
import numpy as np
import pytest

from raysim.config import make_config
from raysim.data import DataError, build_federated_data
from raysim.data.arrays import Pools
from raysim.data.partition import dirichlet, iid
from raysim.data.skew import nway_kshot


def labels(per_class=100, classes=10):
    return np.repeat(np.arange(classes), per_class)


def test_nway_kshot_counts_and_disjoint():
    tr, te = labels(300), labels(100)
    rng = np.random.default_rng(0)
    p = nway_kshot(Pools(tr, te, 20, rng, 10), ways=4, shots=10, stdev=2, test_shots=4)
    all_train = np.concatenate(p.train)
    assert len(all_train) == len(set(all_train.tolist()))  # no training sample reused
    all_test = np.concatenate(p.test)
    assert len(all_test) == len(set(all_test.tolist()))
    for i in range(20):
        n_i = len(p.classes[i])
        assert 2 <= n_i <= 6
        ys = tr[p.train[i]]
        assert sorted(set(ys.tolist())) == p.classes[i]
        per_class = np.bincount(ys, minlength=10)[p.classes[i]]
        assert len(set(per_class.tolist())) == 1  # k_i shots for each of its classes
        assert 9 <= per_class[0] <= 10  # official MNIST noise: [shots-stdev+1, shots+stdev-2]
        assert np.all(np.bincount(te[p.test[i]], minlength=10)[p.classes[i]] == 4)
        assert set(te[p.test[i]].tolist()) == set(p.classes[i])  # local test set: only its own classes


def test_nway_kshot_deterministic_and_seed_dependent():
    tr, te = labels(300), labels(100)
    a = nway_kshot(Pools(tr, te, 10, np.random.default_rng(1), 10), ways=3, shots=5, stdev=1, test_shots=2)
    b = nway_kshot(Pools(tr, te, 10, np.random.default_rng(1), 10), ways=3, shots=5, stdev=1, test_shots=2)
    c = nway_kshot(Pools(tr, te, 10, np.random.default_rng(2), 10), ways=3, shots=5, stdev=1, test_shots=2)
    assert all(np.array_equal(x, y) for x, y in zip(a.train, b.train))
    assert not all(np.array_equal(x, y) for x, y in zip(a.train, c.train))


def test_nway_kshot_too_many_shots_is_a_clear_error():
    with pytest.raises(DataError) as e:
        nway_kshot(Pools(labels(50), labels(20), 20, np.random.default_rng(0), 10), ways=5, shots=100, stdev=2, test_shots=1)
    assert e.value.field == "data.partition_params.shots"
    assert "at most shots=" in str(e.value)


def test_nway_kshot_test_pool_error_names_test_shots():
    with pytest.raises(DataError) as e:
        nway_kshot(Pools(labels(500), labels(10), 20, np.random.default_rng(0), 10), ways=5, shots=5, stdev=2, test_shots=5)
    assert e.value.field == "data.partition_params.test_shots"


def test_iid_sizes_and_error():
    p = iid(Pools(labels(30), labels(10), 5, np.random.default_rng(0), 10), samples_per_client=40, test_per_client=10)
    assert [len(t) for t in p.train] == [40] * 5 and [len(t) for t in p.test] == [10] * 5
    with pytest.raises(DataError, match="samples_per_client"):
        iid(Pools(labels(30), labels(10), 5, np.random.default_rng(0), 10), samples_per_client=100)


def test_dirichlet_small_alpha_is_skewed_and_covers():
    tr, te = labels(200), labels(100)
    p = dirichlet(Pools(tr, te, 10, np.random.default_rng(0), 10), alpha=0.1, min_samples=5)
    assert sum(len(t) for t in p.train) == len(tr)
    assert len(set(np.concatenate(p.train).tolist())) == len(tr)
    top_share = np.mean([np.bincount(tr[t], minlength=10).max() / len(t) for t in p.train])
    assert top_share > 0.5  # alpha=0.1 concentrates each client on few classes
    for t, s in zip(p.train, p.test):  # local test follows the client's classes
        assert set(te[s].tolist()) <= set(tr[t].tolist())


def test_build_mnist5k_with_rotations():
    cfg = make_config({"data": {"dataset": "mnist5k", "num_clients": 4, "partition": "iid",
                                "partition_params": {"samples_per_client": 50, "test_per_client": 20},
                                "rotations": [0, 90]}})
    fd = build_federated_data(cfg.data, 1)
    assert fd.domains == [0, 1, 0, 1] and not hasattr(fd.clients[0], "group")
    assert fd.clients[0].x_train.shape == (50, 1, 28, 28)
    fd0 = build_federated_data(cfg.data.__class__(**{**cfg.data.__dict__, "rotations": None}), 1)
    import torch

    assert torch.equal(fd.clients[1].x_train, torch.rot90(fd0.clients[1].x_train, k=-1, dims=(-2, -1)))
    assert torch.equal(fd.clients[0].x_train, fd0.clients[0].x_train)
