"""The bad-input suite: every case runs the ``raysim`` command in-process and checks the exit code, that the message
names the offending field, and that nothing is left behind (no run directory, no stray files). Divergence (exit 1)
keeps only the visible ``<out>.incomplete`` with run.json saying where it stopped, never a result table."""
from __future__ import annotations

import json

import pytest
import yaml

from raysim.app.cli import main
from raysim.engine.callbacks import EvalCallback
from raysim.io.rundir import RunDir
from tests.conftest import tiny_config

# (--set overrides, field the message must name)
CONFIG_CASES = [
    (["backend.name=ray", "backend.num_actors=2", "backend.state_memory_mb=100000000"], "backend.state_memory_mb"),
    (["algorithm.name=fedprot"], "algorithm.name"),
    (["rounds=0"], "rounds"),
    (["rounds=abc"], "rounds"),
    (["train.lr=-1"], "train.lr"),
    (["train.lr=fast"], "train.lr"),
    (["train.optimizer=adamw"], "train.optimizer"),
    (["train.lrr=0.1"], "train.lrr"),
    (["clients_per_round=100"], "clients_per_round"),
    (["on_nonfinite=ignore"], "on_nonfinite"),
    (["on_client_failure=retry"], "on_client_failure"),
    (["eval.every=0"], "eval.every"),
    (["backend.name=dask"], "backend.name"),
    (["backend.device=tpu"], "backend.device"),
    (["backend.num_gpus=1.5"], "backend.num_gpus"),
    (["algorithm.params.lam=-1"], "algorithm.params.lam"),
    (["algorithm.params.nope=1"], "algorithm.params.nope"),
    (["output.checkpoint_every=-1"], "output.checkpoint_every"),
    (["data.dataset=imagenet"], "data.dataset"),
    (["data.num_clients=0"], "data.num_clients"),
    (["data.partition=random"], "data.partition"),
    (["data.partition_params.shots=1000"], "data.partition_params.shots"),
    (["data.test_fraction=1.5"], "data.test_fraction"),
    (["model.arch=transformer"], "model.arch"),
    (["model.params.depth=3"], "model.params.depth"),
    (["model.assign=random"], "model.assign"),
    (["model.per_client=[{arch: mlp, params: {embed_dim: 16}}, {arch: mlp, params: {embed_dim: 8}}]"], "model.per_client"),
    (["algorithm.name=fedavg", "model.per_client=[{arch: mlp}, {arch: cnn_small}]"], "model.per_client"),
    (["env.trace.devices=/nonexistent/devices.csv"], "env.trace.devices"),
    (["env.participation.availability.mode=trace"], "env.trace.availability"),
    (["env.preset=moon-base"], "env.preset"),
]


def write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def only_config_left(tmp_path, *keep):
    return sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.yaml", *keep])


@pytest.mark.parametrize("overrides,field", CONFIG_CASES, ids=[c[1] + ":" + c[0][-1][:30] for c in CONFIG_CASES])
def test_bad_config_value(tmp_path, capsys, overrides, field):
    cfg = write(tmp_path, tiny_config())
    args = ["run", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"'{field}" in err, err
    assert err.count("\n") <= 2, err
    assert only_config_left(tmp_path)


def test_cuda_requested_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), "--set", "backend.device=cuda"]) == 2
    assert "'backend.device'" in capsys.readouterr().err
    assert only_config_left(tmp_path)


def test_malformed_yaml_names_the_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("rounds: [1, 2\n")
    assert main(["run", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 2" in err and "unicode string" not in err and err.count("\n") <= 2
    assert only_config_left(tmp_path)


def test_config_that_is_not_a_mapping_or_missing(tmp_path, capsys):
    write(tmp_path, [1, 2])
    assert main(["run", str(tmp_path / "c.yaml")]) == 2
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("'CONFIG'") == 2 and "nope.yaml" in err
    assert only_config_left(tmp_path)


@pytest.mark.parametrize("arg,field", [(["--set", "nokey"], "nokey"), (["--seeds", "3-1"], "--seeds")])
def test_bad_command_line(tmp_path, capsys, arg, field):
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), *arg]) == 2
    assert f"'{field}'" in capsys.readouterr().err
    assert only_config_left(tmp_path)


def test_out_under_a_file_fails_before_data_loading(tmp_path, capsys, monkeypatch):
    import raysim.engine.prepare

    def no_data(*a, **k):
        raise AssertionError("data was loaded")

    monkeypatch.setattr(raysim.engine.prepare, "build_federated_data", no_data)
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--out", str(cfg / "run")]) == 2
    err = capsys.readouterr().err
    assert "'--out'" in err and "not a directory" in err
    assert main(["run", str(cfg), "--out", str(cfg)]) == 2  # an existing file
    assert "'--out'" in capsys.readouterr().err
    assert only_config_left(tmp_path)


def test_out_held_by_a_running_run(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    held = RunDir.claim(tmp_path / "out")  # as a live run in another process would
    try:
        assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "'--out'" in err and "being written by a running run" in err and "pid" in err
        assert only_config_left(tmp_path, "out.incomplete")
    finally:
        held.abandon(keep=False)
    assert only_config_left(tmp_path)


def test_resume_of_a_different_config(tmp_path, capsys):
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    cfg = write(tmp_path, tiny_config(rounds=2, output={"progress": False, "checkpoint_every": 1}))

    def crash(round_idx, table):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(make_config(yaml.safe_load(cfg.read_text())), out_dir=tmp_path / "run", callbacks=[EvalCallback(crash)])
    before = sorted(p.name for p in (tmp_path / "run.incomplete").rglob("*"))
    assert main(["run", str(cfg), "--resume", str(tmp_path / "run.incomplete"), "--set", "seed=8"]) == 2
    err = capsys.readouterr().err
    assert "'resume'" in err and "different configuration" in err
    assert sorted(p.name for p in (tmp_path / "run.incomplete").rglob("*")) == before  # untouched
    assert only_config_left(tmp_path, "run.incomplete")


def test_resume_without_checkpoints(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    (tmp_path / "empty.incomplete").mkdir()
    assert main(["run", str(cfg), "--resume", str(tmp_path / "empty.incomplete")]) == 2
    assert "'resume'" in capsys.readouterr().err
    assert only_config_left(tmp_path, "empty.incomplete") and not any((tmp_path / "empty.incomplete").iterdir())


def test_nonfinite_loss_stops_with_exit_1_and_no_result_table(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), "--set", "train.lr=1e6", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "diverged: round 0, client 0, stage 'update': train_loss=nan" in err and "on_nonfinite" in err
    assert only_config_left(tmp_path, "out.incomplete")
    assert not list(tmp_path.rglob("results.parquet"))
    info = json.loads((tmp_path / "out.incomplete" / "run.json").read_text())
    assert info["status"] == "diverged" and info["nonfinite"] == {"round": 0, "client_id": 0, "stage": "update",
                                                                  "what": "train_loss=nan"}


@pytest.mark.parametrize("params,field", [
    ({"train.lrr": {"type": "float", "low": 0.1, "high": 1}}, "space.params.train.lrr"),
    ({"train.lr": {"type": "float", "low": 1, "high": 0.1}}, "space.params.train.lr"),
])
def test_bad_tuning_space(tmp_path, capsys, params, field):
    cfg = write(tmp_path, tiny_config())
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"params": params}))
    assert main(["tune", str(cfg), "--space", str(space), "--trials", "1", "--out", str(tmp_path / "t")]) == 2
    assert f"'{field}" in capsys.readouterr().err
    assert only_config_left(tmp_path, "space.yaml")


def test_report_of_a_missing_metric_or_no_runs(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 2
    assert "no results.parquet" in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_population_that_cannot_fit_is_refused_before_any_data_is_built(tmp_path, capsys):
    """A population whose index data alone exceeds half the free memory: one line naming data.num_clients with the
    estimate and the keys to change, exit 2, nothing written; the estimate itself on a hand example."""
    from raysim.app.cli import main as cli_main
    from raysim.config import make_config
    from raysim.engine.prepare import (INDEX_BYTES, POPULATION_BYTES_PER_CLIENT, _check_population_memory,
                                        population_bytes)
    from raysim.errors import ConfigError
    from tests.conftest import tiny_config

    cfg = make_config(tiny_config(data__num_clients=1000, data__partition="iid",
                                  data__partition_params={"samples_per_client": 40, "test_per_client": 10}))
    assert population_bytes(cfg) == 1000 * (INDEX_BYTES * 50 + POPULATION_BYTES_PER_CLIENT)
    _check_population_memory(cfg, avail=2 * population_bytes(cfg))  # exactly half: fits
    with pytest.raises(ConfigError, match=r"data\.num_clients.*1,000 clients \(samples_per_client 40 x "
                                          r"test_per_client 10\) need about .* GiB .* lower data\.num_clients"):
        _check_population_memory(cfg, avail=2 * population_bytes(cfg) - 2)
    out = tmp_path / "runs"
    code = cli_main(["run", "configs/fedproto_mnist5k.yaml", "--out", str(out), "--set", "data.num_clients=10000000",
                     "--set", "data.partition=iid", "--set", "backend.name=sequential",
                     "--set", "data.partition_params={samples_per_client: 100000, test_per_client: 10}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "data.num_clients" in err and "GiB" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())
