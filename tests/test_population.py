"""Population scale: seeded evaluation samples (eval.fraction), never-trained clients evaluated without keeping
their state, clients without test data skipped, iid with replacement for populations larger than the data."""
import pytest

from raysim.config import make_config
from raysim.engine.loop import eval_clients, run_experiment
from raysim.engine.prepare import prepare
from raysim.runner.runners import ClientRunner
from raysim.errors import ConfigError
from raysim.steps import EVALUATION

def pop_cfg(**over):
    cfg = {"name": "pop", "seed": 4, "rounds": 2, "clients_per_round": 3,
           "data": {"dataset": "synthetic", "num_clients": 40, "partition": "iid",
                    "partition_params": {"replace": True, "samples_per_client": 3, "test_per_client": 1}},
           "model": {"arch": "mlp", "params": {"hidden": 8, "embed_dim": 8}},
           "algorithm": {"name": "local", "params": {}}, "eval": {"every": 1, "fraction": 0.25},
           "output": {"progress": False}}
    cfg.update(over)
    return make_config(cfg)

def test_eval_fraction_is_a_seeded_sample():
    cfg = pop_cfg()
    a, b = eval_clients(cfg, 0), eval_clients(cfg, 0)
    assert a == b and len(a) == 10 and a != eval_clients(cfg, 1)
    df = run_experiment(cfg, write=False).table
    acc = df[(df["scope"] == "client") & (df["metric"] == "test_acc")]
    assert sorted(acc[acc["round"] == 0]["client_id"]) == a
    with pytest.raises(ConfigError) as e:
        pop_cfg(eval={"fraction": 1.5})
    assert e.value.field == "eval.fraction"

def test_evaluating_a_never_trained_client_keeps_no_state():
    prep = prepare(pop_cfg())
    runner = ClientRunner(prep.spec, prep.fed_data.clients)

    payload = {}
    _, reps = runner.run_client_step(EVALUATION[0], payload, 0, 0, [0, 1, 2])
    assert all(r.ok for r in reps) and runner.store.client_ids() == []

def test_clients_without_test_data_are_skipped():
    cfg = pop_cfg(data={"dataset": "synthetic", "num_clients": 30, "partition": "iid",
                        "partition_params": {"replace": True, "samples_per_client": 2, "test_per_client": 0}},
                  eval={"every": 1, "fraction": 1.0})
    df = run_experiment(cfg, write=False).table
    assert not (df["metric"] == "test_acc").any() and (df["metric"] == "train_loss").any()

def test_iid_with_replacement_serves_more_clients_than_samples():
    cfg = pop_cfg(data={"dataset": "digits", "num_clients": 3000, "partition": "iid",
                        "partition_params": {"replace": True, "samples_per_client": 1, "test_per_client": 1}})
    prep = prepare(cfg)  # digits has 1,797 images: 3,000 clients only fit with replacement
    assert len(prep.fed_data.clients) == 3000 and all(c.num_train == 1 for c in prep.fed_data.clients[:50])


def _eager_client(cfg, i):
    """Client i as the eager build made it before clients became index ranges (the reference for LazyClients)."""
    import numpy as np

    from raysim import rng as rngmod
    from raysim.data.datasets import load_dataset
    from raysim.data.federated import ClientData, _split_test_pool, rotate, split_validation
    from raysim.data.arrays import Pools
    from raysim.data.partition import run_partitioner

    d = cfg.data
    ds = load_dataset(d.dataset, d.root)
    train, test = _split_test_pool(ds, d.test_fraction, cfg.seed) if ds.test is None else (ds.train, ds.test)
    part = run_partitioner(d.partition, dict(d.partition_params),
                           Pools(train.y.numpy(), test.y.numpy(), d.num_clients,
                                 rngmod.numpy_rng(cfg.seed, rngmod.NO_ROUND, rngmod.SERVER, "partition"), ds.num_classes))
    tr_idx = np.asarray(part.train[i])
    tr_idx, va_idx = split_validation(tr_idx, d.val_fraction, rngmod.numpy_rng(cfg.seed, rngmod.NO_ROUND, i, "val-split"))
    tr, te, va = train.subset(tr_idx), test.subset(part.test[i]), train.subset(va_idx)
    a = d.rotations[i % len(d.rotations)]
    return ClientData(i, rotate(tr.x, a), tr.y, rotate(te.x, a), te.y, sorted(set(tr.y.tolist())), ds.num_classes,
                      train.norm, x_val=rotate(va.x, a), y_val=va.y).compact()


@pytest.mark.parametrize("rotations", [[0, 90], [0, 30]])
def test_lazy_clients_equal_the_eager_build(rotations):
    """Clients are index ranges into the pools, built on access: each equals the eager construction bit for bit
    (uint8 where exact, rotated floats where not), and a runner's ClientSet hosts, adopts and forgets clients."""
    import torch

    from raysim.data.federated import ClientSet, LazyClients, client_sizes

    cfg = make_config({"name": "lazy", "seed": 5, "data": {
        "dataset": "digits", "num_clients": 8, "partition": "dirichlet", "val_fraction": 0.25, "rotations": rotations,
        "partition_params": {"alpha": 0.5, "samples_per_client": 30, "test_ratio": 0.3}}, "model": {"arch": "mlp"},
        "algorithm": {"name": "local", "params": {}}, "output": {"progress": False}})
    fed = prepare(cfg).fed_data
    assert isinstance(fed.clients, LazyClients) and len(fed.clients) == 8
    for i in range(8):
        got, ref = fed.clients[i], _eager_client(cfg, i)
        for f in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
            assert torch.equal(getattr(got, f), getattr(ref, f)), (i, f)
        assert got.classes == ref.classes and got.is_compact == ref.is_compact
    assert client_sizes(fed.clients, "val") == [int(c.y_val.shape[0]) for c in fed.clients]
    s = fed.summary()
    assert s["classes"] == [c.classes for c in fed.clients] and s["train_sizes"] == [c.num_train for c in fed.clients]
    hosted = ClientSet(fed.clients.source, [1, 3, 5], cache=1)
    assert sorted(hosted) == [1, 3, 5] and 2 not in hosted and len(hosted) == 3
    assert torch.equal(hosted[3].x_train, fed.clients[3].x_train)
    with pytest.raises(KeyError):
        hosted[2]
    hosted[2] = fed.clients[2]  # adopted from another runner
    del hosted[3]
    assert sorted(hosted) == [1, 2, 5] and 3 not in hosted
    import pickle

    back = pickle.loads(pickle.dumps(hosted))
    assert sorted(back) == [1, 2, 5] and torch.equal(back[5].y_test, fed.clients[5].y_test)
