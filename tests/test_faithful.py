"""Faithful baselines (issue 10): FedPer shares the conv layers as the seed does, FedProto-UH's fixed head, the
reference libraries' split files and the FedAvgCNN model."""
from __future__ import annotations

import pytest
import torch

from raysim.config import ConfigError
from raysim.driver import prepare, run_experiment
from raysim.registry import algorithm_class

MNIST = {"data": {"dataset": "mnist5k", "num_clients": 4, "partition": "iid",
                  "partition_params": {"samples_per_client": 20, "test_per_client": 10}},
         "model": {"arch": "cnn_mnist", "params": {}}}


def _algo(tiny, name, params=None, **over):
    prep = prepare(tiny(algorithm={"name": name, "params": params or {}}, **over))
    return algorithm_class(name).from_config(params or {}, prep.task), prep


def test_fedper_shares_exactly_the_convs_of_cnn_mnist(tiny):
    algo, prep = _algo(tiny, "fedper", **MNIST)
    model = prep.task.build_model(0)
    from algorithms.fedper import conv_keys

    assert conv_keys(model) == ["body.conv1.weight", "body.conv1.bias", "body.conv2.weight", "body.conv2.bias"]
    # conv 1->10 k5: 250 + 10; conv 10->20 k5: 5000 + 20
    assert sum(v.numel() for v in algo.init_server_state(None)["shared"].values()) == 5280
    body, _ = _algo(tiny, "fedper", {"shared": "body"}, **MNIST)
    assert sum(v.numel() for v in body.init_server_state(None)["shared"].values()) == 21330


def test_fedper_message_accounting_convs(tiny):
    cfg = tiny(rounds=2, algorithm={"name": "fedper", "params": {}}, **MNIST)
    t = run_experiment(cfg, write=False).table
    c = t[t.scope == "client"]
    up = c[(c.metric == "up_floats")]["value"]
    down = c[(c.metric == "down_floats")]["value"]
    assert len(up) == 8 and (up == 5280).all()  # the conv layers (num_samples is an integer, not a float)
    assert len(down) == 8 and (down == 5280).all()  # 20 clients: 105,600 floats each way per round


def test_fedper_convs_needs_conv_layers(tiny):
    with pytest.raises(ConfigError) as e:
        _algo(tiny, "fedper")  # the tiny config's mlp
    assert e.value.field == "algorithm.params.shared"
    with pytest.raises(ConfigError):
        _algo(tiny, "fedper", {"shared": "head"})


# ---------------------------------------------------------------------------------------------------------------
# FedProto-UH's fixed head


def test_orthogonal_head_is_nn_init_orthogonal():
    from algorithms.proto_ops import orthogonal_head

    w = orthogonal_head(10, 50, torch.Generator().manual_seed(3))
    ref = torch.nn.init.orthogonal_(torch.empty(10, 50), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(w, ref, atol=1e-6)


def _best_margin(W, c):
    """max over non-negative embeddings z with sum(z) = 1 of W_c z - max_{j != c} W_j z (a linear programme)."""
    import numpy as np
    from scipy.optimize import linprog

    C, d = W.shape
    A = np.array([np.r_[W[j] - W[c], 1.0] for j in range(C) if j != c])
    res = linprog(np.r_[np.zeros(d), -1.0], A_ub=A, b_ub=np.zeros(C - 1), A_eq=np.r_[np.ones(d), 0.0][None],
                  b_eq=[1.0], bounds=[(0, None)] * d + [(None, None)])
    return -res.fun


def _mean_margins(make, draws=40, C=10, d=50):
    import numpy as np

    return np.array([[_best_margin(make(C, d, torch.Generator().manual_seed(s)).double().numpy(), c)
                      for c in range(C)] for s in range(draws)]).mean(0)


def test_orthogonal_head_favours_no_class_for_nonnegative_embeddings():
    from algorithms.proto_ops import orthogonal_head

    m = _mean_margins(orthogonal_head)
    assert m.max() - m.min() < 0.04  # equal across classes up to sampling noise (each mean ~0.245, sd ~0.007)

    def uniform_qr(C, d, g):  # the old head: QR of a uniform matrix, whose first row is all positive
        q, r = torch.linalg.qr(torch.rand(C, d, generator=g).t())
        return (q * torch.sign(torch.diagonal(r)).unsqueeze(0)).t()

    u = _mean_margins(uniform_qr)
    assert u.argmax() == 0 and u.max() - u.min() > 0.06  # the test can fail: the biased head does


def test_fedproto_uh_linear_head_is_frozen_and_free(tiny):
    algo, prep = _algo(tiny, "fedproto_uh")
    assert algo.params.head == "linear"
    from algorithms.fedproto_uh import FixedLinearHead

    model = algo.build_client_model(0)
    assert isinstance(model.head, FixedLinearHead) and not list(model.head.parameters())
    w = model.head.weight
    assert torch.allclose(w @ w.t(), torch.eye(prep.task.num_classes), atol=1e-5)
    z = torch.rand(3, w.shape[1])
    assert torch.allclose(model.head(z), z @ w.t())  # logits = W z, no normalisation, no bias
    t = run_experiment(tiny(rounds=2, algorithm={"name": "fedproto_uh", "params": {}}), write=False).table
    c = t[t.scope == "client"]
    d, C = w.shape[1], prep.task.num_classes
    # the head is rebuilt from the shared seed: clients only ever send/receive prototypes (<= C x d floats)
    assert (c[c.metric == "up_floats"]["value"] <= C * d).all()
    with pytest.raises(ConfigError):
        _algo(tiny, "fedproto_uh", {"head": "mlp"})


# ---------------------------------------------------------------------------------------------------------------
# splits written by PFLlib / HtFLlib, and FedAvgCNN


def _write_split(root, num_clients=3, num_classes=4, shape=(1, 28, 28), seed=0):
    import json

    import numpy as np

    g = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    written = []
    for i in range(num_clients):
        parts = {}
        for what, n in (("train", 5 + i), ("test", 2 + i)):
            x = g.normal(size=(n,) + shape).astype(np.float32)
            y = g.integers(0, num_classes, size=n).astype(np.int64)
            with open(root / what / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x, "y": y})  # PFLlib's save_file
            parts[what] = (x, y)
        written.append(parts)
    (root / "config.json").write_text(json.dumps({"num_clients": num_clients, "num_classes": num_classes,
                                                  "non_iid": True, "partition": "dir"}))
    return written


def _files_cfg(root, **over):
    from raysim.config import make_config

    return make_config({"data": {"partition": "files", "num_clients": 3, "partition_params": {"root": str(root)},
                                 **over}})


def test_files_partition_loads_the_split_unchanged(tmp_path):
    from raysim.data import build_federated_data

    written = _write_split(tmp_path / "split")
    fd = build_federated_data(_files_cfg(tmp_path / "split").data, 0)
    assert fd.num_classes == 4 and fd.input_shape == (1, 28, 28) and len(fd.clients) == 3
    for c, w in zip(fd.clients, written):
        assert torch.equal(c.x_train, torch.from_numpy(w["train"][0])) and c.y_train.tolist() == w["train"][1].tolist()
        assert torch.equal(c.x_test, torch.from_numpy(w["test"][0])) and c.y_test.tolist() == w["test"][1].tolist()
    assert len(fd.global_test) == 2 + 3 + 4
    fv = build_federated_data(_files_cfg(tmp_path / "split", val_fraction=0.4).data, 0)
    for c, w in zip(fv.clients, written):  # the validation split is carved from the file's training samples
        both = torch.cat([c.x_train, c.x_val]).flatten(1).tolist()
        assert sorted(map(tuple, both)) == sorted(map(tuple, torch.from_numpy(w["train"][0]).flatten(1).tolist()))


def test_files_partition_errors(tmp_path):
    from raysim.data import DataError, build_federated_data

    with pytest.raises(DataError) as e:
        build_federated_data(_files_cfg(tmp_path / "nowhere").data, 0)
    assert e.value.field == "data.partition_params.root" and "not a directory" in str(e.value)
    _write_split(tmp_path / "s")
    with pytest.raises(DataError) as e:
        build_federated_data(_files_cfg(tmp_path / "s", num_clients=5).data, 0)
    assert e.value.field == "data.num_clients" and "has 3 clients" in str(e.value)
    (tmp_path / "s" / "test" / "2.npz").unlink()
    with pytest.raises(DataError, match="missing test file"):
        build_federated_data(_files_cfg(tmp_path / "s").data, 0)
    (tmp_path / "s" / "config.json").unlink()
    with pytest.raises(DataError, match="config.json"):
        build_federated_data(_files_cfg(tmp_path / "s").data, 0)
    from raysim.config import make_config

    with pytest.raises(DataError, match="needs the directory"):
        build_federated_data(make_config({"data": {"partition": "files"}}).data, 0)


def test_fedavg_cnn_shapes_and_a_run_on_a_file_split(tmp_path):
    from raysim.config import ArchSpec
    from raysim.models import build_model, num_parameters

    m = build_model(ArchSpec("fedavg_cnn"), (1, 28, 28), 10)
    logits, z = m(torch.zeros(2, 1, 28, 28), return_embedding=True)
    assert logits.shape == (2, 10) and z.shape == (2, 512)
    # conv 1->32 k5 (832) + conv 32->64 k5 (51,264) + fc 1024->512 (524,800) + head 512->10 (5,130)
    assert num_parameters(m) == 832 + 51264 + 524800 + 5130
    _write_split(tmp_path / "split", num_classes=10)
    from tests.conftest import tiny_config
    from raysim.config import make_config

    cfg = make_config(tiny_config(rounds=1, data={"partition": "files", "num_clients": 3,
                                                  "partition_params": {"root": str(tmp_path / "split")}},
                                  model={"arch": "fedavg_cnn", "params": {"embed_dim": 32}},
                                  algorithm={"name": "fedavg", "params": {}}))
    t = run_experiment(cfg, write=False).table
    assert len(t[(t.scope == "client") & (t.metric == "test_acc")]) >= 3


# ---------------------------------------------------------------------------------------------------------------
# FedPU as the seed states it


def test_pu_split_official_hand_example():
    import numpy as np

    from algorithms.proto_ops import UNLABELLED, pu_split

    y = torch.tensor([0] * 50 + [1] * 10 + [2] * 45)
    # positive classes {0, 1}; rho = 0.5; a positive class keeps labels only with >= 40 samples
    y_obs, prior, m = pu_split(y, [0, 1], 4, 0.5, np.random.default_rng(0), min_class_samples=40, at_least_one=False)
    assert (y_obs == 0).sum() == 25 and (y_obs == 1).sum() == 0 and (y_obs == 2).sum() == 0
    assert (y_obs[y_obs != UNLABELLED] == y[y_obs != UNLABELLED]).all()  # labels kept are the true ones
    # |U| = 25 + 10 + 45 = 80: pi over all C classes, the non-positive class 2 included
    assert torch.allclose(prior, torch.tensor([25 / 80, 10 / 80, 45 / 80, 0.0]))
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0]
    # the held split (today's): every held class positive, at least one label each
    y_obs, prior, m = pu_split(y, [0, 1, 2], 4, 0.05, np.random.default_rng(0))
    assert [(y_obs == c).sum().item() for c in range(3)] == [2, 1, 2]  # floor(.05 n), at least 1
    assert m.tolist() == [1.0, 1.0, 1.0, 0.0] and torch.allclose(prior, torch.tensor([48, 9, 43, 0]) / 100.0)


def test_positive_classes_seeded_subset():
    from algorithms.fedpu import positive_classes

    a = positive_classes([1, 3, 5, 7], 2, seed=0, client_id=4)
    assert len(a) == 2 and set(a) <= {1, 3, 5, 7} and a == positive_classes([7, 5, 3, 1], 2, seed=0, client_id=4)
    assert positive_classes([1, 3, 5, 7], 0, 0, 4) == [1, 3, 5, 7] == positive_classes([1, 3, 5, 7], 9, 0, 4)
    draws = {tuple(positive_classes([1, 3, 5, 7], 2, 0, cid)) for cid in range(20)}
    assert len(draws) > 1  # differs between clients


@pytest.mark.parametrize("name", ["fedproto", "fedavg"])
@pytest.mark.parametrize("min_class", [1, 40])  # 40: the tiny clients' 10 shots per class keep no label at all
def test_official_pu_split_runs(tiny, name, min_class):
    import numpy as np

    params = {"positive_rate": 0.5, "pu_split": "official", "labelled_classes": 2, "pu_min_class": min_class}
    t = run_experiment(tiny(rounds=2, algorithm={"name": name, "params": params}), write=False).table
    assert np.isfinite(t[t.metric == "train_pu"]["value"]).all()
    assert (t[t.metric == "train_pu"]["value"] != 0).any()
    with pytest.raises(ConfigError) as e:
        prepare(tiny(algorithm={"name": name, "params": {"pu_split": "some"}}))
    assert e.value.field == "algorithm.params.pu_split"
