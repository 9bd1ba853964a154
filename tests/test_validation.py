"""Per-client validation split (data.val_fraction): carved from the training data, disjoint, seeded; evaluated as
val_* metrics next to test_*; tuning reads it by default."""
import dataclasses
import numpy as np
import pytest
import torch

from raysim.config import make_config
from raysim.data import build_federated_data
from raysim.data.federated import split_validation


def test_split_validation_hand_example():
    idx = np.arange(100, 110)
    tr, va = split_validation(idx, 0.3, np.random.default_rng(0))
    assert len(va) == 3 and len(tr) == 7
    assert sorted(np.concatenate([tr, va]).tolist()) == idx.tolist()  # disjoint, together the whole train share
    assert not set(tr.tolist()) & set(va.tolist())
    tr0, va0 = split_validation(idx, 0.0, np.random.default_rng(0))
    assert tr0.tolist() == idx.tolist() and len(va0) == 0
    tr2, va2 = split_validation(idx, 0.3, np.random.default_rng(0))
    assert va2.tolist() == va.tolist()  # seeded


def _data(val):
    cfg = make_config({"data": {"dataset": "mnist5k", "num_clients": 3, "partition": "iid", "val_fraction": val,
                                "partition_params": {"samples_per_client": 40, "test_per_client": 10}}})
    return build_federated_data(cfg.data, 3)


def test_val_split_carved_from_train_and_disjoint():
    base, fd = _data(0.0), _data(0.25)
    for c0, c in zip(base.clients, fd.clients):
        assert not c0.has_val and c0.y_val.numel() == 0
        assert c.num_train == 30 and c.y_val.shape[0] == 10
        # train + val are exactly the client's former training samples (as images), test unchanged
        both = torch.cat([c.x_train, c.x_val]).flatten(1)
        assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, c0.x_train.flatten(1).tolist()))
        assert torch.equal(c.x_test, c0.x_test)
    s = fd.summary()
    assert s["val_sizes"] == [10, 10, 10] and "val_sizes" not in base.summary()
    assert any("validation split" in n for n in s["notes"])


def test_clients_are_built_compact_from_the_encoded_pool(monkeypatch):
    """Clients hold uint8 pixels from the start (the pool encoded once); the same tensors as building each client's
    float images and compacting them one by one."""
    import raysim.data.federated as fdmod

    fast = _data(0.25)
    orig, calls = fdmod.encode_exact, []

    def no_pool(x, norm):  # the first two calls encode the train and test pools: refuse them -> client by client
        calls.append(1)
        return None if len(calls) <= 2 else orig(x, norm)

    monkeypatch.setattr(fdmod, "encode_exact", no_pool)
    slow = _data(0.25)
    for a, b in zip(fast.clients, slow.clients):
        assert a.is_compact and b.is_compact
        for f in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_compact_and_to_keep_the_val_split():
    c = _data(0.25).clients[0].to("cpu")  # decoded float images
    assert not c.is_compact
    small = c.compact()
    assert small.is_compact and small.x_val.dtype == torch.uint8
    back = small.to("cpu")
    assert torch.equal(back.x_val, c.x_val) and torch.equal(back.y_val, c.y_val)
    view = back.validation_view()
    assert torch.equal(view.x_test, c.x_val) and torch.equal(view.y_test, c.y_val)


def test_val_fraction_checked():
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="val_fraction"):
        make_config({"data": {"val_fraction": 1.0}})


def test_evaluate_reports_val_metrics(tmp_path):
    from tests.conftest import tiny_config
    from raysim.io import results
    from raysim.engine.loop import run_experiment

    cfg = make_config(tiny_config(rounds=1, data__val_fraction=0.2))
    res = run_experiment(cfg, out_dir=tmp_path / "r")
    df = results.load(res.out_dir)
    names = set(df[df["scope"] == "client"]["metric"])
    assert {"test_acc", "val_acc", "val_acc_proto"} <= names
    a = df[(df["metric"] == "val_acc") & (df["scope"] == "client")]
    assert a.groupby("round").size().eq(6).all() and a["value"].between(0, 1).all()
    assert "wmean" in set(df[df["metric"] == "val_acc"]["scope"])  # aggregated like test_acc


# ---------------------------------------------------------------------------------------------------------------
# tuning selects on the validation split


def test_objective_reads_val_unless_allowed():
    from raysim.errors import ConfigError
    from tests.conftest import tiny_config
    from tuning.space import parse_space, resolve_objective

    lam = {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 1.0}}
    with_val = make_config(tiny_config(data__val_fraction=0.2))
    s = resolve_objective(parse_space({"params": lam, "objective": {"metric": "test_acc_proto"}}), with_val)
    assert s.objective.metric == "val_acc_proto"
    with pytest.raises(ConfigError) as e:
        resolve_objective(parse_space({"params": lam}), make_config(tiny_config()))
    assert e.value.field == "data.val_fraction"
    said = []
    s = resolve_objective(parse_space({"params": lam, "allow_test_metric": True}), make_config(tiny_config()),
                          log=said.append)
    assert s.objective.metric == "test_acc" and "biased" in said[0]


def test_study_records_seeds_and_report_warns(tmp_path, capsys):
    from raysim.app.cli import main
    from raysim.engine.loop import run_experiment
    from tests.conftest import tiny_config
    from tuning.study import tune

    space = {"params": {"train.lr": {"type": "categorical", "choices": [0.05, 0.01]}}, "pruner": {"name": "none"},
             "sampler": {"name": "random", "seed": 0}, "trial_seed": "trial"}
    res = tune(tiny_config(rounds=1, data__val_fraction=0.2), space, 2, out_dir=tmp_path / "t", log=lambda *a: None)
    assert sorted(res.trials["seed"]) == [7, 8]  # trial_seed: trial -> seed + trial number
    assert "# tuned on seeds: 7, 8" in res.files["best"].read_text()
    import optuna

    from tuning.study import open_storage

    study = optuna.load_study(study_name=res.study_name, storage=open_storage(f"journal:{tmp_path / 't' / 'study.journal'}"))
    assert study.user_attrs["tuned_seeds"] == [7, 8]
    assert study.user_attrs["space"]["objective"]["metric"] == "val_acc"
    for seed in (8, 9):
        run_experiment(make_config(tiny_config(rounds=1, seed=seed)), out_dir=tmp_path / "runs" / f"s{seed}")
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--no-plots",
                 "--tuned-on", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and "seed(s) 8 that the hyperparameters were tuned on" in out
    assert "seed(s) 8 that" in (tmp_path / "rep" / "summary.md").read_text()
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep2"), "--no-plots",
                 "--tuned-on", str(tmp_path / "nope")]) == 2


def test_decoded_cache_admits_while_there_is_room_and_hits_on_cyclic_visits():
    """backend.decoded_cache_mb: clients are admitted while they fit and then stay (a round visits clients in the same
    order, so least-recently-used eviction would never hit once the population exceeds the budget); a cached copy is
    exactly the decoded data; 0 disables the cache."""
    from raysim.engine.prepare import prepare
    from raysim.runner.runners import ClientRunner, _data_nbytes
    from tests.conftest import tiny_config

    prep = prepare(make_config(tiny_config(data__dataset="mnist5k", data__partition="iid",
                                           data__partition_params={"samples_per_client": 40})))
    one = _data_nbytes(prep.fed_data.clients[0].to("cpu"))
    budget_mb = 2.5 * one / 2**20  # room for two clients' decoded data
    spec = dataclasses.replace(prep.spec, runner=dataclasses.replace(prep.spec.runner, decoded_cache_mb=budget_mb))
    runner = ClientRunner(spec, prep.fed_data.clients)
    ids = runner.client_ids()
    assert runner.data[ids[0]].is_compact
    first = [runner._data(c) for c in ids]
    again = [runner._data(c) for c in ids]
    assert [a is b for a, b in zip(first, again)] == [True, True] + [False] * (len(ids) - 2)
    for c, d in zip(ids, again):
        assert torch.equal(d.x_train, runner.data[c].to("cpu").x_train)
    spec = dataclasses.replace(spec, runner=dataclasses.replace(spec.runner, decoded_cache_mb=0))
    off = ClientRunner(spec, prep.fed_data.clients)
    assert off._data(ids[0]) is not off._data(ids[0])
