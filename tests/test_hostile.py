"""Hostile inputs (issue 25): names that would write outside the output directory, YAML bombs, unusable tuning
storage, unreachable clusters, values that used to be capped or dropped silently, and size errors at their
boundaries. The probe table runs the ``raysim`` command in-process: every probe ends in one line (plus notices),
exit 2, no traceback, and leaves the directory tree it ran in exactly as it was."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml

from raysim.cli import main
from raysim.config import ConfigError, make_config
from raysim.errors import DataError
from tests.conftest import tiny_config


def laughs(depth: int = 9) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    prev = "a"
    for n in "bcdefghijklmnop"[: depth - 1]:
        lines.append(f"{n}: &{n} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = n
    return "\n".join(lines) + "\n"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding a valid config (output.dir: out) and the hostile files the probes use."""
    w = tmp_path / "work"
    w.mkdir()
    cfg = tiny_config(data__val_fraction=0.25)
    cfg["output"] = {"dir": "out", "progress": False}
    (w / "c.yaml").write_text(yaml.safe_dump(cfg))
    (w / "laughs.yaml").write_text(laughs())
    (w / "deep.yaml").write_text("x: " + "[" * 3000 + "]" * 3000 + "\n")
    (w / "deep2.yaml").write_text("x: " + "[" * 40 + "]" * 40 + "\n")
    (w / "big.yaml").write_text("# padding\n" * 120_000 + "rounds: 1\n")
    (w / "empty.yaml").write_text("")
    (w / "comments.yaml").write_text("# nothing but a comment\n")
    (w / "list.yaml").write_text("- rounds: 1\n")
    (w / "bin.yaml").write_bytes(bytes(range(256)) * 4)
    (w / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (w / "space.yaml").write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1,
                                                                                       "high": 2.0}},
                                                  "objective": {"metric": "val_acc"}}))
    (w / "bad.log").write_text("{not json\n")
    (w / "adir").mkdir()
    (w / "nosplit").mkdir()
    monkeypatch.chdir(w)
    return w


def tree(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


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


TUNE = ["tune", "c.yaml", "--space", "space.yaml", "--trials", "1"]
RAY = ["run", "c.yaml", "--backend", "ray"]

# (id, argv, the field or file the one line must name, more text it must hold)
PROBES = [
    # 1. paths: values that become part of a path
    ("name-dotdot", ["run", "c.yaml", "--set", "name=../../x"], "'name'", "not a safe name"),
    ("name-slash", ["run", "c.yaml", "--set", "name=a/b"], "'name'", "not a safe name"),
    ("name-absolute", ["run", "c.yaml", "--set", "name=/tmp/x"], "'name'", "not a safe name"),
    ("name-hidden", ["run", "c.yaml", "--set", "name=.hidden"], "'name'", "not a safe name"),
    ("name-empty", ["run", "c.yaml", "--set", "name="], "'name'", "not a safe name"),
    ("name-inner-dotdot", ["run", "c.yaml", "--set", "name=x..y"], "'name'", "not a safe name"),
    ("name-space", ["run", "c.yaml", "--set", "name=a b"], "'name'", "not a safe name"),
    ("name-tilde", ["run", "c.yaml", "--set", "name=~root"], "'name'", "not a safe name"),
    ("name-backslash", ["run", "c.yaml", "--set", "name=a\\b"], "'name'", "not a safe name"),
    ("name-newline", ["run", "c.yaml", "--set", "name=\"a\\nb\""], "'name'", "not a safe name"),
    ("name-too-long", ["run", "c.yaml", "--set", "name=" + "a" * 101], "'name'", "not a safe name"),
    ("name-not-string", ["run", "c.yaml", "--set", "name=[1, 2]"], "'name'", "expected a string"),
    ("name-dry-run", ["run", "c.yaml", "--dry-run", "--set", "name=../x"], "'name'", "not a safe name"),
    ("study-name", TUNE + ["--study-name", "../../x"], "'--study-name'", "not a safe name"),
    # 2. YAML with bounds
    ("billion-laughs", ["run", "laughs.yaml"], "laughs.yaml", "billion laughs"),
    ("deep-nesting-parse", ["run", "deep.yaml"], "deep.yaml", "nested more than"),
    ("deep-nesting", ["run", "deep2.yaml"], "deep2.yaml", "nested more than"),
    ("too-large", ["run", "big.yaml"], "big.yaml", "more than the"),
    ("set-deep", ["run", "c.yaml", "--set", "data.partition_params=" + "[" * 40 + "]" * 40], "data.partition_params",
     "nested"),
    ("set-laughs", ["run", "c.yaml", "--set", "env={" + laughs().replace("\n", ", ").rstrip(", ") + "}"], "'env'",
     "billion laughs"),
    ("space-laughs", ["tune", "c.yaml", "--space", "laughs.yaml", "--trials", "1"], "laughs.yaml", "billion laughs"),
    # 3. config and space files that are not configs
    ("config-empty", ["run", "empty.yaml"], "empty.yaml", "is empty"),
    ("config-comments-only", ["run", "comments.yaml"], "comments.yaml", "is empty"),
    ("config-directory", ["run", "adir"], "adir", "is a directory"),
    ("config-binary", ["run", "bin.yaml"], "bin.yaml", "binary"),
    ("config-not-utf8", ["run", "latin1.yaml"], "latin1.yaml", "UTF-8"),
    ("config-device", ["run", "/dev/zero"], "/dev/zero", "not a regular file"),
    ("config-list", ["run", "list.yaml"], "list.yaml", "mapping"),
    ("config-missing", ["run", "nope.yaml"], "nope.yaml", "not found"),
    ("space-empty", ["tune", "c.yaml", "--space", "empty.yaml", "--trials", "1"], "empty.yaml", "is empty"),
    ("space-directory", ["tune", "c.yaml", "--space", "adir", "--trials", "1"], "--space", "is a directory"),
    # 4. tuning storage
    ("storage-scheme", TUNE + ["--storage", "mongodb://h/db"], "--storage", "not supported"),
    ("storage-driver", TUNE + ["--storage", "postgresql+psycopg2://u:p@127.0.0.1:1/db"], "--storage",
     "not installed"),
    ("storage-refused", TUNE + ["--storage", "postgresql://u:p@127.0.0.1:1/db"], "--storage", "127.0.0.1:1"),
    ("storage-unknown-host", TUNE + ["--storage", "postgresql://u:p@nohost.invalid/db"], "--storage", "unknown host"),
    ("storage-sqlite-dir", TUNE + ["--storage", "sqlite:///adir"], "--storage", "is a directory"),
    ("storage-sqlite-not-db", TUNE + ["--storage", "sqlite:///c.yaml"], "--storage", "not a SQLite database"),
    ("storage-journal-damaged", TUNE + ["--storage", "bad.log"], "--storage", "damaged"),
    ("storage-journal-dir", TUNE + ["--storage", "journal:adir"], "--storage", "is a directory"),
    ("storage-under-file", TUNE + ["--storage", "journal:c.yaml/x.log"], "--storage", "not a directory"),
    ("storage-not-url", TUNE + ["--storage", "foo.txt"], "--storage", "not a storage URL"),
    ("storage-empty", TUNE + ["--storage", ""], "--storage", "empty"),
    # 5. clusters
    ("address-refused", RAY + ["--set", "backend.address=127.0.0.1:1"], "backend.address", "Connection refused"),
    ("address-unknown-host", RAY + ["--set", "backend.address=nohost.invalid:6379"], "backend.address",
     "unknown host"),
    ("address-not-hostport", RAY + ["--set", "backend.address=http://x"], "backend.address", "HOST:PORT"),
    ("address-no-port", RAY + ["--set", "backend.address=10.0.0.1"], "backend.address", "HOST:PORT"),
    ("address-empty", RAY + ["--set", "backend.address=' '"], "backend.address", "empty"),
    ("connect-timeout-zero", ["run", "c.yaml", "--set", "backend.connect_timeout_s=0"], "backend.connect_timeout_s",
     "> 0"),
    # 6. listing and reporting what is not there
    ("runs-on-file", ["runs", "c.yaml"], "c.yaml", "not a directory"),
    ("report-missing", ["report", "nope", "--out", "rep"], "nope", "no result table"),
    ("resume-missing", ["run", "c.yaml", "--resume", "nope"], "resume", "no checkpoints"),
    # 7. sizes: true at the boundaries, values never capped silently
    ("iid-too-many-clients", ["run", "c.yaml", "--set", "data.partition=iid", "--set", "data.partition_params={}",
                              "--set", "data.num_clients=50000"], "data.num_clients", "50000 clients exceed"),
    ("iid-zero-samples", ["run", "c.yaml", "--set", "data.partition=iid", "--set",
                          "data.partition_params={samples_per_client: 0}"], "samples_per_client", "must be > 0"),
    ("kshot-zero-shots", ["run", "c.yaml", "--set", "data.partition_params.shots=0"], "shots", "must be > 0"),
    ("actors-capped-error", ["run", "c.yaml", "--dry-run", "--backend", "ray", "--set", "backend.num_actors=10",
                             "--set", "backend.num_cpus=1000"], "backend.num_actors",
     "backend.num_actors=10 capped at data.num_clients"),
    # 8. memory
    ("seeds-huge", ["run", "c.yaml", "--seeds", "1-100000000000"], "--seeds", "more than"),
    ("model-huge", ["run", "c.yaml", "--set", "model.params.hidden=1000000000"], "model.params", "parameters"),
    ("clients-huge", ["run", "c.yaml", "--set", "data.num_clients=100000000000"], "data.num_clients", "exceeds"),
    # 9. data roots that are not data
    ("files-no-config-json", ["run", "c.yaml", "--set", "data.partition=files", "--set",
                              "data.partition_params={root: nosplit}"], "data.partition_params.root", "config.json"),
    ("fashion-root-file", ["run", "c.yaml", "--set", "data.dataset=fashion_mnist", "--set", "data.root=c.yaml"],
     "data.root", "not a directory"),
    ("trace-binary", ["run", "c.yaml", "--set", "env.trace.devices=bin.yaml"], "env.trace.devices", "bin.yaml"),
]


@pytest.mark.parametrize("argv,names,text", [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_probe(work, argv, names, text, capsys):
    root = work.parent
    before = tree(root)
    code = main(list(argv))
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")]
    assert code == 2, cap.err
    assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert names in lines[0] and text in lines[0], lines[0]
    assert tree(root) == before  # nothing written anywhere, nothing partial left


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
    from raysim.data.partition import run_partitioner

    return run_partitioner(name, params, labels(train), labels(test), n_clients, np.random.default_rng(0), 10)


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


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    from raysim.engine.loop import run_experiment

    root = tmp_path_factory.mktemp("one_run")
    run_experiment(make_config(tiny_config(rounds=1)), out_dir=root / "r")
    return root / "r"


REPORT_PROBES = [
    ("report-out-is-file", ["report", "runs", "--out", "c.yaml", "--no-plots"], "--out", "is a file"),
    ("report-out-unwritable", ["report", "runs", "--out", "/proc/raysim-x", "--no-plots"], "--out", "cannot write"),
    ("report-tuned-on-not-tune", ["report", "runs", "--tuned-on", "c.yaml", "--no-plots", "--out", "rep"],
     "--tuned-on", "no trials.parquet"),
    ("report-unknown-metric", ["report", "runs", "--metric", "nope", "--no-plots", "--out", "rep"], "'nope'",
     "no client metric"),
    ("report-unknown-time-metric", ["report", "runs", "--time-metric", "nope", "--no-plots", "--out", "rep"], "'nope'",
     "no total"),
    ("report-not-a-table", ["report", "runs/r/config.yaml", "--out", "rep"], "config.yaml", "cannot read"),
    ("resume-a-file", ["run", "c.yaml", "--resume", "c.yaml"], "resume", "no checkpoints"),
    ("resume-finished-without-checkpoints", ["run", "c.yaml", "--resume", "runs/r"], "resume", "no checkpoints"),
    ("out-is-file", ["run", "c.yaml", "--out", "c.yaml"], "--out", "is a file"),
    ("set-no-key", ["run", "c.yaml", "--set", "=5"], "=5", "needs a key"),
]


@pytest.mark.parametrize("argv,names,text", [p[1:] for p in REPORT_PROBES], ids=[p[0] for p in REPORT_PROBES])
def test_probe_with_a_run(work, one_run, argv, names, text, capsys):
    import shutil

    shutil.copytree(one_run, work / "runs" / "r")
    root = work.parent
    before = tree(root)
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert names in lines[0] and text in lines[0], lines[0]
    assert tree(root) == before


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
