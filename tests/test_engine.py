"""The round loop on the sequential backend: message sizes, failures as values, checkpoints, result files."""
import pandas as pd
import pytest
import torch

from raysim.io import results
from raysim.errors import SimulationError
from raysim.engine.prepare import prepare
from raysim.engine.callbacks import EvalCallback
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.io.checkpoints import load_checkpoint
from tests.conftest import register_for_test


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, failing_fedavg="tests.failing_algo:FailingFedAvg")



def client_rows(df, metric):
    return df[(df["scope"] == "client") & (df["metric"] == metric)]


def test_fedproto_message_sizes_are_exact(tiny, tmp_path):
    cfg = tiny(rounds=2)
    prep = prepare(cfg)
    res = run_experiment(cfg, out_dir=tmp_path / "run")
    df = res.table
    d = prep.task.build_model(0).embed_dim
    for c in prep.fed_data.clients:
        n_i = len(c.classes)
        up = client_rows(df, "up_floats")
        up = up[(up["client_id"] == c.client_id)]["value"].tolist()
        assert up == [n_i * d] * 2  # n_i prototypes of d floats
        upb = client_rows(df, "up_bytes")
        upb = upb[upb["client_id"] == c.client_id]["value"].tolist()
        assert upb == [n_i * d * 4 + n_i * 8 * 2] * 2  # float32 prototypes + int64 class ids and counts
    down = client_rows(df, "down_floats")
    assert down[down["round"] == 0]["value"].eq(0).all()  # round 0: no global prototypes yet
    classes_seen = len({k for c in prep.fed_data.clients for k in c.classes})
    assert down[down["round"] == 1]["value"].eq(classes_seen * d).all()
    total = df[(df["scope"] == "total") & (df["metric"] == "up_floats")]["value"].tolist()
    assert total == [sum(len(c.classes) for c in prep.fed_data.clients) * d] * 2


def test_fedavg_message_is_the_whole_model(tiny):
    cfg = tiny(rounds=1, algorithm={"name": "fedavg", "params": {}})
    prep = prepare(cfg)
    res = run_experiment(cfg, write=False)
    n_params = sum(p.numel() for p in prep.task.build_model(0).parameters())
    up = client_rows(res.table, "up_floats")["value"]
    assert up.eq(n_params).all()
    assert client_rows(res.table, "down_floats:weights")["value"].eq(n_params).all()


def test_results_file_metadata_and_load(tiny, tmp_path):
    cfg = tiny(rounds=2)
    res = run_experiment(cfg, out_dir=tmp_path / "run")
    df = results.load(tmp_path / "run")
    pd.testing.assert_frame_equal(df, res.table, check_exact=True)
    assert list(df.columns) == results.COLUMNS
    meta = results.load_metadata(tmp_path / "run")
    assert meta["seed"] == 7 and meta["config"]["algorithm"]["name"] == "fedproto"
    assert meta["versions"]["torch"] and meta["versions"]["cpu"] and meta["data_notes"]
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "checkpoints" / "final" / "meta.pt").exists()
    fin = results.final(df)
    last = df[(df.scope == "client") & (df.metric == "test_acc") & (df["round"] == 1)]
    assert fin["round"].iloc[0] == 1 and fin["mean"].iloc[0] == pytest.approx(last["value"].mean())


def test_checkpoint_holds_every_client_and_server_state(tiny, tmp_path):
    cfg = tiny(rounds=2, output={"progress": False, "checkpoint_every": 1})
    run_experiment(cfg, out_dir=tmp_path / "run")
    ck = load_checkpoint(tmp_path / "run" / "checkpoints" / "round_00000")
    assert ck["round_idx"] == 0 and sorted(ck["client_states"]) == list(range(6))
    assert ck["server_state"]["mask"].any()
    final = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")
    assert not torch.equal(final["client_states"][0]["model"]["head.weight"], ck["client_states"][0]["model"]["head.weight"])


def test_client_failure_is_a_value_and_run_continues(tiny):
    cfg = tiny(rounds=3, algorithm={"name": "failing_fedavg", "params": {"fail_clients": [2], "fail_round": 1}})
    res = run_experiment(cfg, write=False)
    failed = client_rows(res.table, "failed")
    assert failed[["round", "client_id"]].values.tolist() == [[1, 2], [2, 2]]
    f = res.metadata["failures"][0]
    assert f["client_id"] == 2 and f["round"] == 1 and f["stage"] == "update" and "boom on client 2" in f["error"]
    parts = res.table[(res.table["scope"] == "total") & (res.table["metric"] == "participants")]["value"].tolist()
    assert parts == [6, 5, 5]


def test_every_client_failing_stops_the_run_and_writes_nothing(tiny, tmp_path):
    cfg = tiny(rounds=3, algorithm={"name": "failing_fedavg", "params": {"fail_clients": list(range(6)), "fail_round": 1}})
    with pytest.raises(SimulationError, match="round 1, step 'update': 6 of 6 clients failed"):
        run_experiment(cfg, out_dir=tmp_path / "run")
    assert not any(tmp_path.iterdir())


def test_partial_participation_is_seeded(tiny):
    cfg = tiny(rounds=3, clients_per_round=3)
    a = run_experiment(cfg, write=False).table
    b = run_experiment(cfg, write=False).table
    pd.testing.assert_frame_equal(without_timing(a), without_timing(b), check_exact=True)
    parts = client_rows(a, "up_floats")
    assert parts.groupby("round").size().tolist() == [3, 3, 3]


@pytest.mark.parametrize("algo", ["local", "fedavg", "fedproto"])
def test_each_algorithm_learns_on_synthetic(tiny, algo):
    cfg = tiny(rounds=4, algorithm={"name": algo, "params": {}}, train={"local_epochs": 3, "batch_size": 8, "lr": 0.05})
    res = run_experiment(cfg, write=False)
    acc, _ = res.final()
    assert acc > 0.8, acc  # 2-4 classes per client, well separated clusters
    if algo == "fedavg":  # the global model on the global test set improves round after round
        g = res.table[res.table["metric"] == "global_test_acc"]["value"].tolist()
        assert g[-1] > g[0] + 0.3


def test_fedproto_heterogeneous_models(tiny):
    cfg = tiny(rounds=2, model={"assign": "blocks", "per_client": [
        {"arch": "mlp", "params": {"hidden": 16, "embed_dim": 16}},
        {"arch": "mlp", "params": {"hidden": 48, "embed_dim": 16}},
        {"arch": "cnn_small", "params": {"channels": 8, "embed_dim": 16}}]})
    prep = prepare(cfg)
    assert [a.arch for a in prep.task.archs] == ["mlp", "mlp", "mlp", "mlp", "cnn_small", "cnn_small"]
    res = run_experiment(cfg, write=False)
    assert res.final("test_acc_proto")[0] > 0.5  # chance: 1/3 (3 local classes); 0.68 with this seed


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_only_the_newest_round_checkpoints_stay_and_a_resume_from_them_is_exact(tiny, tmp_path, keep):
    over = dict(rounds=5, eval={"every": 1}, output={"progress": False, "checkpoint_every": 1, "keep_checkpoints": keep})
    full = run_experiment(tiny(**over), out_dir=tmp_path / "full")
    names = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    rounds = [f"round_{r:05d}" for r in range(5)]
    assert names == ["final"] + (rounds if keep == 0 else rounds[-keep:])
    run_experiment(tiny(**{**over, "rounds": 3}), out_dir=tmp_path / "short")
    assert sorted(p.name for p in (tmp_path / "short" / "checkpoints").iterdir() if p.name != "final") == \
        (rounds[:3] if keep == 0 else rounds[:3][-keep:])
    resumed = run_experiment(tiny(**over), resume=tmp_path / "short", out_dir=tmp_path / "resumed")
    pd.testing.assert_frame_equal(without_timing(full.table), without_timing(resumed.table), check_exact=True)


def test_pruning_orders_rounds_by_number_removes_by_rename_and_the_hint_names_what_is_kept(tmp_path):
    from raysim.io.checkpoints import find_checkpoint, prune_checkpoints
    from raysim.io.resume_points import damaged_hint

    ck = tmp_path / "checkpoints"
    for name in ("setup", "round_99989", "round_99999", "round_100009", "round_00005.trash", "round_00007.tmp"):
        (ck / name).mkdir(parents=True)
        (ck / name / "meta.pt").write_bytes(b"x")
    assert find_checkpoint(tmp_path).name == "round_100009"  # by number, not by name
    assert damaged_hint(ck / "round_99989").startswith(f"remove {ck / 'round_99989'} to resume from the checkpoint "
                                                       f"before it (setup)")
    assert prune_checkpoints(tmp_path, 2) == ["setup", "round_99989"]
    assert sorted(p.name for p in ck.iterdir()) == ["round_00007.tmp", "round_100009", "round_99999"]
    assert "(round_99999)" in damaged_hint(ck / "round_100009")
    assert damaged_hint(ck / "round_99999").startswith("no checkpoint before round_99999 is kept")
    assert prune_checkpoints(tmp_path, 2) == [] and prune_checkpoints(tmp_path, 0) == []


def test_keep_checkpoints_must_not_be_negative(tiny):
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny(output={"keep_checkpoints": -1})
    assert e.value.field == "output.keep_checkpoints"


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("use_env", [False, True])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tiny, tmp_path, use_env):
    over = dict(rounds=5, eval={"every": 1}, output={"progress": False, "checkpoint_every": 2})
    if use_env:
        over["env"] = {"preset": "mobile-heterogeneous"}
    full = run_experiment(tiny(**over), out_dir=tmp_path / "full")

    def crash(round_idx, table):
        if round_idx == 3:
            raise _Crash("killed")
        return False

    with pytest.raises(_Crash) as e:
        run_experiment(tiny(**over), out_dir=tmp_path / "run", callbacks=[EvalCallback(crash)])
    kept = tmp_path / "run.incomplete"
    assert kept.is_dir() and not (tmp_path / "run").exists()
    assert "--resume" in "".join(getattr(e.value, "__notes__", []))
    resumed = run_experiment(tiny(**over), resume=kept)
    assert resumed.out_dir == tmp_path / "run" and not kept.exists()
    pd.testing.assert_frame_equal(without_timing(full.table), without_timing(resumed.table), check_exact=True)
    pd.testing.assert_frame_equal(results.load(tmp_path / "run"), resumed.table, check_exact=True)


def test_resume_refuses_a_different_config(tiny, tmp_path):
    from raysim.errors import ConfigError

    over = dict(rounds=3, output={"progress": False, "checkpoint_every": 1})

    def crash(round_idx, table):
        raise _Crash("killed")

    with pytest.raises(_Crash):
        run_experiment(tiny(**over), out_dir=tmp_path / "run", callbacks=[EvalCallback(crash)])
    with pytest.raises(ConfigError) as e:
        run_experiment(tiny(**over, seed=8), resume=tmp_path / "run.incomplete")
    assert e.value.field == "resume"
    # more rounds are allowed: continue a finished-early run further
    longer = run_experiment(tiny(**{**over, "rounds": 4}), resume=tmp_path / "run.incomplete")
    assert longer.table["round"].max() == 3 and longer.table["run_id"].nunique() == 1


def test_fedproto_official_reproduction_options(tiny):
    """proto_collect=during_train (official: embeddings of the last local epoch), plain-mean aggregation and
    unrestricted prototype inference run and differ from the defaults."""
    base = tiny(rounds=2, train={"local_epochs": 2, "batch_size": 8, "lr": 0.05})
    opts = tiny(rounds=2, train={"local_epochs": 2, "batch_size": 8, "lr": 0.05},
                algorithm={"name": "fedproto", "params": {"proto_collect": "during_train", "proto_agg": "mean",
                                                          "restrict_local_classes": False}})
    a, b = run_experiment(base, write=False), run_experiment(opts, write=False)
    assert b.final("test_acc_proto")[0] > 0.5  # chance: 1/10 (unrestricted inference); 0.68 with this seed
    pa = client_rows(a.table, "test_acc_proto")["value"].to_numpy()
    pb = client_rows(b.table, "test_acc_proto")["value"].to_numpy()
    assert not (pa == pb).all()


# ---------------------------------------------------------------------------------------------------------------
# the pure client step: explicit optimiser state and generators

def test_persist_optimizer_keeps_momentum_in_the_client_state_and_changes_the_table(tiny, tmp_path):
    base = dict(rounds=3, algorithm={"name": "fedavg", "params": {}}, train={"local_epochs": 1, "batch_size": 8,
                                                                          "lr": 0.05, "momentum": 0.9})
    off = run_experiment(tiny(**base), write=False).table
    on_cfg = tiny(**{**base, "train": {**base["train"], "persist_optimizer": True},
                     "output": {"progress": False, "checkpoint_every": 1}})
    on = run_experiment(on_cfg, out_dir=tmp_path / "run").table
    key = ["round", "client_id", "scope", "metric"]
    m = without_timing(off).merge(without_timing(on), on=key, suffixes=("_off", "_on"))
    r0 = m[m["round"] == 0]
    assert (r0["value_off"] == r0["value_on"]).all()  # round 0 starts without momentum either way
    later = m[(m["round"] > 0) & (m["metric"] == "train_loss")]
    assert (later["value_off"] != later["value_on"]).any()
    ck = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")
    opt = ck["client_states"][0]["opt"]
    assert set(opt) == {n for n, _ in prepare(on_cfg).task.build_model(0).named_parameters()}
    assert all(torch.isfinite(v["momentum_buffer"]).all() for v in opt.values())


def test_during_train_collection_uses_one_optimiser_for_all_epochs(tiny, monkeypatch):
    import raysim.training as training

    made = []
    real = training.make_optimizer
    monkeypatch.setattr(training, "make_optimizer", lambda *a, **k: made.append(1) or real(*a, **k))
    cfg = tiny(rounds=1, train={"local_epochs": 3, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
               algorithm={"name": "fedproto", "params": {"proto_collect": "during_train"}})
    res = run_experiment(cfg, write=False)
    assert len(made) == cfg.data.num_clients  # one optimiser per client update, momentum never reset
    assert (res.table["metric"] == "up_floats").any()


def test_dropout_masks_come_from_the_explicit_generator():
    from raysim.models import Dropout

    x = torch.ones(4, 3, 5, 5)
    d = Dropout(0.5).train()
    d.generator = torch.Generator().manual_seed(3)
    a = d(x)
    torch.manual_seed(0)  # the global RNG plays no part
    d.generator = torch.Generator().manual_seed(3)
    b = d(x)
    assert torch.equal(a, b) and set(a.unique().tolist()) <= {0.0, 2.0} and 0 < int((a == 0).sum()) < a.numel()
    c = Dropout(0.5, channelwise=True).train()
    c.generator = torch.Generator().manual_seed(4)
    y = c(x)
    per_channel = y.flatten(2)
    assert ((per_channel == per_channel[..., :1]).all())  # whole channels kept or dropped
    assert torch.equal(Dropout(0.5).eval()(x), x)
