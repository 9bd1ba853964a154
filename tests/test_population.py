"""Population scale: seeded evaluation samples (eval.fraction), never-trained clients evaluated without keeping
their state, clients without test data skipped, iid with replacement for populations larger than the data."""
import pytest

from raysim.config import ConfigError, make_config
from raysim.driver import eval_clients, prepare, run_experiment
from raysim.runtime import ClientRunner
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
