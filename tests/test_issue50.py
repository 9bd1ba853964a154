"""Issue 50's probes as tests (beside tests/test_faults.py): import paths that would run a program, a dry run whose
code leaves a thread or an atexit hook behind, builders that would download weights, secrets in backend.code,
directories raysim did not make, readers that would hang, identity that does not mean what runs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from raysim.app.cli import main
from raysim.errors import ConfigError
from tests.conftest import ROOT, tiny_config

LOADER = '''
import numpy as np
import raysim


@raysim.dataset_loader
def arrays(root=None):
    r = np.random.default_rng(0)
    return {"x_train": r.normal(size=(60, 1, 8, 8)).astype("float32"), "y_train": np.arange(60) % 3,
            "x_test": r.normal(size=(30, 1, 8, 8)).astype("float32"), "y_test": np.arange(30) % 3}
'''


@pytest.fixture
def userdir(tmp_path, monkeypatch):
    """A working directory for user modules (named um50*), removed from sys.modules and sys.path afterwards."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("um50")]:
        sys.modules.pop(name, None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def user_config(d, module: str, **over) -> str:
    cfg = tiny_config(rounds=1, data={"dataset": f"{module}:arrays", "num_clients": 3, "partition": "iid",
                                      "partition_params": {}}, algorithm={"name": "fedavg"},
                      model={"arch": "mlp", "params": {"hidden": 8}}, **over)
    cfg["output"] = {"progress": False, "dir": "out"}
    (d / "u.yaml").write_text(yaml.safe_dump(cfg))
    return "u.yaml"


def one_line(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")]


# -- 2. a config names code; nothing else runs --------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["tqdm.__main__:x", "numpy.f2py.__main__:x", "IPython.__main__:x"])
def test_a_main_module_is_refused_before_it_is_imported(userdir, capsys, target):
    module = target.split(":")[0]
    sys.modules.pop(module, None)
    user_config(userdir, "um50none")
    code = main(["run", "u.yaml", "--dry-run", "--set", f"data.dataset={target}"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "data.dataset" in lines[0] and "__main__ module" in lines[0], lines
    assert module not in sys.modules
    assert list(userdir.iterdir()) == [userdir / "u.yaml"]


def test_a_package_main_is_refused(userdir):
    from raysim.config.registry import resolve

    (userdir / "um50pkg").mkdir()
    (userdir / "um50pkg" / "__init__.py").write_text("")
    (userdir / "um50pkg" / "__main__.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(ConfigError, match="__main__ module") as e:
        resolve("um50pkg.__main__:x", "model.arch")
    assert e.value.field == "model.arch" and "um50pkg.__main__" not in sys.modules


def test_system_exit_while_importing_is_one_config_error_and_the_import_runs_once(userdir, capsys):
    from raysim.config.registry import resolve

    (userdir / "um50exit.py").write_text("import builtins\nbuiltins.um50_runs = getattr(builtins, 'um50_runs', 0) + 1\n"
                                         "raise SystemExit(0)\n")
    import builtins

    for _ in range(3):
        with pytest.raises(ConfigError, match="importing 'um50exit' raised SystemExit") as e:
            resolve("um50exit:arrays", "data.dataset", "loader")
        assert e.value.field == "data.dataset"
    assert builtins.um50_runs == 1  # imported once: the failure is remembered
    del builtins.um50_runs
    user_config(userdir, "um50exit")
    assert main(["run", "u.yaml", "--dry-run"]) == 2  # never exit 0 without validating
    assert "SystemExit" in one_line(capsys)[0]


def test_an_installed_package_is_guarded_in_a_dry_run_too(userdir, monkeypatch, capsys):
    """An installed package's import writes nothing in a dry run: a write it copes without is refused quietly, one it
    cannot do without ends in the one line naming the key."""
    from raysim.config import registry

    (userdir / "um50copes.py").write_text(LOADER + "try:\n    open('cache.txt', 'w')\nexcept PermissionError:\n"
                                                   "    pass\n")
    (userdir / "um50needs.py").write_text(LOADER + "open('cache.txt', 'w').write('x')\n")
    monkeypatch.setattr(registry, "_installed_package", lambda module: True)
    user_config(userdir, "um50copes")
    assert main(["run", "u.yaml", "--dry-run"]) == 0, capsys.readouterr().err
    assert not (userdir / "cache.txt").exists()
    capsys.readouterr()
    user_config(userdir, "um50needs")
    assert main(["run", "u.yaml", "--dry-run"]) == 2
    lines = one_line(capsys)
    assert len(lines) == 1 and "data.dataset" in lines[0] and "cache.txt" in lines[0], lines
    assert not (userdir / "cache.txt").exists()


def test_a_torchvision_builder_gets_every_weights_parameter_off(monkeypatch, tmp_path):
    pytest.importorskip("torchvision")
    import torch.hub
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    from raysim.adapt import weight_parameters

    off = weight_parameters(lraspp_mobilenet_v3_large)
    assert off == {"weights": None, "weights_backbone": None}

    def no_download(*a, **k):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    lraspp_mobilenet_v3_large(**off, num_classes=3)
    assert not (tmp_path / "torch").exists()


def test_a_segmentation_builder_in_a_dry_run_downloads_nothing(userdir, monkeypatch, capsys):
    pytest.importorskip("torchvision")
    monkeypatch.setenv("TORCH_HOME", str(userdir / "torch"))
    user_config(userdir, "um50none")
    code = main(["run", "u.yaml", "--dry-run", "--set", "data.dataset=synthetic",
                 "--set", "model.arch=torchvision.models.segmentation:lraspp_mobilenet_v3_large", "--set",
                 "model.params={}"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "model.arch" in lines[0] and "download" not in lines[0], lines
    assert not (userdir / "torch").exists()


# -- 3. a dry run writes nothing, ever ----------------------------------------------------------------------------------

THREAD = LOADER + '''
import threading

go, done, result = threading.Event(), threading.Event(), {}


def later():
    go.wait(60)
    try:
        with open("from_thread.txt", "w") as f:
            f.write("x")
        result["wrote"] = True
    except PermissionError as e:
        result["refused"] = str(e)
    inner = threading.Thread(target=again)
    inner.start()
    inner.join()
    done.set()


def again():
    try:
        open("from_inner_thread.txt", "w").close()
    except PermissionError:
        result["inner_refused"] = True


threading.Thread(target=later, daemon=True).start()
'''


def test_a_thread_the_dry_runs_code_started_writes_nothing_after_it_ended(userdir, capsys):
    (userdir / "um50thread.py").write_text(THREAD)
    user_config(userdir, "um50thread")
    assert main(["run", "u.yaml", "--dry-run"]) == 0, capsys.readouterr().err
    import um50thread

    um50thread.go.set()  # the dry run is over; now the thread tries to write
    assert um50thread.done.wait(60)
    assert "refused" in um50thread.result and "wrote" not in um50thread.result
    assert um50thread.result.get("inner_refused")  # and so does a thread it starts
    assert not (userdir / "from_thread.txt").exists() and not (userdir / "from_inner_thread.txt").exists()
    with open(userdir / "main_thread.txt", "w") as f:  # the process itself writes as ever
        f.write("ok")


def test_an_atexit_hook_the_dry_runs_code_registered_writes_nothing(tmp_path):
    (tmp_path / "um50atexit.py").write_text(LOADER + "import atexit\n\n\n@atexit.register\ndef bye():\n"
                                                     "    open('from_atexit.txt', 'w').write('x')\n")
    user_config(tmp_path, "um50atexit")
    r = subprocess.run([sys.executable, "-m", "raysim", "run", "u.yaml", "--dry-run"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stderr
    assert "nothing was trained or written" in r.stdout
    assert not (tmp_path / "from_atexit.txt").exists()
    assert "raysim: note: a dry run writes nothing, not even after it ended" in r.stderr  # one line, no traceback
    assert "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.yaml", "um50atexit.py"]
    # without --dry-run the same hook writes (the refusal is the dry run's, not the module's)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import um50atexit
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and (tmp_path / "from_atexit.txt").exists(), r.stderr


# -- 4. only code ships --------------------------------------------------------------------------------------------------

def _ship(tmp_path, entries):
    import contextlib

    from raysim.config import make_config
    from raysim.config.usercode import code_to_ship

    with contextlib.chdir(tmp_path):  # listed code lies under the working directory (or is named on the command line)
        return code_to_ship(make_config(tiny_config(backend={"name": "ray", "code": [str(e) for e in entries]})))


def test_backend_code_refuses_hidden_directories_and_key_material(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    (ssh / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match="hidden") as e:
        _ship(tmp_path, [ssh])
    assert e.value.field == "backend.code[0]"
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.pem").write_text("secret")
    with pytest.raises(ConfigError, match="server.pem, which is key material") as e:
        _ship(tmp_path, [pkg])
    (pkg / "server.pem").unlink()
    (pkg / ".env").write_text("TOKEN=x")
    with pytest.raises(ConfigError, match=r"\.env, which is hidden"):
        _ship(tmp_path, [pkg])
    (pkg / ".env").unlink()
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.csv").write_text("1,2\n")
    with pytest.raises(ConfigError, match="holds no Python code") as e:
        _ship(tmp_path, [pkg, data])
    assert e.value.field == "backend.code[1]"
    with pytest.raises(ConfigError, match="key material"):
        _ship(tmp_path, [ssh / "id_rsa"])


def test_backend_code_says_what_ships(tmp_path):
    from raysim.config.usercode import describe_shipped

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("X = 1\n")
    (tmp_path / "helper.py").write_text("Y = 2\n")
    paths = _ship(tmp_path, [pkg, tmp_path / "helper.py"])
    line = describe_shipped(paths)
    assert f"{pkg} (2 files, 6 bytes)" in line and f"{tmp_path / 'helper.py'} (1 file, 6 bytes)" in line


def test_backend_code_outside_the_working_directory_ships_only_when_named_on_the_command_line(tmp_path, monkeypatch,
                                                                                           capsys):
    from raysim.config import make_config, usercode

    outside = tmp_path / "elsewhere" / "theirpkg"
    outside.mkdir(parents=True)
    (outside / "__init__.py").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(usercode, "COMMAND_LINE", set())
    with pytest.raises(ConfigError, match="outside the working directory") as e:  # named in a config file
        usercode.code_to_ship(make_config(tiny_config(backend={"name": "ray", "code": [str(outside)]})))
    assert e.value.field == "backend.code[0]" and "--set" in str(e.value)
    cfg = tiny_config(rounds=1, backend={"name": "ray", "code": [str(outside)]})
    cfg["output"] = {"progress": False, "dir": "out"}
    (work / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "c.yaml", "--dry-run"]) == 2
    lines = one_line(capsys)
    assert len(lines) == 1 and "'backend.code[0]'" in lines[0] and "outside the working directory" in lines[0]
    usercode.allow_from_command_line([f"backend.code=[{outside}]"])  # what the CLI does with its --set
    assert usercode.listed_code([str(outside)]) == [(str(outside), 1, 0)]
    (work / "mine.py").write_text("Z = 3\n")
    assert usercode.listed_code(["mine.py"]) == [(str(work / "mine.py"), 1, 6)]  # under the working directory


def test_rays_unpacked_copy_of_the_shipped_code_is_removed_from_a_session_raysim_started(tmp_path):
    pytest.importorskip("ray")
    from raysim.backends.ray_preflight import remove_unpacked, shipped_uris

    renv = {"py_modules": ["gcs://_ray_pkg_own1.zip", "gcs://_ray_pkg_user1.zip", "gcs://_ray_pkg_user2.zip"],
            "working_dir": "gcs://_ray_pkg_wd.zip"}
    assert shipped_uris(renv, 2, False) == ["gcs://_ray_pkg_user1.zip", "gcs://_ray_pkg_user2.zip"]  # not raysim's
    assert shipped_uris(renv, 0, True) == ["gcs://_ray_pkg_wd.zip"] and shipped_uris(None, 2, True) == []
    res = tmp_path / "session_x" / "runtime_resources"
    for sub, name in (("py_modules_files", "_ray_pkg_own1"), ("py_modules_files", "_ray_pkg_user1"),
                      ("working_dir_files", "_ray_pkg_wd")):
        (res / sub / name / ".ssh").mkdir(parents=True)
        (res / sub / name / ".ssh" / "id_rsa").write_text("secret")
    (res / "py_modules_files" / "_ray_pkg_user1.zip").write_text("zip")
    removed = remove_unpacked(str(tmp_path / "session_x"), shipped_uris(renv, 2, True) + ["gcs://../../etc.zip"])
    assert sorted(os.path.basename(r) for r in removed) == ["_ray_pkg_user1", "_ray_pkg_user1.zip", "_ray_pkg_wd"]
    assert (res / "py_modules_files" / "_ray_pkg_own1" / ".ssh" / "id_rsa").exists()  # raysim's own: kept
    assert not (res / "py_modules_files" / "_ray_pkg_user1").exists()
    assert remove_unpacked(None, ["gcs://_ray_pkg_user1.zip"]) == []  # a session Ray does not name: nothing


@pytest.mark.ray
def test_a_ray_run_leaves_no_unpacked_copy_of_the_users_code(tmp_path):
    """End to end, in a child process that starts its own local Ray session (the session fixture's is shared, so
    raysim leaves its copies alone): after the run no package under the session's runtime_resources holds the
    user's module."""
    import glob
    import shutil
    import tempfile

    work = tmp_path / "w"
    work.mkdir()
    (work / "um50ship.py").write_text(LOADER)
    cfg = tiny_config(rounds=1, data={"dataset": "um50ship:arrays", "num_clients": 2, "partition": "iid",
                                      "partition_params": {}}, algorithm={"name": "fedavg"},
                      model={"arch": "mlp", "params": {"hidden": 8}},
                      backend={"name": "ray", "num_actors": 1, "num_cpus": 0.5})
    cfg["output"] = {"progress": False, "dir": "out"}
    (work / "c.yaml").write_text(yaml.safe_dump(cfg))
    ray_tmp = tempfile.mkdtemp(prefix="r50", dir="/tmp")  # short: Ray's socket paths are length-bound
    try:
        env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-m", "raysim", "run", "c.yaml"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "backend.code ships" in p.stderr and "um50ship.py" in p.stderr, p.stderr[-2000:]
        sessions = glob.glob(os.path.join(ray_tmp, "**", "session_2*"), recursive=True)
        assert sessions, os.listdir(ray_tmp)
        left = [f for s in sessions for f in glob.glob(os.path.join(s, "runtime_resources", "**", "um50ship.py"),
                                                        recursive=True)]
        assert left == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# -- 5. raysim deletes only what it made ---------------------------------------------------------------------------------

def test_an_incomplete_directory_raysim_did_not_make_keeps_its_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**tiny_config(rounds=1), "output": {"progress": False}}))
    mine = tmp_path / "out" / "keep.incomplete"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "figs").mkdir()
    (mine / "figs" / "a.png").write_bytes(b"png")
    assert main(["run", "c.yaml", "--out", "out/keep"]) == 0
    err = capsys.readouterr().err
    assert "raysim did not create it" in err and "out/keep-2" in err
    assert (mine / "thesis.tex").read_text() == "years of work" and (mine / "figs" / "a.png").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["figs", "thesis.tex"]  # no lock, no marker written into it
    assert (tmp_path / "out" / "keep-2" / "results.parquet").exists()


def test_a_failed_run_removes_only_its_own_marked_directory(tmp_path):
    from raysim.io import rundir

    rd = rundir.RunDir.claim(tmp_path / "r")
    assert rundir.is_marked(rd.work)
    rd.abandon(keep=False)
    assert not (tmp_path / "r.incomplete").exists()
    foreign = tmp_path / "f.incomplete"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1")
    rd = rundir.RunDir.for_resume(foreign)  # resumed in place, but not raysim's: never removed
    assert rd.abandon(keep=False) is None and (foreign / "data.csv").exists()


# -- 6. every reader bounded ---------------------------------------------------------------------------------------------

def bounded(fn, fifos=(), seconds: float = float(os.environ.get("RAYSIM_TEST_BOUND_S", 120))):
    """``fn()`` in a thread; a reader blocked on a FIFO is released (a writer opens it) and the test fails (the
    bound only catches a regression; it is no timing assertion)."""
    import threading

    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(30)
        pytest.fail("a reader blocked on a FIFO")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    d = tmp_path_factory.mktemp("run50")
    c = tiny_config(rounds=2)
    c["output"] = {"progress": False, "checkpoint_every": 1}
    run_experiment(make_config(c), out_dir=d / "r")
    return d / "r", c


@pytest.mark.parametrize("name, finished", [("config.yaml", True), ("config.yaml", False), ("run.json", True)])
def test_a_fifo_in_a_run_directory_never_hangs_raysim_runs(finished_run, tmp_path, capsys, name, finished):
    import shutil

    run = tmp_path / "runs" / ("r" if finished else "r.incomplete")
    shutil.copytree(finished_run[0], run)
    if not finished:
        (run / "results.parquet").unlink()
    (run / name).unlink()
    os.mkfifo(run / name)
    code = bounded(lambda: main(["runs", str(tmp_path / "runs")]), [run / name])
    out = capsys.readouterr().out
    assert code == 0, out
    if not (finished and name == "config.yaml"):  # a finished run's config is read from its table
        assert "FIFO" in out and name in out, out


def test_a_fifo_checkpoint_meta_never_hangs_a_resume(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "r"
    shutil.copytree(finished_run[0], run)
    from raysim.io.checkpoints import find_checkpoint

    meta = find_checkpoint(run) / "meta.pt"
    meta.unlink()
    os.mkfifo(meta)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**finished_run[1], "rounds": 3}))
    code = bounded(lambda: main(["run", str(tmp_path / "c.yaml"), "--resume", str(run)]), [meta])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "meta.pt" in lines[0] and "FIFO" in lines[0], lines


def test_a_fifo_named_like_an_image_never_hangs(userdir, capsys):
    from PIL import Image

    for split in ("train", "test"):
        for c in ("a", "b"):
            d = userdir / "imgs" / split / c
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("L", (8, 8), color=40 * i).save(d / f"{i}.png")
    fifo = userdir / "imgs" / "train" / "a" / "9.png"
    os.mkfifo(fifo)
    user_config(userdir, "um50none")
    code = bounded(lambda: main(["run", "u.yaml", "--dry-run", "--set", "data.dataset=imagefolder",
                                 "--set", "data.root=imgs", "--set", "data.num_clients=2"]), [fifo])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "9.png" in lines[0] and "FIFO" in lines[0], lines


def test_an_npz_zip_bomb_is_refused_from_its_header(userdir, monkeypatch, capsys):
    import numpy as np

    import raysim.data.arrays as arrays

    np.savez_compressed(userdir / "d.npz", x_train=np.zeros((4000, 1, 8, 8), np.float32), y_train=np.zeros(4000),
                        x_test=np.zeros((100, 1, 8, 8), np.float32), y_test=np.zeros(100))
    monkeypatch.setattr(arrays, "available_memory", lambda: 1_000_000)  # the unpacked 2 MB exceed half of it
    user_config(userdir, "um50none")
    code = main(["run", "u.yaml", "--dry-run", "--set", "data.dataset=npz", "--set", "data.root=d.npz"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "d.npz unpacks to" in lines[0] and "zip bomb" in lines[0], lines


@pytest.mark.parametrize("doc, says", [
    ({"users": 5, "user_data": {}}, "'users' must be a list of user names, got int"),
    ({"users": [["u0"]], "user_data": {}}, "'users' must be a list of user names, got list holding list"),
    ({"users": ["u0"], "user_data": {"u0": {"x": 5, "y": [1]}}}, "user 'u0': x and y must be lists, got x int"),
    ({"users": ["u0"], "user_data": {"u0": {"x": [[1.0], "a"], "y": [1, 2]}}}, "user 'u0': every sample in x"),
    ({"users": ["u0"], "user_data": {"u0": {"x": [[1.0]], "y": [{"a": 1}]}}}, "user 'u0': every label in y"),
    ({"users": ["u0"], "user_data": []}, "'user_data' must map each user"),
])
def test_leaf_json_of_the_wrong_shape_is_one_line_naming_file_and_user(userdir, capsys, doc, says):
    import json

    for split in ("train", "test"):
        (userdir / "leaf" / split).mkdir(parents=True)
        (userdir / "leaf" / split / "all.json").write_text(json.dumps(doc))
    user_config(userdir, "um50none")
    code = main(["run", "u.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set", "data.root=leaf",
                 "--set", "data.partition=natural"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "all.json" in lines[0] and says in lines[0], lines
    assert "Traceback" not in lines[0]


@pytest.mark.parametrize("participation, key", [
    ({"dropout": 1.0}, "env.participation.dropout"),
    ({"availability": {"mode": "bernoulli", "p": 0.0}}, "env.participation.availability.p"),
])
def test_async_without_arrivals_is_refused_at_config_time(tiny, participation, key):
    from raysim.engine.prepare import prepare

    cfg = tiny(server={"mode": "async", "concurrency": 2, "buffer_size": 1}, algorithm={"name": "fedavg"},
               env={"preset": "mobile-heterogeneous", "participation": participation})
    with pytest.raises(ConfigError) as e:
        bounded(lambda: prepare(cfg))
    assert e.value.field == key and "wait forever" in str(e.value)


# -- 7. identity means what runs -----------------------------------------------------------------------------------------

def test_resume_with_fewer_rounds_than_done_is_refused(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "r"
    shutil.copytree(finished_run[0], run)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**finished_run[1], "rounds": 1}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(["run", str(tmp_path / "c.yaml"), "--resume", str(run)])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "'rounds'" in lines[0] and "2 rounds" in lines[0], lines
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("over, key", [
    ({"backend": {"name": "sequential", "partial_aggregate": 1}}, "backend.partial_aggregate"),
    ({"backend": {"name": "sequential", "partial_aggregate": 0}}, "backend.partial_aggregate"),
    ({"model": {"arch": "mlp", "params": {"embed_dim": 0}}}, "model.params.embed_dim"),
    ({"model": {"arch": "mlp", "params": {"embed_dim": 2.5}}}, "model.params.embed_dim"),
    ({"model": {"per_client": [{"arch": "mlp", "params": {"embed_dim": -1}}]}}, "model.per_client[0].params.embed_dim"),
    ({"algorithm": {"name": "raysim.algorithm:Algorithm"}}, "algorithm.name"),
])
def test_values_that_mean_nothing_are_refused_at_config_time(over, key):
    from raysim.config import make_config

    with pytest.raises(ConfigError) as e:
        make_config(tiny_config(**over)).config_hash()
        from raysim.config.registry import algorithm_class

        algorithm_class(make_config(tiny_config(**over)).algorithm.name)
    assert e.value.field == key


@pytest.mark.parametrize("algorithm, over, key", [
    ("scaffold", {"backend": {"name": "sequential", "partial_aggregate": True}}, "partial_aggregate"),  # no merge
    ("vhl", {"backend": {"name": "sequential", "partial_aggregate": True}}, "partial_aggregate"),
    ("fedavg", {"backend": {"name": "sequential", "partial_aggregate": True},
                "env": {"preset": "mobile-heterogeneous"}}, "partial_aggregate"),  # the env decides what arrives
    ("fedmd", {"backend": {"name": "sequential", "vectorize": True}}, "vectorize"),  # no LocalTraining, no group form
    ("ifca", {"backend": {"name": "sequential", "vectorize": True}}, "vectorize"),
])
def test_a_backend_switch_that_does_nothing_is_left_out_of_the_identity_with_a_notice(algorithm, over, key):
    from raysim.config import make_config
    from raysim.engine.prepare import _notice_dropped

    on = make_config(tiny_config(algorithm={"name": algorithm}, **over))
    plain = make_config(tiny_config(algorithm={"name": algorithm}, **{**over, "backend": {"name": "sequential"}}))
    assert on.inert_backend() == (key,)
    assert on.run_id() == plain.run_id() and f"backend.{key}" not in on.identity_dict()
    notes = []
    _notice_dropped(on, notes.append)
    assert len(notes) == 1 and f"backend.{key}: true does nothing for {algorithm}" in notes[0], notes
    assert on.run_id() in notes[0] and "left out of the run's identity" in notes[0]


@pytest.mark.parametrize("algorithm, key", [("fedavg", "partial_aggregate"), ("fedavg", "vectorize"),
                                            ("scaffold", "vectorize"), ("mafml", "vectorize"),
                                            ("fedproto", "partial_aggregate")])
def test_a_backend_switch_that_changes_the_numbers_stays_in_the_identity(algorithm, key):
    from raysim.config import make_config

    on = make_config(tiny_config(algorithm={"name": algorithm}, backend={"name": "sequential", key: True}))
    plain = make_config(tiny_config(algorithm={"name": algorithm}, backend={"name": "sequential", key: False}))
    assert on.inert_backend() == () and on.run_id() != plain.run_id()  # (off: auto is on for MAFML on a CPU too)
    assert f"backend.{key}" in on.identity_dict()


def test_a_dry_run_says_that_partial_aggregate_does_nothing_for_scaffold(userdir, capsys):
    cfg = tiny_config(rounds=1, algorithm={"name": "scaffold"}, backend={"name": "sequential",
                                                                          "partial_aggregate": True})
    cfg["output"] = {"progress": False, "dir": "out"}
    (userdir / "s.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["run", "s.yaml", "--dry-run"])
    out = capsys.readouterr()
    plain = tiny_config(rounds=1, algorithm={"name": "scaffold"})
    from raysim.config import make_config

    rid = make_config({**plain, "output": cfg["output"]}).run_id()
    assert code == 0 and f"run id {rid}" in out.out
    assert "backend.partial_aggregate: true does nothing for scaffold" in out.err, out.err


def test_a_missing_objective_metric_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    c = tiny_config(rounds=1, data__val_fraction=0.25)
    c["output"] = {"dir": "out", "progress": False}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {
        "type": "float", "low": 0.1, "high": 2.0}}, "objective": {"metric": "val_nothing"}}))
    code = main(["tune", "c.yaml", "--space", "space.yaml", "--trials", "1"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "objective.metric" in lines[0] and "val_nothing" in lines[0], lines
    assert not (tmp_path / "out").exists()  # the study that never ran a trial is not kept: the fixed command starts afresh


def _tune_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = tiny_config(rounds=1, data__val_fraction=0.25)
    c["output"] = {"dir": "out", "progress": False}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {
        "type": "float", "low": 0.1, "high": 2.0}}, "objective": {"metric": "val_acc"}}))


def test_an_sqlite_database_of_another_application_is_refused(tmp_path, monkeypatch, capsys):
    import sqlite3

    _tune_dir(tmp_path, monkeypatch)
    con = sqlite3.connect(tmp_path / "app.db")
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.commit()
    con.close()
    before = (tmp_path / "app.db").read_bytes()
    code = main(["tune", "c.yaml", "--space", "space.yaml", "--trials", "1", "--storage", "sqlite:///app.db"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "--storage" in lines[0] and "users" in lines[0], lines
    assert (tmp_path / "app.db").read_bytes() == before


def test_a_study_raysim_did_not_create_is_not_adopted(tmp_path, monkeypatch, capsys):
    import optuna

    from tuning.storage import open_storage

    _tune_dir(tmp_path, monkeypatch)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="theirs", storage=open_storage(f"journal:{tmp_path / 's.log'}"))
    before = (tmp_path / "s.log").read_bytes()
    code = main(["tune", "c.yaml", "--space", "space.yaml", "--trials", "1", "--storage", "journal:s.log",
                 "--study-name", "theirs"])
    lines = one_line(capsys)
    assert (tmp_path / "s.log").read_bytes() == before  # not written to
    assert code == 2 and len(lines) == 1 and "--study-name" in lines[0] and "not created by raysim" in lines[0], lines


def test_a_dry_run_summarises_a_large_population(tmp_path, monkeypatch, capsys):
    from raysim.app.cli import DRY_RUN_CLIENTS

    monkeypatch.chdir(tmp_path)
    c = tiny_config(rounds=1, data={"dataset": "synthetic", "num_clients": 80, "partition": "iid",
                                    "partition_params": {}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    assert main(["run", "c.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = [ln for ln in out.splitlines() if ln.startswith("  client ")]
    assert len(listed) == DRY_RUN_CLIENTS and "  client  79:" in out and "30 more clients" in out


def test_a_float_range_on_an_integer_key_is_refused_before_any_trial(tmp_path, monkeypatch, capsys):
    _tune_dir(tmp_path, monkeypatch)
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": {"train.local_epochs": {
        "type": "float", "low": 1, "high": 3}}, "objective": {"metric": "val_acc"}}))
    code = main(["tune", "c.yaml", "--space", "space.yaml", "--trials", "1"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "space.params.train.local_epochs" in lines[0], lines
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("results.parquet"))


def test_out_dot_in_a_project_whose_config_is_config_yaml_is_refused(tmp_path, monkeypatch, capsys):
    proj = tmp_path / "proj"
    proj.mkdir()
    monkeypatch.chdir(proj)
    (proj / "config.yaml").write_text(yaml.safe_dump({**tiny_config(rounds=1), "output": {"progress": False}}))
    code = main(["run", "config.yaml", "--out", "."])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "'--out'" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]  # no ../proj-2


def test_an_async_server_that_never_gets_an_update_stops_with_one_line(tiny):
    from raysim.engine.loop import run_experiment
    from raysim.errors import SimulationError

    cfg = tiny(rounds=2, server={"mode": "async", "concurrency": 2, "buffer_size": 1}, algorithm={"name": "fedavg"},
               env={"preset": "mobile-heterogeneous", "participation": {
                   "availability": {"mode": "bernoulli", "p": 1e-12}, "idle_s": 3600}})
    with pytest.raises(SimulationError, match=r"async: no client update arrived in 30 simulated days .*"
                                              r"env.participation"):
        bounded(lambda: run_experiment(cfg, write=False))


@pytest.mark.parametrize("p", [0.0, 1e-12])
def test_a_sync_run_in_which_no_client_is_ever_available_exits_1_with_one_line(userdir, capsys, p):
    cfg = tiny_config(rounds=2, env={"participation": {"availability": {"mode": "bernoulli", "p": p}, "idle_s": 30}})
    cfg["output"] = {"progress": False, "dir": "out"}
    (userdir / "c.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["run", "c.yaml"])
    lines = one_line(capsys)
    assert code == 1 and len(lines) == 1, lines
    assert "no client ever trained" in lines[0] and "2 rounds" in lines[0] and "env.participation.availability" in \
        lines[0]
    assert not (userdir / "out").exists() or not any((userdir / "out").iterdir())  # no result left behind


def test_ten_million_nway_kshot_clients_are_refused_in_seconds_before_the_partitioner(monkeypatch, capsys):
    """FedProto's nway_kshot with 10,000,000 clients on a machine with 16 GiB free: the smallest client holds
    2 classes x 24 shots + 2 x 15 test samples, so the population's index data alone (held twice until built) needs
    ~18 GiB; refused with one line naming data.num_clients, exit 2, before any data is loaded (was: 116 s in the
    partitioner; the fixed estimate alone, 640 B a client, let it through)."""
    from raysim.config import make_config
    from raysim.engine import prepare as prep

    monkeypatch.setattr(prep, "_available_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr(prep, "build_federated_data", lambda *a: pytest.fail("data built"))
    with open(ROOT / "configs" / "fedproto_mnist5k.yaml") as f:
        c = yaml.safe_load(f)
    c["data"]["num_clients"] = 10_000_000
    assert prep.population_indices(make_config(c))[0] == 2 * 24 + 2 * 15
    c["backend"] = {"name": "sequential"}
    with pytest.raises(ConfigError, match=r"10,000,000 clients \(ways 4 x shots 25 x stdev 2 x test_shots 15\) "
                                          r"need about 17\.6 GiB") as e:
        prep._check_population_memory(make_config(c))
    assert e.value.field == "data.num_clients"
    c["data"]["num_clients"] = 1_000_000  # 1.8 GiB: fits
    prep._check_population_memory(make_config(c))
    c["data"]["partition_params"] = {"ways": "4"}  # not a number: left to the partitioner's own refusal
    assert prep.population_indices(make_config(c)) == (0, "")
    code = main(["run", str(ROOT / "configs" / "fedproto_mnist5k.yaml"), "--dry-run", "--set",
                 "data.num_clients=10000000", "--set", "backend.name=sequential"])
    lines = one_line(capsys)  # refused before any data is built (building it is stubbed to fail above)
    assert code == 2 and len(lines) == 1 and "data.num_clients" in lines[0], lines


def test_a_thousand_tiny_actors_are_refused_against_memory_before_data_is_built(userdir, monkeypatch, capsys):
    """1,000 client actors at 0.001 CPU pass the CPU check (1 CPU in all), but each is a Python process with torch
    (~250 MB): on a machine with 16 GiB free they are refused with one line naming backend.num_actors, exit 2, before
    any data is built (was: accepted with state_memory_mb 0, and only after the data was built; 12 actors took 9.2 GB
    here). Per-architecture pools name their entry."""
    from raysim.backends import ray_preflight
    from raysim.config import make_config
    from raysim.engine import prepare as prep
    from raysim.engine.settings import backend_settings

    monkeypatch.setattr(ray_preflight, "machine_memory", lambda: 16 * 2**30)
    monkeypatch.setattr(prep, "build_federated_data", lambda *a: pytest.fail("data built"))
    c = tiny_config(rounds=1, data={"dataset": "synthetic", "num_clients": 1000, "partition": "iid",
                                    "partition_params": {}},
                    backend={"name": "ray", "num_actors": 1000, "num_cpus": 0.001, "state_memory_mb": 0})
    s = backend_settings(make_config(c))
    with pytest.raises(ConfigError, match=r"1000 client actors x at least 250 MB .* 244\.1 GiB, more than the "
                                          r"16\.0 GiB this machine has; use at most 65 actors") as e:
        ray_preflight.check_resources(s, 1.0, 0.0, "this machine", 16 * 2**30)
    assert e.value.field == "backend.num_actors"
    ray_preflight.check_resources(s, 1.0, 0.0, "this machine", 0.0)  # memory unknown: not checked
    c["backend"]["num_actors"] = 60
    ray_preflight.check_resources(backend_settings(make_config(c)), 1.0, 0.0, "this machine", 16 * 2**30)
    pools = dict(c, backend={"name": "ray", "num_actors": 1, "num_cpus": 0.001, "state_memory_mb": 0, "model_resources": [
        {"arch": c["model"]["arch"], "num_actors": 500, "num_cpus": 0.001}]})
    with pytest.raises(ConfigError) as e:
        ray_preflight.check_resources(backend_settings(make_config(pools)), 1.0, 0.0, "x", 16 * 2**30)
    assert e.value.field == "backend.model_resources[0].num_actors"
    c["backend"]["num_actors"] = 1000
    (userdir / "c.yaml").write_text(yaml.safe_dump(c))
    code = main(["run", "c.yaml", "--dry-run"])
    lines = one_line(capsys)
    assert code == 2 and len(lines) == 1 and "backend.num_actors" in lines[0] and "250 MB" in lines[0], lines


def test_an_actor_that_dies_beyond_max_retries_stops_the_run_with_one_line(monkeypatch):
    """A client actor that keeps dying (its node is gone) is retried max_retries times, then the run stops with one
    line naming max_retries and on_actor_failure (was: its clients silently failed as with skip). Actor death is
    simulated as Ray reports it (RayActorError from ray.get on the step's report), without a cluster."""
    import ray

    from raysim.backends import ray_recovery
    from raysim.errors import SimulationError

    def dead(ref):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(ray_recovery.ray, "get", dead)

    class Host:  # the backend's side of ray_recovery.ActorHost
        def __init__(self):
            self.actors, self.replaced = ["a0"], 0

        def replace_actor(self, k):
            self.replaced += 1

        def confirmed(self, k):
            pass

    host = Host()
    recovery = ray_recovery.ActorRecovery(host, "retry", 2)
    with pytest.raises(SimulationError, match=r"client actor 0 died during round 1 \(RayActorError\) and again after "
                                              r"max_retries=2 retries .*on_actor_failure: skip") as e:
        recovery.call_actors([[3, 5]], lambda actor, group: ("res", "rep"), "round 1")
    assert "\n" not in str(e.value) and host.replaced == 2
    assert [f["action"] for f in recovery.failures] == ["retry", "retry", "stop"]
    skip = ray_recovery.ActorRecovery(Host(), "skip", 2)  # skip still fails the actor's clients and goes on
    assert skip.call_actors([[3, 5]], lambda actor, group: ("res", "rep"), "round 1") == {0: (None, None)}
    with pytest.raises(SimulationError, match="max_retries=0"):
        ray_recovery.ActorRecovery(Host(), "retry", 0).call_actors([[1]], lambda actor, group: ("res", "rep"),
                                                                   "round 1")
