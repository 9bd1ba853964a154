"""Bring your own model, data and method (issue 24): import paths and registrations, the body/head split of user
modules, the npz / imagefolder / leaf formats with every partitioner that fits them, the natural partition, the dry
run's model and data lines, one-line errors (exit 2) before any Ray process starts, and the example of examples/byo
end to end (sequential here; Ray in test_byo_ray). The user's modules live in a temporary working directory that is
neither installed nor on PYTHONPATH."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import yaml

from raysim.io.results import without_timing
import raysim
from raysim.config import registry
from raysim.app.cli import main
from raysim.config import ArchSpec, make_config
from raysim.errors import ConfigError, DataError
from raysim.data.federated import build_federated_data
from raysim.models import SplitModel, build_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "byo"
MODULES = ("mycnn", "mydata", "mymethod")

BAD_MODULE = '''
import numpy as np
import torch.nn as nn

import raysim

@raysim.model_factory
def no_args():
    return nn.Linear(4, 2)

@raysim.model_factory
def not_a_module(input_shape, num_classes):
    return "linear"

@raysim.model_factory
def wrong_logits(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes + 1))

@raysim.dataset_loader
def loader_no_root():
    return {}

def _base():
    rng = np.random.default_rng(0)
    return {"x_train": rng.normal(size=(40, 1, 8, 8)).astype(np.float32), "y_train": np.arange(40) % 4,
            "x_test": rng.normal(size=(20, 1, 8, 8)).astype(np.float32), "y_test": np.arange(20) % 4}

@raysim.dataset_loader
def missing_key(root):
    d = _base(); d.pop("y_test"); return d

@raysim.dataset_loader
def flat_images(root):
    d = _base(); d["x_train"] = d["x_train"].reshape(40, 64); return d

@raysim.dataset_loader
def float_labels(root):
    d = _base(); d["y_train"] = d["y_train"] + 0.5; return d

@raysim.dataset_loader
def int_images(root):
    d = _base(); d["x_train"] = (d["x_train"] * 10).astype(np.int64); return d

@raysim.dataset_loader
def negative_label(root):
    d = _base(); d["y_test"][3] = -1; return d

@raysim.dataset_loader
def label_outside(root):
    d = _base(); d["num_classes"] = 3; return d

@raysim.dataset_loader
def size_mismatch(root):
    d = _base(); d["x_test"] = np.zeros((20, 1, 10, 10), np.float32); return d

@raysim.dataset_loader
def raises(root):
    raise RuntimeError("disk on fire")
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding the example's user modules (copied: outside the repository), as cwd."""
    for m in MODULES:
        shutil.copy(EXAMPLE / f"{m}.py", tmp_path / f"{m}.py")
    (tmp_path / "badmods.py").write_text(BAD_MODULE)
    monkeypatch.chdir(tmp_path)
    saved = (dict(registry.MODELS), dict(registry.DATASETS))
    yield tmp_path
    for m in MODULES + ("badmods",):
        sys.modules.pop(m, None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
    registry.MODELS.clear(), registry.MODELS.update(saved[0])
    registry.DATASETS.clear(), registry.DATASETS.update(saved[1])


def digits_npz(path) -> str:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import mydata
        return mydata.write_npz(path)
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("mydata", None)


def byo_config(**over) -> dict:
    cfg = {"name": "byo", "seed": 3, "rounds": 2,
           "data": {"dataset": "npz", "root": "digits.npz", "num_clients": 4, "partition": "dirichlet",
                    "partition_params": {"alpha": 1.0, "samples_per_client": 60, "test_ratio": 0.25}},
           "model": {"arch": "mycnn:small_cnn", "params": {"channels": 4, "embed_dim": 16}},
           "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05},
           "algorithm": {"name": "fedproto", "params": {}},
           "backend": {"name": "sequential"}, "output": {"progress": False}}
    for key, value in over.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


# -- models -----------------------------------------------------------------------------------------------------------

def test_user_models_are_split_or_whole(workdir):
    x = torch.randn(3, 1, 8, 8)
    m = build_model(ArchSpec("mycnn:small_cnn", {"channels": 4, "embed_dim": 16}), (1, 8, 8), 10)
    assert isinstance(m, SplitModel) and m.embed_dim == 16  # features + classifier, as they are
    logits, z = m(x, return_embedding=True)
    assert logits.shape == (3, 10) and z.shape == (3, 16)
    whole = build_model(ArchSpec("mycnn:net"), (1, 8, 8), 10)  # no known split: logits only
    assert whole.embed_dim == 0 and whole(x, return_embedding=True)[1].shape == (3, 0)
    cut = build_model(ArchSpec("mycnn:net", {"hidden": 24}, "fc1"), (1, 8, 8), 10)  # cut after fc1 (torch.fx)
    assert isinstance(cut, SplitModel) and cut.embed_dim == 24
    # the cut model computes the module's own forward: same weights, same logits (eval mode)
    torch.manual_seed(0)
    ref = build_model(ArchSpec("mycnn:net", {"hidden": 24}), (1, 8, 8), 10).eval()
    torch.manual_seed(0)
    cut = build_model(ArchSpec("mycnn:net", {"hidden": 24}, "fc1"), (1, 8, 8), 10).eval()
    assert torch.allclose(ref(x), cut(x))
    # nn.Dropout inside a user module became the generator-driven raysim Dropout (same masks on every backend)
    from raysim.models import Dropout
    assert any(isinstance(mod, Dropout) and mod.p == 0.2 for mod in cut.modules())
    assert not any(type(mod) is nn.Dropout for mod in cut.modules())


def test_torchvision_builders_adapt_to_small_grayscale_inputs():
    m = build_model(ArchSpec("torchvision.models:resnet18"), (1, 28, 28), 10)  # weights=None: nothing downloaded
    logits, z = m(torch.randn(2, 1, 28, 28), return_embedding=True)  # 1 channel: a 1-channel first conv
    assert logits.shape == (2, 10) and z.shape == (2, 512) and m.embed_dim == 512
    m = build_model(ArchSpec("torchvision.models:resnet18", {}, "layer3"), (3, 32, 32), 5)
    assert m(torch.randn(2, 3, 32, 32), return_embedding=True)[1].shape == (2, 256 * 2 * 2)
    with pytest.raises(ConfigError, match="model.params.weights"):
        build_model(ArchSpec("torchvision.models:resnet18", {"weights": "DEFAULT"}), (3, 32, 32), 10)


# -- data -------------------------------------------------------------------------------------------------------------

def write_imagefolder(root: Path, n_per_class: int = 6, size: int = 8, test_size: int = 8, classes=("a", "b", "c")):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, side in (("train", size), ("test", test_size)):
        for k, c in enumerate(classes):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n_per_class):
                a = np.clip(rng.normal(60 + 60 * k, 20, size=(side, side)), 0, 255).astype(np.uint8)
                Image.fromarray(a, mode="L").save(d / f"{i}.png")


def write_leaf(root: Path, writers: int = 5, per_writer: int = 12, num_classes: int = 4):
    rng = np.random.default_rng(0)
    for split, n in (("train", per_writer), ("test", per_writer // 3)):
        (root / split).mkdir(parents=True)
        users = [f"f{w:04d}_{w}" for w in range(writers)]
        data = {}
        for w, u in enumerate(users):
            y = [(w + i) % num_classes for i in range(n)]
            x = [(rng.random(64) * 0.5 + 0.1 * c).tolist() for c in y]
            data[u] = {"x": x, "y": y}
        (root / split / "all_data_0.json").write_text(json.dumps({"users": users, "num_samples": [n] * writers,
                                                                  "user_data": data}))


def npz_with_groups(path: Path):
    rng = np.random.default_rng(0)
    y_tr, y_te = np.arange(120) % 4, np.arange(40) % 4
    np.savez(path, x_train=rng.integers(0, 255, size=(120, 8, 8), dtype=np.uint8), y_train=y_tr,
             x_test=rng.integers(0, 255, size=(40, 8, 8), dtype=np.uint8), y_test=y_te,
             groups_train=np.arange(120) % 6, groups_test=np.arange(40) % 6)


PARTITIONS = {
    "iid": {"samples_per_client": 10, "test_per_client": 3},
    "dirichlet": {"alpha": 1.0, "samples_per_client": 10, "min_samples": 2, "test_ratio": 0.2},
    "pathological": {"classes_per_client": 2},
    "nway_kshot": {"ways": 2, "shots": 4, "stdev": 1, "test_shots": 1},
    "shared_base": {"per_class": 2, "test_per_class": 1},
    "domain_dirichlet": {"alpha": 1.0, "samples_per_client": 6, "test_ratio": 0.2},  # with data.rotations
    "natural": {},
}


@pytest.mark.parametrize("fmt", ["npz", "loader", "imagefolder", "leaf"])
def test_every_loader_with_every_partitioner_that_fits(workdir, fmt):
    (workdir / "registered.py").write_text("import numpy as np\nimport raysim\n"
                                           "@raysim.dataset_loader\n"
                                           "def load(root, scale=1.0):\n"
                                           "    d = dict(np.load(root))\n"
                                           "    d['x_train'] = np.full(d['x_train'].shape, scale, np.float32)\n"
                                           "    d['x_test'] = np.zeros(d['x_test'].shape, np.float32)\n"
                                           "    return d\n")
    npz_with_groups(workdir / "g.npz")
    data = {"npz": {"dataset": "npz", "root": "g.npz"},
            "loader": {"dataset": "registered:load", "root": "g.npz", "dataset_params": {"scale": 2.0}},
            "imagefolder": {"dataset": "imagefolder", "root": "imgs", "dataset_params": {"size": 8}},
            "leaf": {"dataset": "leaf", "root": "leaf", "dataset_params": {"num_classes": 4}}}[fmt]
    if fmt == "imagefolder":
        write_imagefolder(workdir / "imgs", n_per_class=12, test_size=10)  # test images resized to 8x8 too
    if fmt == "leaf":
        write_leaf(workdir / "leaf")
    for name, params in PARTITIONS.items():
        if name == "natural" and fmt == "imagefolder":
            continue  # no natural clients in a class-per-folder layout
        n = 5 if name == "natural" and fmt == "leaf" else 3
        extra = {"rotations": [0, 90]} if name == "domain_dirichlet" else {}
        cfg = make_config({"data": {**data, **extra, "num_clients": n, "partition": name, "partition_params": params}})
        fd = build_federated_data(cfg.data, 1)
        assert len(fd.clients) == n and all(c.num_train > 0 for c in fd.clients), (fmt, name)
        assert fd.input_shape == (1, 8, 8), (fmt, fd.input_shape)
        if fmt == "loader":
            assert float(fd.clients[0].x_train.max()) == 2.0  # dataset_params reached the loader
    if fmt in ("npz", "leaf"):  # natural: every writer / group id is a client with exactly its samples
        k = 5 if fmt == "leaf" else 6
        cfg = make_config({"data": {**data, "num_clients": k, "partition": "natural"}})
        fd = build_federated_data(cfg.data, 1)
        assert [c.num_train for c in fd.clients] == ([12] * 5 if fmt == "leaf" else [20] * 6)
        assert [int(c.y_test.numel()) for c in fd.clients] == ([4] * 5 if fmt == "leaf" else [7, 7, 7, 7, 6, 6])


def test_register_model_and_dataset_and_algorithm_by_import_path(workdir):
    digits_npz(workdir / "digits.npz")
    sys.path.insert(0, str(workdir))  # as a user's script in that directory sees it
    import mycnn
    import mydata

    raysim.register_model("my_cnn", mycnn.small_cnn)  # a callable
    raysim.register_dataset("my_digits", "mydata:digits")  # an import path
    base = byo_config(rounds=1)
    base["model"]["arch"] = "my_cnn"
    base["data"].update(dataset="my_digits", root=None)
    a = raysim.run_experiment(make_config(base), write=False)
    b = raysim.run_experiment(make_config(byo_config(rounds=1, data__dataset="mydata:digits", data__root=None)),
                              write=False)
    assert without_timing(a.table).drop(columns="run_id").equals(without_timing(b.table).drop(columns="run_id"))
    c = raysim.run_experiment(make_config(byo_config(rounds=1, algorithm={"name": "mymethod:UniformAvg"})),
                              write=False)
    assert (c.table["metric"] == "clients_averaged").any()  # the user's aggregate ran
    assert mydata.digits is not None
    with pytest.raises(ValueError):
        raysim.register_model("cnn_mnist", mycnn.small_cnn)  # zoo names stay the zoo's


# -- visible and checked -------------------------------------------------------------------------------------------------

def test_dry_run_prints_model_and_data_per_client(workdir, capsys):
    digits_npz(workdir / "digits.npz")
    (workdir / "c.yaml").write_text(yaml.safe_dump(byo_config()))
    assert main(["run", "c.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "images 1x8x8" in out and "10 classes" in out
    line = next(l for l in out.splitlines() if l.strip().startswith("client   0:"))
    assert "x_train 60x1x8x8" in line and "arch mycnn:small_cnn" in line and "params 1," in line
    assert "embedding 16" in line
    cfg = byo_config(model={"per_client": [{"arch": "mycnn:small_cnn", "params": {"embed_dim": 16}},
                                           {"arch": "mycnn:net", "params": {"hidden": 16}, "embedding": "fc1"},
                                           {"arch": "mlp", "params": {"embed_dim": 16}}]})
    (workdir / "c.yaml").write_text(yaml.safe_dump(cfg))  # heterogeneous: user factories beside the zoo
    assert main(["run", "c.yaml", "--dry-run"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("client ")]
    assert "arch mycnn:net" in lines[1] and "embedding 16" in lines[1] and "arch mlp" in lines[2]


BAD = [  # (config overrides as dotted=value, the key the one-line message names, a fragment of it)
    ({"model__arch": "nomodule:factory"}, "model.arch", "cannot import module"),
    ({"model__arch": "mycnn:nothing"}, "model.arch", "has no 'nothing'"),
    ({"model__arch": "badmods:no_args", "model__params": {}}, "model.arch", "cannot be called as"),
    ({"model__arch": "badmods:not_a_module", "model__params": {}}, "model.arch", "not a torch.nn.Module"),
    ({"model__arch": "badmods:wrong_logits", "model__params": {}}, "model.arch", "expected logits"),
    ({"model__params": {"depth": 3}}, "model.params.depth", "unknown parameter"),
    ({"model__arch": "mycnn:net", "model__params": {}}, "model.embedding", "needs the model's embedding"),
    ({"model__arch": "mycnn:net", "model__params": {}, "model__embedding": "fc9"}, "model.embedding", "no layer"),
    ({"data__dataset": "nodata:load"}, "data.dataset", "cannot import module"),
    ({"data__dataset": "badmods:loader_no_root"}, "data.dataset", "cannot be called as"),
    ({"data__dataset": "badmods:missing_key"}, "data.dataset", "gives no y_test"),
    ({"data__dataset": "badmods:flat_images"}, "data.dataset", "N x C x H x W"),
    ({"data__dataset": "badmods:float_labels"}, "data.dataset", "integer class labels"),
    ({"data__dataset": "badmods:int_images"}, "data.dataset", "uint8 pixels or floating"),
    ({"data__dataset": "badmods:negative_label"}, "data.dataset", "outside the classes"),
    ({"data__dataset": "badmods:label_outside"}, "data.dataset", "outside the classes 0..2"),
    ({"data__dataset": "badmods:size_mismatch"}, "data.dataset", "image-size mismatch"),
    ({"data__dataset": "badmods:raises"}, "data.dataset", "disk on fire"),
    ({"data__dataset_params": {"nope": 1}}, "data.dataset_params.nope", "unknown parameter for npz"),
    ({"data__root": "missing.npz"}, "data.root", "is not a file"),
    ({"data__partition": "natural", "data__partition_params": {}}, "data.partition", "natural client ids"),
    ({"algorithm": {"name": "mymethod:Nope"}}, "algorithm.name", "has no 'Nope'"),
    ({"algorithm": {"name": "mycnn:small_cnn"}}, "algorithm.name", "not a subclass"),
    ({"backend__code": ["nothere.py"]}, "backend.code[0]", "neither a package"),
]


@pytest.mark.parametrize("over,key,fragment", BAD, ids=[f"{b[1]}:{b[2][:24]}" for b in BAD])
def test_bad_user_input_is_one_line_before_ray(workdir, capsys, monkeypatch, over, key, fragment):
    from raysim.backends import ray_backend, ray_preflight

    def no_ray(*a, **k):
        raise AssertionError("a Ray process was about to start")

    monkeypatch.setattr(ray_backend.RayBackend, "start", no_ray)
    monkeypatch.setattr(ray_preflight, "preflight_resources", lambda cfg: None)
    digits_npz(workdir / "digits.npz")
    cfg = byo_config(backend={"name": "ray", "num_actors": 1}, **over)
    (workdir / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "c.yaml", "--out", str(workdir / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and fragment in err, err
    assert err.count("\n") == 1, err
    assert not (workdir / "out").exists()


def test_empty_class_folder_and_imagefolder_mismatch(workdir):
    write_imagefolder(workdir / "imgs", test_size=10)
    cfg = make_config({"data": {"dataset": "imagefolder", "root": "imgs", "partition": "iid", "num_clients": 2}})
    with pytest.raises(DataError, match="data.dataset_params.size.*train/test image-size mismatch"):
        build_federated_data(cfg.data, 1)
    (workdir / "imgs" / "test" / "b" / "0.png").unlink()
    for f in (workdir / "imgs" / "test" / "b").iterdir():
        f.unlink()
    with pytest.raises(DataError, match="data.root.*empty class folder"):
        build_federated_data(cfg.data, 1)


def test_example_runs_end_to_end_sequential(workdir):
    """examples/byo/run_all.py: FedAvg and FedProto, npz and loader (same data: same table), sequential backend."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run_all
        rows = run_all.run(rounds=2, backends=("sequential",), verbose=False, overrides=("train.local_epochs=1",))
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("run_all", None)
    by = {(r["algorithm"], r["data"]): r for r in rows}
    assert set(by) == {(a, d) for a in ("fedavg", "fedproto") for d in ("npz", "loader")}
    for a in ("fedavg", "fedproto"):
        assert without_timing(by[(a, "npz")]["table"]).drop(columns="run_id").equals(without_timing(by[(a, "loader")]["table"]).drop(columns="run_id"))
        assert 0.1 < by[(a, "npz")]["test_acc"] <= 1.0
    assert by[("fedproto", "npz")]["test_acc"] > 0.3  # personalised prototypes: well above chance after 2 rounds
    assert "test_acc_proto" in by[("fedproto", "npz")]


@pytest.mark.ray
def test_user_code_ships_to_ray_actors(ray_session, workdir):
    """The example's model, loader and method from a working directory that is neither installed nor on PYTHONPATH:
    shipped to the actors (Ray py_modules), imported there from the shipped copy, same table as sequential."""
    import ray

    from raysim.engine.callbacks import Callback
    from raysim.engine.loop import run_experiment

    digits_npz(workdir / "digits.npz")
    seen = {}

    def imported_from(actor, names):  # run in each actor's process (Ray's __ray_call__): where it imported them from
        import sys

        return {n: getattr(sys.modules.get(n), "__file__", None) for n in names}

    class Where(Callback):
        def on_run_end(self, run, result):
            seen["shipped"] = run.backend.shipped
            seen["files"] = ray.get([a.__ray_call__.remote(imported_from, list(MODULES)) for a in run.backend.actors])

    # one run: the user's model and method, the data from a file named relative to the working directory (the
    # user's loader on Ray: tests/test_cluster.py, on two nodes)
    over = {"algorithm": {"name": "mymethod:UniformAvg"}}
    seq = run_experiment(make_config(byo_config(**over)), write=False).table
    cfg = make_config(byo_config(backend={"name": "ray", "num_actors": 2, "num_cpus": 0.5}, **over))
    par = run_experiment(cfg, write=False, callbacks=[Where()]).table
    assert without_timing(seq).drop(columns="run_id").equals(without_timing(par).drop(columns="run_id"))
    names = {Path(p).name for p in seen["shipped"]}
    assert {"mycnn.py", "mymethod.py"} <= names and all(Path(p).parent == workdir for p in seen["shipped"])
    for files in seen["files"]:  # each actor imported them from the copy Ray unpacked, not from workdir
        for m in ("mycnn", "mymethod"):
            assert files[m] and "runtime_resources" in files[m], files
    # release_warm_actors() ends the parked actors (these carry the user's code: no later run of the session can use
    # them; parked actors of other resources were ended when this run started) and gives their CPUs back to Ray
    from raysim.backends.ray_actors import release_warm_actors

    assert release_warm_actors() == 3  # the 2 client actors and the server
    deadline = time.time() + 120
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:  # kills are asynchronous
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) == 2
