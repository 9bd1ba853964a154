"""Damaged files, systematically: every kind of file raysim reads is truncated, emptied, changed in the middle or
replaced by a directory (and made unreadable where the tests do not run as root). Each time the command ends with one
line that names the file (exit 2, no traceback), listings show the run as ``damaged`` and keep every healthy run,
and a damaged table is never read as data."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from raysim.io import results
from raysim.app.cli import main
from raysim.config import make_config
from raysim.errors import DamagedFileError, DataError
from raysim.engine.loop import run_experiment
from tests.conftest import tiny_config


# -- ways to damage a file -------------------------------------------------------------------------------------------

def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def empty(f: Path) -> None:
    f.write_bytes(b"")


def flip_middle(f: Path) -> None:
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    for i in range(mid, min(mid + 16, len(b))):
        b[i] ^= 0xFF
    f.write_bytes(bytes(b))


def directory(f: Path) -> None:
    f.unlink()
    f.mkdir()


def unreadable(f: Path) -> None:
    f.chmod(0)


DAMAGES = [truncate, empty, flip_middle, directory]
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
if not ROOT:  # root reads any file: permissions cannot be tested there
    DAMAGES.append(unreadable)
IDS = [d.__name__ for d in DAMAGES]


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# -- a finished run, copied per case ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    cfg = tiny_config(rounds=2, output={"progress": False, "checkpoint_every": 1})
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_experiment(make_config(cfg), out_dir=root / "run")
    return root


@pytest.fixture
def runs(finished, tmp_path):
    """A directory with two copies of the finished run: ``healthy`` and ``bad`` (to be damaged)."""
    shutil.copytree(finished / "run", tmp_path / "runs" / "healthy")
    shutil.copytree(finished / "run", tmp_path / "runs" / "bad")
    shutil.copy(finished / "c.yaml", tmp_path / "c.yaml")
    return tmp_path / "runs"


def test_finished_run_records_digests(finished):
    info = json.loads((finished / "run" / "run.json").read_text())
    assert info["results_sha256"] == results.file_sha256(finished / "run" / "results.parquet")
    from raysim.io.checkpoints import find_checkpoint, read_checkpoint_meta

    meta = read_checkpoint_meta(find_checkpoint(finished / "run"))
    assert {"server.pt", "clients-0.pt"} <= set(meta["sha256"])


# -- result tables and run.json --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["results.parquet", "run.json"])
@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_run_files(runs, name, damage, capsys):
    bad = runs / "bad" / name
    damage(bad)
    with pytest.raises(DamagedFileError) as e:
        results.load(runs / "bad")
    assert e.value.path == str(bad)
    # report on the damaged run alone: one line naming the file, exit 2
    assert main(["report", str(runs / "bad"), "--out", str(runs.parent / "rep1"), "--no-plots"]) == 2
    assert str(bad) in one_line(capsys.readouterr().err)
    assert not (runs.parent / "rep1").exists()
    # listing: the damaged run is listed as damaged, the healthy one as finished
    assert main(["runs", str(runs)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.rstrip().endswith("bad"))
    assert "damaged" in line and name in line
    assert "finished" in next(ln for ln in out.splitlines() if ln.rstrip().endswith("healthy"))
    # report over the directory: the healthy run is reported, the damaged one skipped with one line naming it
    assert main(["report", str(runs), "--out", str(runs.parent / "rep2"), "--no-plots"]) == 0
    cap = capsys.readouterr()
    assert "1 run(s)" in cap.out and str(bad) in one_line(cap.err)


def test_bytes_changed_in_the_middle_of_a_table_are_never_data(runs):
    f = runs / "bad" / "results.parquet"
    flip_middle(f)
    with pytest.raises(DamagedFileError, match="contents changed since the run finished"):
        results.load(f)
    with pytest.raises(DamagedFileError):
        results.load_metadata(runs / "bad")


def test_old_run_without_digest_is_still_readable(runs):
    info_path = runs / "bad" / "run.json"
    info = json.loads(info_path.read_text())
    info.pop("results_sha256")
    info_path.write_text(json.dumps(info))
    assert len(results.load(runs / "bad")) == len(results.load(runs / "healthy"))
    (runs / "bad" / "run.json").unlink()  # a table copied without its run.json
    assert len(results.load(runs / "bad" / "results.parquet")) > 0


# -- checkpoints -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["meta.pt", "clients-0.pt", "server.pt"])
@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_checkpoint_is_named_before_a_resume_claims_anything(runs, name, damage, capsys):
    from raysim.io.checkpoints import find_checkpoint

    ck = find_checkpoint(runs / "bad")
    damage(ck / name)
    before = sorted(p.name for p in runs.iterdir())
    code = main(["run", str(runs.parent / "c.yaml"), "--resume", str(runs / "bad"), "--set", "rounds=3"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and str(ck / name) in line and "remove" in line
    assert sorted(p.name for p in runs.iterdir()) == before  # nothing claimed, nothing partial


# -- spilled client states -------------------------------------------------------------------------------------------

def test_damaged_spilled_state_stops_the_run_naming_it(tmp_path):
    import raysim

    state_dir = tmp_path / "states"

    class Damage(raysim.Callback):
        def on_round_end(self, run, round_idx, evaluated):
            if round_idx == 0:
                for f in state_dir.rglob("client_*.pt"):
                    flip_middle(f)

    cfg = make_config(tiny_config(rounds=2, backend={"name": "sequential", "state_memory_mb": 0,
                                                     "state_dir": str(state_dir)}))
    with pytest.raises(DamagedFileError) as e:
        run_experiment(cfg, out_dir=tmp_path / "out", callbacks=[Damage()])
    assert Path(e.value.path).is_relative_to(state_dir) and "backend.state_dir" in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.incomplete").exists()


# -- configs and search spaces ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_config(tmp_path, damage, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(tiny_config()))
    damage(f)
    code = main(["run", str(f), "--out", str(tmp_path / "out")])
    line = one_line(capsys.readouterr().err)
    if damage is truncate and (code == 0 or "config error at" in line):  # half a YAML file may still be valid YAML
        return                                                             # (then its values are checked as usual)
    assert code == 2 and str(f) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_search_space(tmp_path, damage, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(data__val_fraction=0.25)))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 2.0}},
                                     "objective": {"metric": "val_acc"}}))
    damage(space)
    code = main(["tune", str(cfg), "--space", str(space), "--trials", "1", "--out", str(tmp_path / "t")])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and str(space) in line and ("--space" in line or "space." in line)
    assert not (tmp_path / "t").exists()


# -- data files under data.root --------------------------------------------------------------------------------------

IDX = {"train-images-idx3-ubyte": (20, 28, 28), "train-labels-idx1-ubyte": (20,),
       "t10k-images-idx3-ubyte": (10, 28, 28), "t10k-labels-idx1-ubyte": (10,)}


def write_idx(root: Path, compress: bool) -> None:
    rng = np.random.default_rng(0)
    for name, shape in IDX.items():
        arr = rng.integers(0, 10 if len(shape) == 1 else 256, size=shape, dtype=np.uint8)
        data = struct.pack(">HBB", 0, 8, len(shape)) + struct.pack(">" + "I" * len(shape), *shape) + arr.tobytes()
        if compress:
            with gzip.open(root / (name + ".gz"), "wb") as f:
                f.write(data)
        else:
            (root / name).write_bytes(data)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_idx_data(tmp_path, compress, damage):
    from raysim.data.datasets import load_fashion_mnist

    write_idx(tmp_path, compress)
    load_fashion_mnist(str(tmp_path))  # intact: loads
    f = tmp_path / ("train-images-idx3-ubyte" + (".gz" if compress else ""))
    damage(f)
    try:
        load_fashion_mnist(str(tmp_path))
    except DamagedFileError as e:
        assert e.path == str(f) and e.field == "data.root"
        return
    # a flipped byte inside raw pixels is a valid image file: only the header and the size can be checked there
    assert damage is flip_middle and not compress


# -- the files partitioner's split -----------------------------------------------------------------------------------

def write_split(root: Path, n: int = 2) -> None:
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "config.json").write_text(json.dumps({"num_clients": n, "num_classes": 3}))
    rng = np.random.default_rng(0)
    for i in range(n):
        for part, m in (("train", 12), ("test", 6)):
            with open(root / part / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": rng.normal(size=(m, 1, 4, 4)).astype(np.float32),
                                             "y": rng.integers(0, 3, size=m)})


def split_config(root: Path) -> dict:
    return tiny_config(data={"dataset": "synthetic", "num_clients": 2, "partition": "files",
                             "partition_params": {"root": str(root)}})


@pytest.mark.parametrize("name", ["train/0.npz", "test/1.npz", "config.json"])
@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_damaged_split_files(tmp_path, name, damage):
    from raysim.data.federated import build_federated_data

    write_split(tmp_path / "split")
    cfg = make_config(split_config(tmp_path / "split"))
    build_federated_data(cfg.data, cfg.seed)
    f = tmp_path / "split" / name
    damage(f)
    with pytest.raises(DamagedFileError) as e:
        build_federated_data(cfg.data, cfg.seed)
    assert e.value.path == str(f) and e.value.field == "data.partition_params.root"


def test_split_file_cannot_run_code(tmp_path):
    """A split file is read without executing pickled code: a payload naming os.system is refused, naming the file."""
    import pickle

    from raysim.data.federated import build_federated_data

    write_split(tmp_path / "split")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    f = tmp_path / "split" / "train" / "0.npz"
    with zipfile.ZipFile(f, "w") as z:
        with z.open("data.npy", "w") as fp:
            np.lib.format.write_array_header_1_0(fp, {"descr": "|O", "fortran_order": False, "shape": ()})
            pickle.dump(Evil(), fp)
    cfg = make_config(split_config(tmp_path / "split"))
    with pytest.raises(DamagedFileError, match="refused to load"):
        build_federated_data(cfg.data, cfg.seed)
    assert not marker.exists()


# -- study storage ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["journal", "sqlite"])
@pytest.mark.parametrize("damage", [flip_middle, directory, truncate], ids=["flip_middle", "directory", "truncate"])
def test_damaged_study_storage(tmp_path, kind, damage, capsys):
    from tuning.study import open_storage

    f = tmp_path / ("study.log" if kind == "journal" else "study.db")
    url = f"journal:{f}" if kind == "journal" else f"sqlite:///{f}"
    if kind == "journal":
        f.write_text("\n".join(json.dumps({"op_code": 0, "worker_id": "w", "study_name": f"s{i}", "directions": [1]})
                               for i in range(40)) + "\n")
    else:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna.create_study(study_name="s", storage=open_storage(url))
    damage(f)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(data__val_fraction=0.25)))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 2.0}},
                                     "objective": {"metric": "val_acc"}}))
    code = main(["tune", str(cfg), "--space", str(space), "--trials", "1", "--storage", url, "--out",
                 str(tmp_path / "t")])
    err = capsys.readouterr().err
    if code == 0:  # a journal cut at a line end, or a change inside a string, can still be a valid study
        assert damage in (truncate, flip_middle)
        return
    line = one_line(err)
    assert code == 2 and "--storage" in line and str(f) in line
    assert not (tmp_path / "t" / "trials").exists()


def test_damaged_candidate_image(tmp_path):
    from raysim.data.class_folders import load_class_folders as load_image_folder
    from PIL import Image

    (tmp_path / "0").mkdir()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(tmp_path / "0" / "a.png")
    load_image_folder(str(tmp_path), (1, 8, 8), 2)
    truncate(tmp_path / "0" / "a.png")
    with pytest.raises(DamagedFileError) as e:
        load_image_folder(str(tmp_path), (1, 8, 8), 2)
    assert e.value.path == str(tmp_path / "0" / "a.png")
    assert isinstance(e.value, DataError)


def test_split_file_larger_than_memory_is_refused_before_unpacking(tmp_path, monkeypatch):
    """A split file that unpacks to more than half the free memory (a zip bomb) is refused from its zip header."""
    from raysim.data import datasets
    from raysim.data.federated import build_federated_data

    write_split(tmp_path / "split")
    monkeypatch.setattr(datasets, "available_memory", lambda: 1000)
    cfg = make_config(split_config(tmp_path / "split"))
    with pytest.raises(DamagedFileError, match="unpacks to") as e:
        build_federated_data(cfg.data, cfg.seed)
    assert e.value.path.endswith("0.npz")
