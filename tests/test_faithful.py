"""Faithful baselines (issue 10): FedPer shares the conv layers as the seed does, FedProto-UH's fixed head, the
reference libraries' split files and the FedAvgCNN model."""
from __future__ import annotations

import pytest
import torch

from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.runner.runners import make_algorithm
from raysim.errors import ConfigError

MNIST = {"data": {"dataset": "mnist5k", "num_clients": 4, "partition": "iid",
                  "partition_params": {"samples_per_client": 20, "test_per_client": 10}},
         "model": {"arch": "cnn_mnist", "params": {}}}


def _algo(tiny, name, params=None, **over):
    prep = prepare(tiny(algorithm={"name": name, "params": params or {}}, **over))
    return make_algorithm(prep.spec), prep


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
    from algorithms.prototype_maths import orthogonal_head

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
    from algorithms.prototype_maths import orthogonal_head

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


def test_fedavg_uh_trains_the_body_under_the_same_fixed_head(tiny):
    """FedAvg-UH (seed 000): FedAvg's rounds with FedProto-UH's frozen orthogonal linear head — the global model's
    head is W (orthonormal rows, from the seed) at the start and after training, the body moves, and the table is
    not FedAvg's; the iteration mode is refused naming sync_every."""
    from raysim.engine.loop import run_experiment as run

    algo, prep = _algo(tiny, "fedavg_uh")
    w = algo.head_weight(prep.task.build_model(0).embed_dim)
    C = prep.task.num_classes
    assert torch.allclose(w @ w.t(), torch.eye(C), atol=1e-5)
    start = algo.init_server_state(None)["model"]
    assert torch.equal(start["head.weight"], w)
    res = run(tiny(rounds=2, algorithm={"name": "fedavg_uh", "params": {}}), write=False)
    uh = res.table
    plain = run(tiny(rounds=2, algorithm={"name": "fedavg", "params": {}}), write=False).table
    acc = lambda t: t[(t.metric == "test_acc") & (t.scope == "client")]["value"].tolist()  # noqa: E731
    assert acc(uh) != acc(plain)
    with pytest.raises(ConfigError) as e:
        _algo(tiny, "fedavg_uh", {"sync_every": 5}, train={"local_steps": 10, "batch_size": 8, "lr": 0.05})
    assert e.value.field == "algorithm.params.sync_every" and "classic rounds" in str(e.value)


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
    acc = t[(t.scope == "client") & (t.metric == "test_acc")]
    assert sorted(acc["client_id"]) == [0, 1, 2]  # every client of the split evaluated once, on its own test file


# ---------------------------------------------------------------------------------------------------------------
# FedPU as the seed states it


def test_pu_split_official_hand_example():
    import numpy as np

    from algorithms.prototype_maths import UNLABELLED, Labelling, pu_split

    y = torch.tensor([0] * 50 + [1] * 10 + [2] * 45)
    # positive classes {0, 1}; rho = 0.5; a positive class keeps labels only with >= 40 samples
    y_obs, prior, m = pu_split(y, [0, 1], 4, Labelling(0.5, min_class_samples=40, at_least_one=False),
                              np.random.default_rng(0))
    assert (y_obs == 0).sum() == 25 and (y_obs == 1).sum() == 0 and (y_obs == 2).sum() == 0
    assert (y_obs[y_obs != UNLABELLED] == y[y_obs != UNLABELLED]).all()  # labels kept are the true ones
    # |U| = 25 + 10 + 45 = 80: pi over all C classes, the non-positive class 2 included
    assert torch.allclose(prior, torch.tensor([25 / 80, 10 / 80, 45 / 80, 0.0]))
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0]
    # the held split (today's): every held class positive, at least one label each
    y_obs, prior, m = pu_split(y, [0, 1, 2], 4, Labelling(0.05), np.random.default_rng(0))
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


# ---------------------------------------------------------------------------------------------------------------
# Issue 21: the seeds' explicit choices are the defaults (FedTGP's margin: seed 002; FedPU's split: seed 000)


def _tgp_uploads(d):
    """Two clients; Q_0 = mean((-1, 0), (1, 0)) = (0, 0), Q_1 = (3, 0), Q_2 = (0, 4) in the first two coordinates."""
    from raysim.messages import Message

    def proto(x, y):
        v = torch.zeros(d)
        v[0], v[1] = x, y
        return v

    a = torch.stack([proto(-1, 0), proto(3, 0)])
    b = torch.stack([proto(1, 0), proto(0, 4)])
    return {0: {"protos": Message("prototypes", {"protos": a, "classes": torch.tensor([0, 1]),
                                                 "counts": torch.tensor([5, 5])})},
            1: {"protos": Message("prototypes", {"protos": b, "classes": torch.tensor([0, 2]),
                                                 "counts": torch.tensor([5, 5])})}}


def test_fedtgp_margin_default_is_the_seeds_formula(tiny):
    """Seed 002 section 5 part 2: delta(t) = min(max_{c != c'} ||Q^c - Q^c'||, tau). Centre distances by hand:
    d01 = 3, d02 = 4, d12 = 5 -> the seed's delta = 5; the official code's max_c min_{c'} gap = max(3, 3, 4) = 4."""
    import raysim.rng as rngmod
    from raysim.algorithm import ServerContext

    from algorithms.fedtgp import FedTGP

    assert FedTGP.Params().margin == "seed"
    margins = {}
    for params in ({"server_epochs": 0}, {"server_epochs": 0, "margin": "code"},
                   {"server_epochs": 0, "margin_threshold": 4.5}, {"server_epochs": 0, "margin": "paper"}):
        algo, prep = _algo(tiny, "fedtgp", params)
        ctx = ServerContext(0, rngmod.SERVER, prep.task.seed, torch.device("cpu"), prep.task)
        ups = _tgp_uploads(prep.task.build_model(0).embed_dim)
        _, m = algo.aggregate(algo.init_server_state(ctx), ups, ctx)
        margins[tuple(sorted(params.items()))] = m["tgp_margin"]
    got = list(margins.values())
    assert got[0] == pytest.approx(5.0)  # default: the seed's, largest pairwise distance
    assert got[1] == pytest.approx(4.0)  # option: the official code's
    assert got[2] == pytest.approx(4.5)  # tau caps it
    assert got[3] == pytest.approx(5.0)  # 'paper' (slides p.31) is the same formula


def test_fedpu_default_split_is_held_and_seed_split_stays():
    """Issue 34: the default split is ``held`` (every held class labelled; the split whose numbers match the seed's
    Fig. 4, and the seed's caption: "positiveRate 为带标签数据占比", the share of labelled data). ``pu_split: seed``
    (the other reading of seed 000 section 5.4): labelled_classes = 2 of the client's 3 classes, rho = 0.5, 50 samples
    per class (>= pu_min_class 40): 25 + 25 labels, the third class all unlabelled; |U| = 25 + 25 + 50 = 100 ->
    pi = (.25, .25, .5) over the held classes, 0 elsewhere; m = 1 on the two positive classes only. rate 1: the plain
    method (no view)."""
    from types import SimpleNamespace

    import numpy as np

    from algorithms import fedpu
    from algorithms.fedavg import FedAvg
    from algorithms.fedproto import FedProto
    from algorithms.prototype_maths import UNLABELLED

    for cls in (FedProto, FedAvg):
        p = cls.Params()
        assert (p.pu_split, p.labelled_classes, p.pu_min_class) == ("held", 2, 40)
    y = torch.tensor([3] * 50 + [5] * 50 + [8] * 50)
    data = SimpleNamespace(y_train=y, classes=[3, 5, 8], client_id=4)
    # the default ('held'): every held class positive, floor(0.5 * 50) = 25 labels each -> labelled share = rho
    dflt = fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=0.5))
    assert all(int((dflt.y_obs == c).sum()) == 25 for c in (3, 5, 8))
    assert int((dflt.y_obs == UNLABELLED).sum()) == 75
    assert dflt.positive[[3, 5, 8]].tolist() == [1.0, 1.0, 1.0]
    assert fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=1.0)) is None
    view = fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=0.5, pu_split="seed"))
    pos = fedpu.positive_classes([3, 5, 8], 2, 1, 4)
    (neg,) = sorted({3, 5, 8} - set(pos))
    counts = {c: int((view.y_obs == c).sum()) for c in (3, 5, 8)}
    assert counts == {pos[0]: 25, pos[1]: 25, neg: 0}
    assert int((view.y_obs == UNLABELLED).sum()) == 100
    kept = view.y_obs != UNLABELLED
    assert torch.equal(view.y_obs[kept], y[kept])
    want_m = np.zeros(10, dtype=np.float32)
    want_m[pos] = 1.0
    assert view.positive.tolist() == want_m.tolist()
    want_pi = torch.zeros(10)
    want_pi[pos] = 0.25
    want_pi[neg] = 0.5
    assert torch.allclose(view.prior, want_pi)
    # rate 1 labels everything under the seed's split (its Fig. 4 rate-1 column is the supervised number) ...
    assert fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=1.0, pu_split="seed")) is None
    # ... while FedPU's code ('official') still leaves the non-positive class unlabelled: pi = 1 on it
    off = fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=1.0, pu_split="official"))
    assert {c: int((off.y_obs == c).sum()) for c in (3, 5, 8)} == {pos[0]: 50, pos[1]: 50, neg: 0}
    assert float(off.prior[neg]) == pytest.approx(1.0)
    # 'held' named explicitly is the default
    held = fedpu.make_view(data, 10, 1, fedpu.PUParams(positive_rate=0.5, pu_split="held"))
    assert torch.equal(held.y_obs, dflt.y_obs) and torch.equal(held.prior, dflt.prior)
