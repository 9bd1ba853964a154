"""Hostile inputs (issues 25 and 35): names that would write outside the output directory, YAML bombs, unusable tuning
storage, unreachable clusters, values that used to be capped or dropped silently, size errors at their boundaries,
import paths that would call what is not meant to be loaded, every form of --out, damaged result tables, NaN and
duplicate keys, SIGTERM. The probe table is shared with benchmarks/hostile_probes.py (tests/hostile_table.py): every
probe runs the ``raysim`` command in-process and ends as it specifies (its exit code, one line naming the key or
file, no traceback, no raw control character, the directory tree unchanged unless it is a probe that writes)."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
import yaml

from raysim.app.cli import main
from raysim.config import make_config
from raysim.errors import ConfigError, DataError
from tests.conftest import tiny_config
from tests.hostile_table import PROBES, RAY, TUNE, laughs, run_probe, setup, verdict


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding a valid config (output.dir: out) and the hostile files the probes use."""
    w = tmp_path / "work"
    w.mkdir()
    setup(w)
    monkeypatch.chdir(w)
    return w


def listener():
    """A TCP port that accepts connections and never answers (not a Ray cluster)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    conns = []
    def accept():
        try:
            for _ in range(8):
                conns.append(s.accept())
        except OSError:  # closed by the test
            pass

    threading.Thread(target=accept, daemon=True).start()
    return s, s.getsockname()[1]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    from raysim.engine.loop import run_experiment

    root = tmp_path_factory.mktemp("one_run")
    run_experiment(make_config(tiny_config(rounds=1)), out_dir=root / "r")
    return root / "r"


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_probe(probe, tmp_path, request):
    """Every probe of the shared table (tests/hostile_table.py) ends as it specifies: its exit code, one line naming
    the key or file (or none for a probe that succeeds), no traceback, no raw control character, and nothing
    written unless it is a probe that writes."""
    finished = request.getfixturevalue("one_run") if probe.with_run else None
    code, err, changed = run_probe(probe, tmp_path, finished)
    assert verdict(probe, code, err, changed) is None, (verdict(probe, code, err, changed), err)


def test_probe_not_a_ray_cluster(work, capsys):
    s, port = listener()
    try:
        code = main(RAY + ["--set", f"backend.address=127.0.0.1:{port}", "--set", "backend.connect_timeout_s=0.5"])
    finally:
        s.close()
    line = capsys.readouterr().err.strip()
    assert code == 2 and "backend.address" in line and "not a Ray cluster" in line and "\n" not in line
    # what ended it: the configured connect timeout (0.5 s, not the 10 s default), named in the line
    assert "within 0.5 s, backend.connect_timeout_s" in line, line
    assert sorted(p.name for p in work.iterdir()) == sorted(p.name for p in work.iterdir() if p.name != "out")


def test_probe_damaged_run_in_report_dir(work, capsys):
    """report over a directory whose only run is damaged: one line, exit 2, no report written."""
    from raysim.engine.loop import run_experiment

    run_experiment(make_config(tiny_config(rounds=1)), out_dir=work / "runs" / "r")
    (work / "runs" / "r" / "results.parquet").write_bytes(b"PAR1")
    assert main(["report", "runs", "--out", "rep", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "no readable result table" in err.strip().splitlines()[-1] and not (work / "rep").exists()
    assert main(["runs", "runs"]) == 0
    assert "damaged (results.parquet" in capsys.readouterr().out


def test_probe_notices_instead_of_silence(work, capsys):
    """Values that are capped or unused say so (and the dry run still passes)."""
    import raysim.engine.prepare

    raysim.engine.prepare._NOTICED.clear()  # notices are said once per process
    code = main(["run", "c.yaml", "--dry-run", "--backend", "ray", "--set", "backend.num_actors=10",
                 "--set", "backend.num_cpus=0.01",
                 "--set", "model.per_client=[" + ", ".join(["{arch: mlp, params: {hidden: 8, embed_dim: 4}}"] * 8) + "]"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "backend.num_actors=10 exceeds data.num_clients=6" in err
    assert "model.per_client lists 8 architectures but data.num_clients is 6" in err


def test_output_progress_false_is_honoured(work, capsys):
    assert main(["run", "c.yaml", "--set", "rounds=1", "--set", "output.progress=false"]) == 0
    err = capsys.readouterr().err
    assert "round/s" not in err and "it/s" not in err and "|" not in err, err


# -- the Python API --------------------------------------------------------------------------------------------------

def test_api_billion_laughs_refused_with_bounded_memory(tmp_path):
    import raysim

    f = tmp_path / "laughs.yaml"
    f.write_text(laughs(9))  # 9**9 = 387 million strings once expanded
    with pytest.raises(ConfigError, match="billion laughs"):  # first refusal: imports and caches warmed up
        raysim.load_config(f)
    tracemalloc.start()  # memory measured on a second refusal: refused before expanding, not after
    try:
        with pytest.raises(ConfigError, match="billion laughs"):
            raysim.load_config(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_api_unsafe_name_never_writes(tmp_path):
    from raysim.engine.loop import run_experiment

    cfg = dataclasses.replace(make_config(tiny_config()), name="../escape")  # built without validation
    with pytest.raises(ConfigError, match="'name'"):
        run_experiment(cfg, out_dir=None)
    cfg = dataclasses.replace(make_config(tiny_config(output={"dir": str(tmp_path / "out"), "progress": False})),
                              name="a/../../b")
    with pytest.raises(ConfigError):
        run_experiment(cfg)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "/abs", "x\\y", "a\x00b", "\u202eexe", "a:b/c", "-", ""])
def test_hostile_names_family(name):
    with pytest.raises(ConfigError) as e:
        make_config(tiny_config(name=name))
    assert e.value.field == "name"


@pytest.mark.parametrize("name", ["tiny", "fedproto_mnist5k", "i10-FedProto-paper:weighted_lam1", "a.b+c=d", "7"])
def test_safe_names_pass(name):
    assert make_config(tiny_config(name=name)).name == name


def test_api_tune_storage_checked_before_the_study(tmp_path):
    from tuning.space import parse_space
    from tuning.study import tune

    space = parse_space({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 2.0}},
                         "objective": {"metric": "val_acc"}})
    with pytest.raises(ConfigError) as e:
        tune(tiny_config(data__val_fraction=0.25), space, 1, storage="mongodb://h/db", out_dir=tmp_path / "t",
             log=lambda *_: None)
    assert e.value.field == "--storage"
    assert not (tmp_path / "t").exists()


def test_storage_server_that_never_answers_is_one_line(work, capsys, monkeypatch):
    """A server that accepts connections but never answers: the TCP check passes, the driver's own connect timeout
    ends it, and the error is one line naming --storage."""
    from tuning import storage, study

    monkeypatch.setattr(storage, "STORAGE_TIMEOUT_S", 1.0)  # read by open_storage (the driver's connect_timeout)

    s, port = listener()
    try:
        study.check_storage(f"postgresql://u:p@127.0.0.1:{port}/db", timeout_s=0.5)  # accepts: passes the TCP check
        code = main(TUNE + ["--storage", f"postgresql://u:p@127.0.0.1:{port}/db"])
    finally:
        s.close()
    line = capsys.readouterr().err.strip()
    assert code == 2 and "--storage" in line and "\n" not in line, line
    # what ended it: the driver's connect timeout (psycopg: "connection timeout expired"; psycopg2: "timeout expired")
    assert "timeout expired" in line, line
    assert not (work / "out").exists()  # nothing started


# -- size errors at their boundaries (0, 1, exactly the pool, one more) ----------------------------------------------

def labels(n, c=10):
    return np.arange(n) % c


def part(name, n_clients, train=100, test=50, **params):
    from raysim.data.arrays import Pools
    from raysim.data.partition import run_partitioner

    return run_partitioner(name, params, Pools(labels(train), labels(test), n_clients, np.random.default_rng(0), 10))


def refused(field, text, *args, **kw):
    with pytest.raises(DataError) as e:
        part(*args, **kw)
    assert e.value.field == field and text in str(e.value), str(e.value)
    return str(e.value)


def test_iid_boundaries():
    refused("data.partition_params.samples_per_client", "must be > 0", "iid", 10, samples_per_client=0)
    assert [len(t) for t in part("iid", 10, samples_per_client=1).train] == [1] * 10
    assert [len(t) for t in part("iid", 10, samples_per_client=10).train] == [10] * 10  # exactly the pool
    msg = refused("data.partition_params.samples_per_client", "at most 10 per client", "iid", 10, samples_per_client=11)
    assert "10 clients x 11 samples = 110 exceed the 100" in msg
    refused("data.partition_params.test_per_client", "must be > 0", "iid", 10, test_per_client=0)
    assert [len(t) for t in part("iid", 10, test_per_client=5).test] == [5] * 10
    refused("data.partition_params.test_per_client", "at most 5 per client", "iid", 10, test_per_client=6)
    # defaults: one client per sample is the limit, one more is refused naming data.num_clients (never "0 samples")
    assert len(part("iid", 50).train) == 50
    msg = refused("data.num_clients", "51 clients exceed the 50 test samples", "iid", 51)
    assert "x 0 test samples" not in msg and "replace: true" in msg
    refused("data.num_clients", "101 clients exceed the 100 training samples", "iid", 101, test=500)
    # with replacement: the whole pool per client at most
    assert len(part("iid", 5, replace=True, samples_per_client=100).train[0]) == 100
    refused("data.partition_params.samples_per_client", "at most 100", "iid", 5, replace=True, samples_per_client=101)
    refused("data.partition_params.samples_per_client", "must be > 0", "iid", 5, replace=True, samples_per_client=0)
    assert part("iid", 50_000, replace=True, samples_per_client=1).train[-1].shape == (1,)


def test_dirichlet_boundaries():
    refused("data.partition_params.samples_per_client", "must be > 0", "dirichlet", 4, samples_per_client=0,
            min_samples=1)
    assert max(len(t) for t in part("dirichlet", 4, samples_per_client=1, min_samples=1).train) == 1
    assert min(len(t) for t in part("dirichlet", 4, alpha=100.0, min_samples=20, test_ratio=0).train) >= 20
    # exactly the pool is possible in principle; whether a draw achieves it is what the message then says
    with pytest.raises(DataError, match="no Dirichlet"):
        part("dirichlet", 10, alpha=0.1, min_samples=10, max_tries=20)
    refused("data.num_clients", "101 clients x 1 samples", "dirichlet", 101, min_samples=1)
    refused("data.partition_params.min_samples", "10 clients x 11 samples (min_samples) = 110 exceed the 100",
            "dirichlet", 10, min_samples=11)
    refused("data.partition_params.test_ratio", "must be >= 0", "dirichlet", 4, test_ratio=-0.1)


def test_pathological_boundaries():
    refused("data.partition_params.classes_per_client", "must be in 1..10", "pathological", 5, classes_per_client=0)
    assert part("pathological", 5, classes_per_client=1).classes[0] == [0]
    assert part("pathological", 5, classes_per_client=10).classes[0] == list(range(10))
    refused("data.partition_params.classes_per_client", "must be in 1..10", "pathological", 5, classes_per_client=11)
    refused("data.partition_params.samples_per_client", "must be > 0", "pathological", 5, samples_per_client=0)
    # 10 samples per class: 100 clients x 1 class = 10 holders per class, exactly one sample each; 110 is one too many
    assert min(len(t) for t in part("pathological", 100, classes_per_client=1).train) == 1
    refused("data.num_clients", "receives no training samples", "pathological", 110, classes_per_client=1)


def test_nway_kshot_boundaries():
    kw = dict(ways=2, stdev=0, test_shots=1)
    refused("data.partition_params.shots", "must be > 0", "nway_kshot", 4, shots=0, **kw)
    refused("data.partition_params.test_shots", "must be > 0", "nway_kshot", 4, shots=1, ways=2, stdev=0, test_shots=0)
    refused("data.partition_params.ways", "must be in 1..10", "nway_kshot", 4, shots=1, ways=0, stdev=0)
    assert part("nway_kshot", 4, shots=1, **kw).train[0].shape == (2,)
    # 5 clients x 2 ways over 10 classes of 10 samples: the largest fitting shots is found by replaying the draws
    big = 1
    while True:
        try:
            part("nway_kshot", 5, shots=big, **kw)
            big += 1
        except DataError as e:
            assert f"at most shots={big - 1} fits" in str(e), str(e)
            break
    refused("data.partition_params.test_shots", "at most test_shots=", "nway_kshot", 20, shots=1, ways=2, stdev=0,
            test_shots=50)


def test_shared_base_and_domain_dirichlet_boundaries():
    refused("data.partition_params.per_class", "must be > 0", "shared_base", 3, per_class=0)
    assert len(part("shared_base", 3, per_class=10).train[0]) == 100  # exactly a class's samples
    refused("data.partition_params.per_class", "at most 10 fit", "shared_base", 3, per_class=11)
    refused("data.partition_params.test_per_class", "at most 5 fit", "shared_base", 3, per_class=1, test_per_class=6)
    refused("data.partition_params.samples_per_client", "must be > 0", "domain_dirichlet", 3, samples_per_client=0)
    assert len(part("domain_dirichlet", 3, samples_per_client=1, test_ratio=0).train[0]) == 1


@pytest.mark.ray
def test_a_real_ray_gcs_passes_the_address_check(ray_session):
    """The HTTP/2 probe of backend.address accepts a real Ray head (the session's local cluster)."""
    from raysim.backends.ray_preflight import check_address

    address = ray_session.get_runtime_context().gcs_address
    check_address(address, 5.0)  # raises (naming backend.address) unless the head answered the probe as a GCS


def test_address_answering_without_a_local_node_fails_fast(monkeypatch):
    """A head that answers (a fake GCS replying with an HTTP/2 SETTINGS frame) while no Ray node runs on this
    machine: ray.init could only time out, so the check says what to do at once."""
    import ray._private.services as services

    from raysim.backends.ray_preflight import check_address

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    port = s.getsockname()[1]

    def serve():
        try:
            c, _ = s.accept()
            c.recv(64)
            c.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS frame
            time.sleep(0.5)
            c.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setattr(services, "find_node_ids", lambda: [])
    try:
        with pytest.raises(ConfigError, match="no Ray node runs on this machine") as e:
            check_address(f"127.0.0.1:{port}", 2.0)
    finally:
        s.close()
    assert e.value.field == "backend.address" and "ray start --address=127.0.0.1:" in str(e.value)


def test_disk_full_at_the_end_is_one_line_exit_1(work, monkeypatch, capsys):
    """A run-time failure of the file system (disk full while writing the table): exit 1, one line naming the file,
    no partial run directory."""
    import errno

    import raysim.engine.callbacks

    def full(df, path, metadata):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(raysim.engine.callbacks, "write_parquet", full)
    code = main(["run", "c.yaml", "--set", "rounds=1", "--out", "out/r"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and "results.parquet" in lines[0] and "No space left" in lines[0], err
    assert not (work / "out" / "r").exists() and not (work / "out" / "r.incomplete").exists()


# -- issue 35: what a config may run, every --out form, tables by schema, terminal output ----------------------------

USER_MODULE = '''
import numpy as np
import torch.nn as nn

import raysim


def arrays(root=None):
    r = np.random.default_rng(0)
    return {"x_train": r.normal(size=(60, 1, 8, 8)).astype("float32"), "y_train": np.arange(60) % 3,
            "x_test": r.normal(size=(30, 1, 8, 8)).astype("float32"), "y_test": np.arange(30) % 3}


marked_loader = raysim.dataset_loader(arrays)


def plain_loader(root=None):
    return arrays(root)


@raysim.model_factory
def marked_factory(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


def plain_factory(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


class Anything:
    def __getattr__(self, name):
        return "dataset_loader"

    def __call__(self, root=None):
        return arrays(root)


anything = Anything()
'''


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    import sys

    from raysim.config import registry

    (tmp_path / "um35api.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    saved = (dict(registry.MODELS), dict(registry.DATASETS))
    yield tmp_path
    sys.modules.pop("um35api", None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
    registry.MODELS.clear(), registry.MODELS.update(saved[0])
    registry.DATASETS.clear(), registry.DATASETS.update(saved[1])


def test_import_paths_call_only_what_is_marked_registered_or_of_its_kind(usermod):
    import sys

    import raysim
    from raysim.adapt import resolve_factory
    from raysim.data.datasets import resolve_loader
    from raysim.models import ARCHS

    sys.modules.pop("antigravity", None)
    with pytest.raises(ConfigError, match="standard library") as e:
        resolve_loader("antigravity:fly")
    assert e.value.field == "data.dataset" and "antigravity" not in sys.modules  # refused before it was imported
    assert resolve_loader("um35api:marked_loader") is not None
    with pytest.raises(ConfigError, match="not marked as a dataset loader"):
        resolve_loader("um35api:plain_loader")
    with pytest.raises(ConfigError, match="not marked"):  # an object that answers every attribute is not marked
        resolve_loader("um35api:anything")
    import um35api

    raysim.register_dataset("mine", um35api.plain_loader)  # registered from Python: its import path may be named
    assert resolve_loader("um35api:plain_loader") is um35api.plain_loader

    assert resolve_factory("um35api:marked_factory", "model.arch", ARCHS) is um35api.marked_factory
    assert resolve_factory("um35api:Net", "model.arch", ARCHS) is um35api.Net  # an nn.Module class: its kind
    assert resolve_factory("torchvision.models:resnet18", "model.arch", ARCHS) is not None  # a torchvision builder
    for bad in ("um35api:plain_factory", "torchvision.models:get_model_weights", "numpy:zeros", "um35api:np.save"):
        with pytest.raises(ConfigError, match="not marked as a model factory") as e:
            resolve_factory(bad, "model.arch", ARCHS)
        assert e.value.field == "model.arch"
    with pytest.raises(TypeError):
        raysim.dataset_loader(42)


def test_a_marked_loader_and_factory_run_end_to_end(usermod, capsys):
    cfg = tiny_config(rounds=1, data={"dataset": "um35api:marked_loader", "num_clients": 3, "partition": "iid",
                                      "partition_params": {}},
                      model={"arch": "um35api:marked_factory", "params": {}}, algorithm={"name": "fedavg"})
    (usermod / "u.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "u.yaml", "--dry-run"]) == 0, capsys.readouterr().err
    assert "nothing was trained or written" in capsys.readouterr().out
    assert not (usermod / "__pycache__").exists()  # a dry run writes no byte-code cache either
    assert main(["run", "u.yaml", "--out", "r"]) == 0, capsys.readouterr().err
    assert (usermod / "r" / "results.parquet").exists()


def test_out_symlinks_are_followed_and_the_run_lands_in_their_target(work, capsys):
    (work / "empty").mkdir()
    (work / "lnk").symlink_to("empty")
    (work / "dangling").symlink_to("nowhere")
    assert main(["run", "c.yaml", "--set", "rounds=1", "--out", "lnk"]) == 0
    assert (work / "empty" / "results.parquet").exists() and (work / "lnk").is_symlink()
    assert f"results: {work / 'empty' / 'results.parquet'}" in capsys.readouterr().out
    assert main(["run", "c.yaml", "--set", "rounds=1", "--out", "dangling"]) == 0
    assert (work / "nowhere" / "results.parquet").exists() and (work / "dangling" / "run.json").exists()
    assert not list(work.glob("*.incomplete"))


def test_out_on_a_mount_point_is_refused_before_data_loads(work, monkeypatch):
    import os

    from raysim.io import rundir

    (work / "mnt").mkdir()
    real = os.stat

    def stat(path, *a, **k):  # mnt on another device than its parent, as a mount point is
        st = real(path, *a, **k)
        if str(path) == str(work / "mnt"):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1) + tuple(st)[3:])
        return st

    monkeypatch.setattr(rundir.os, "stat", stat)
    with pytest.raises(ConfigError, match="mount point") as e:
        rundir.check_run_dir("mnt", "--out")
    assert e.value.field == "--out" and "mnt/run" in str(e.value)


def test_a_finished_run_that_cannot_be_moved_is_kept_whole_and_resumable(work, capsys, monkeypatch):
    import errno
    import os

    import pandas as pd

    from raysim.io import results

    real = os.rename

    def rename(src, dst, *a, **k):
        if str(src).endswith(".incomplete"):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    assert main(["run", "c.yaml", "--set", "rounds=2", "--out", "t"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nothing is lost" in err and "--resume t.incomplete --out DIR" in err, err
    kept = work / "t.incomplete"
    assert (kept / "results.parquet").exists() and not (work / "t").exists()
    table = results.read_table(kept / "results.parquet")
    assert main(["runs", "."]) == 0 and "finished, not moved (resumable)" in capsys.readouterr().out
    monkeypatch.setattr(os, "rename", real)
    assert main(["run", "c.yaml", "--set", "rounds=2", "--resume", "t.incomplete", "--out", "moved"]) == 0
    assert not kept.exists()
    pd.testing.assert_frame_equal(results.without_timing(results.load(work / "moved")),
                                   results.without_timing(table), check_exact=True)


def test_runs_lists_every_healthy_run_beside_damaged_ones_and_escapes_names(work, one_run, capsys):
    import shutil

    import pandas as pd

    from tests.hostile_table import _rewrite_table

    for name in ("r", "bad", "\x1b[2Jevil"):
        shutil.copytree(one_run, work / "runs" / name)
    _rewrite_table(work, pd.DataFrame({"a": [1]}), "bad")
    assert main(["runs", "runs"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2Jevil" in out
    rows = {ln.split()[-1]: ln for ln in out.splitlines()[1:]}
    assert "damaged (results.parquet: not a raysim result table" in rows["runs/bad"]
    assert "finished" in rows["runs/r"] and "finished" in rows["runs/\\x1b[2Jevil"]
    assert main(["report", "runs", "--out", "rep", "--no-plots"]) == 0  # the two healthy runs, the damaged one named
    cap = capsys.readouterr()
    assert "skipped a damaged run" in cap.err and "bad/results.parquet" in cap.err and "\x1b" not in cap.out + cap.err
    assert len(pd.read_parquet(work / "rep" / "runs.parquet")) == 2


def test_yaml_duplicate_keys_refused_merge_keys_still_override():
    from raysim.config.yamlio import DuplicateKeyError, yaml_load

    assert yaml_load("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n")["b"] == {"x": 3, "y": 2}
    with pytest.raises(DuplicateKeyError, match="'x' is given twice"):
        yaml_load("b:\n  x: 1\n  y: 2\n  x: 3\n")


@pytest.mark.parametrize("over,field", [({"train__lr": float("nan")}, "train.lr"),
                                        ({"train__lr": float("inf")}, "train.lr"),
                                        ({"algorithm__params__lam": float("-inf")}, "algorithm.params.lam"),
                                        ({"data__partition_params__stdev": float("nan")}, "data.partition_params.stdev"),
                                        ({"model__params__extra": [1.0, float("nan")]}, "model.params.extra[1]")])
def test_nan_and_infinity_are_never_a_setting(over, field):
    with pytest.raises(ConfigError, match="finite number") as e:
        make_config(tiny_config(**over))
    assert e.value.field == field


def test_ten_million_clients_refused_at_once_where_they_cannot_fit():
    """10,000,000 clients (iid with replacement) on a machine with 8 GiB free: refused before any data is built, with
    the estimate (~600 B per client measured at 150k-300k clients, issue 35)."""
    from raysim.engine.prepare import _check_population_memory

    cfg = make_config(tiny_config(data={"dataset": "synthetic", "num_clients": 10_000_000, "partition": "iid",
                                        "partition_params": {"replace": True}}))
    with pytest.raises(ConfigError, match=r"10,000,000 clients need about 6\.0 GiB") as e:
        _check_population_memory(cfg, avail=8 * 2**30)
    assert e.value.field == "data.num_clients"
    _check_population_memory(cfg, avail=16 * 2**30)  # fits in half of 16 GiB
