"""The command line: runs, lists, and bad input exits 2 with one message naming the field and no partial results."""

import yaml

from raysim.io import results
from raysim.app.cli import main
from tests.conftest import run_cli, tiny_config


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


def test_gpu_request_without_gpus_fails_before_ray_starts(tmp_path):
    """The client actors' GPUs (backend.num_gpus) and the server's (backend.server_num_gpus) on a machine without
    any: each refused in one line naming its key, before Ray starts, nothing written. In a fresh process (the test
    session's own Ray declares fake GPUs; this is about a plain machine), both runs in one (``raysim run``'s main)."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from tests.conftest import ROOT

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA")
    runs = [[str(write(tmp_path, tiny_config(backend={"name": "ray", "num_actors": 2, **b}), f"{k}.yaml")),
             "--out", str(tmp_path / f"out{k}")]
            for k, b in enumerate(({"num_gpus": 0.5}, {"server_num_gpus": 1}))]
    code = ("import json, sys; from raysim.app.cli import main\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    code = main(['run', *args]); print(f'exit {code}', file=sys.stderr, flush=True)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 4 and lines[1] == lines[3] == "exit 2", lines
    assert "'backend.num_gpus'" in lines[0] and "has none" in lines[0]
    assert "'backend.server_num_gpus'" in lines[2] and "has none" in lines[2]
    assert "ray.init" not in p.stderr and not any((tmp_path / f"out{k}").exists() for k in (0, 1))


def test_installed_entry_point_lists_everything():
    out = run_cli("list", check=True, timeout=120).stdout
    for word in ("fedproto", "fedavg", "local", "mnist5k", "fashion_mnist", "nway_kshot", "dirichlet", "cnn_mnist"):
        assert word in out
