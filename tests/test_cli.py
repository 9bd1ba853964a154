"""The command line: runs, lists, and bad input exits 2 with one message naming the field and no partial results."""

import pytest
import yaml

from raysim.io import results
from raysim.app.cli import main
from tests.conftest import tiny_config


def write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_run_writes_results_and_prints_accuracy(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config(rounds=2))
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), "--set", "algorithm.params.lam=0.5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "final mean local test accuracy" in out and "results.parquet" in out
    meta = results.load_metadata(tmp_path / "out")
    assert meta["config"]["algorithm"]["params"]["lam"] == 0.5


def test_bad_value_exits_2_and_writes_nothing(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--set", "algorithm.name=fedprot"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.name" in err and "fedproto" in err and err.count("\n") == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_bad_data_exits_2(tmp_path, capsys):
    cfg = write(tmp_path, tiny_config())
    assert main(["run", str(cfg), "--set", "data.partition_params.shots=1000"]) == 2
    assert "data.partition_params.shots" in capsys.readouterr().err


def test_missing_and_malformed_config(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    assert main(["run", str(bad)]) == 2
    bad.write_text("- 1\n- 2\n")
    assert main(["run", str(bad)]) == 2
    assert main(["run", str(write(tmp_path, tiny_config())), "--set", "nokey"]) == 2


@pytest.mark.xdist_group("fresh_process")
def test_gpu_request_without_gpus_fails_before_ray_starts(fresh_process):
    """The client actors' GPUs (backend.num_gpus) and the server's (backend.server_num_gpus) on a machine without
    any: each refused in one line naming its key, before Ray starts, nothing written (tests/fresh_process.py: the
    test session's own Ray declares fake GPUs; this is about a plain machine)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    clients, server = fresh_process["runs"]
    for run, key in ((clients, "'backend.num_gpus'"), (server, "'backend.server_num_gpus'")):
        errors = [line for line in run["stderr"].splitlines() if line.startswith("raysim: ")]  # (not a warning)
        assert run["exit"] == 2 and len(errors) == 1, run
        assert key in errors[0] and "has none" in errors[0] and not run["ray_started"], run
    assert fresh_process["files_left"] == ["gpu0.yaml", "gpu1.yaml", "report.json"]  # no run directory


@pytest.mark.xdist_group("fresh_process")
def test_installed_entry_point_lists_everything(fresh_process):
    """``raysim list`` in a fresh process (tests/fresh_process.py)."""
    assert fresh_process["list_exit"] in (0, None)
    for word in ("fedproto", "fedavg", "local", "mnist5k", "fashion_mnist", "nway_kshot", "dirichlet", "cnn_mnist"):
        assert word in fresh_process["list"]
