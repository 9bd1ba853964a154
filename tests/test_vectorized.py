"""The vectorised executor (backend.vectorize): the same table as the per-client loop within the stated tolerance for
every method that opts in (dropout off and on: the masks are replayed from each client's own generator), Adam and SGD
momentum with persisted optimiser state, unequal data sizes and batch counts, the fallback to the loop, BatchNorm
refused before the run, the identity hash, and Ray == sequential."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from raysim.config import ConfigError, make_config
from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.engine.vectorized import _Optimizer
from raysim.config import TrainConfig

KEYS = ["round", "client_id", "scope", "metric"]
METHODS = ["local", "fedavg", "fedprox", "fedper", "lgfedavg", "fedproto", "fedtgp", "fedproto_uh"]


def cfg(algo="fedavg", vectorize=True, dropout=0.0, train=None, params=None, backend=None, **over):
    d = {"name": "vec", "seed": 3, "rounds": 2,
         # Dirichlet: unequal client sizes, so unequal batch counts and last-batch sizes
         "data": {"dataset": "mnist5k", "num_clients": 5, "partition": "dirichlet",
                  "partition_params": {"alpha": 0.5, "samples_per_client": 18, "min_samples": 5, "test_ratio": 0.3}},
         "model": {"arch": "cnn_mnist", "params": {"out_channels": 8, "embed_dim": 16, "dropout": dropout,
                                                   "conv_dropout": dropout}},
         "train": {"local_epochs": 1, "batch_size": 4, "lr": 0.05, "momentum": 0.5, **(train or {})},
         "algorithm": {"name": algo, "params": dict(params or {})},
         "eval": {"every": 2},
         "backend": {"name": "sequential", "vectorize": vectorize, **(backend or {})},
         "output": {"progress": False}}
    d.update(over)
    return make_config(d)


def table(c):
    return without_timing(run_experiment(c, write=False, progress=False).table.drop(columns=["run_id"]))


def close(a: pd.DataFrame, b: pd.DataFrame, rel=1e-4):
    """Same rows; every value within rel * max(1, |value|) (the equality policy's stated tolerance)."""
    m = a.merge(b, on=KEYS, how="outer", suffixes=("_l", "_v"), indicator=True)
    assert (m["_merge"] == "both").all(), m[m["_merge"] != "both"].head()
    diff = (m["value_l"] - m["value_v"]).abs()
    scale = m["value_l"].abs().clip(lower=1.0)
    bad = m[diff > rel * scale]
    assert bad.empty, bad[KEYS + ["value_l", "value_v"]].head()
    return float(diff.max())


@pytest.mark.parametrize("algo", METHODS)
def test_vectorised_equals_loop_within_tolerance(algo):
    loop, vec = table(cfg(algo, vectorize=False)), table(cfg(algo))
    close(loop, vec)
    assert loop[loop.metric == "train_loss"].shape[0] > 0


def test_dropout_on_masks_are_the_loops():
    # cnn_mnist's head dropout and Dropout2d at 0.5: each client's masks are drawn from its own generator in the
    # loop's order, so even with dropout the numbers agree within tolerance, and a vectorised run is deterministic
    loop = table(cfg("fedproto", vectorize=False, dropout=0.5))
    vec = table(cfg("fedproto", dropout=0.5))
    close(loop, vec)
    pd.testing.assert_frame_equal(vec, table(cfg("fedproto", dropout=0.5)))
    # and dropout really acts: the run without it differs
    assert not table(cfg("fedproto", dropout=0.0))["value"].equals(vec["value"])


@pytest.mark.parametrize("train", [
    {"optimizer": "adam", "lr": 0.002, "persist_optimizer": True, "local_epochs": 2},
    {"momentum": 0.9, "weight_decay": 0.01, "persist_optimizer": True, "batch_size": 3},
])
def test_optimiser_state_and_unequal_batches(train):
    close(table(cfg("fedprox", vectorize=False, train=train, rounds=3)), table(cfg("fedprox", train=train, rounds=3)))


def test_optimizer_matches_torch_on_hand_tensors():
    torch.manual_seed(0)
    for tc in (TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
               TrainConfig(optimizer="adam", lr=0.01, weight_decay=0.001)):
        ps = [torch.randn(3, 2) for _ in range(2)]
        gs = [[torch.randn(3, 2) for _ in range(2)] for _ in range(3)]  # 3 steps x 2 clients
        stacked = {"w": torch.stack(ps).clone()}
        opt = _Optimizer(tc, stacked, [None, None], tc.lr)
        for step in gs:
            opt.step(stacked, {"w": torch.stack(step)}, torch.tensor([0, 1]))
        for i in range(2):
            p = ps[i].clone().requires_grad_(True)
            ref = (torch.optim.Adam([p], lr=tc.lr, weight_decay=tc.weight_decay) if tc.optimizer == "adam" else
                   torch.optim.SGD([p], lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay))
            for step in gs:
                p.grad = step[i].clone()
                ref.step()
            assert torch.allclose(stacked["w"][i], p.detach(), atol=1e-6)
            mine = opt.state_of(i, ["w"])["w"]
            theirs = ref.state[p]
            for key in mine:
                assert torch.allclose(torch.as_tensor(mine[key], dtype=torch.float32),
                                      torch.as_tensor(theirs[key], dtype=torch.float32), atol=1e-6)


def test_clients_that_do_not_opt_in_run_the_loop_bit_identically():
    # FedPU's view is per client: FedProto with hidden labels falls back to the per-client loop
    p = {"positive_rate": 0.5}
    pd.testing.assert_frame_equal(table(cfg("fedproto", vectorize=False, params=p)), table(cfg("fedproto", params=p)))


def test_batchnorm_is_refused_before_the_run():
    c = cfg("fedavg", model={"arch": "resnet_small", "params": {"width": 4}})
    with pytest.raises(ConfigError) as e:
        prepare(c)
    assert e.value.field == "backend.vectorize" and "BatchNorm" in str(e.value)


def test_vectorize_is_part_of_the_identity():
    assert cfg(vectorize=True).config_hash() != cfg(vectorize=False).config_hash()
    # the default leaves old configs' identities alone: backend keys other than vectorize never enter it
    assert cfg(vectorize=False).config_hash() == cfg(vectorize=False, backend={"num_actors": 3}).config_hash()
    assert "backend.vectorize" in cfg(vectorize=True).identity_dict()


@pytest.mark.ray
def test_ray_two_actors_equals_sequential(ray_session):
    seq = table(cfg("fedproto", dropout=0.5))
    ray = table(cfg("fedproto", dropout=0.5, backend={"name": "ray", "num_actors": 2}))
    close(seq, ray)
