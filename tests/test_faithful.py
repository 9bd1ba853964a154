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
