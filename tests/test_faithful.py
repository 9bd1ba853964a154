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
