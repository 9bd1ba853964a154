"""Dataset loaders: offline datasets, idx files from any directory, clear errors for missing data."""
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from raysim.data import DataError, load_dataset
from raysim.data.datasets import FASHION_DEFAULT_DIRS


def write_idx(path: Path, arr: np.ndarray, gz: bool):
    header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def test_fashion_mnist_from_any_directory(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 255, (30, 28, 28)), gz=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(30) % 10, gz=True)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 255, (10, 28, 28)), gz=False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(10), gz=False)
    ds = load_dataset("fashion_mnist", str(tmp_path))
    assert ds.train.x.shape == (30, 1, 28, 28) and ds.test.y.tolist() == list(range(10))
    assert ds.train.y[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_fashion_mnist_missing_or_truncated(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("fashion_mnist", str(tmp_path))
    assert e.value.field == "data.root"
    for n in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / n).write_bytes(struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 100) + b"\x00" * 10)
    with pytest.raises(DataError, match="truncated"):
        load_dataset("fashion_mnist", str(tmp_path))


@pytest.mark.skipif(not Path(FASHION_DEFAULT_DIRS[0]).exists(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_package():
    ds = load_dataset("fashion_mnist")
    assert len(ds.train) == 60000 and len(ds.test) == 10000
    assert np.bincount(ds.test.y.numpy()).tolist() == [1000] * 10


def test_mnist5k_and_digits_and_synthetic():
    m = load_dataset("mnist5k")
    assert m.train.x.shape == (5000, 1, 28, 28) and m.test is None
    assert np.bincount(m.train.y.numpy()).tolist() == [500] * 10
    # normalised with MNIST's constants: pixel p in [0, 1] -> (p - 0.1307) / 0.3081, so black and white are exact
    assert m.train.norm == (0.1307, 0.3081)
    assert float(m.train.x.min()) == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    assert float(m.train.x.max()) == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-6)
    d = load_dataset("digits")
    assert d.train.x.shape == (1797, 1, 8, 8)
    s = load_dataset("synthetic")
    assert s.num_classes == 10 and s.test is not None


def test_torchvision_datasets_need_a_local_root(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("cifar10")
    assert e.value.field == "data.root"
    with pytest.raises(DataError, match="not found under"):
        load_dataset("mnist", str(tmp_path))


def test_parsed_datasets_are_cached_read_only_and_callers_get_their_own_tensors():
    """mnist5k's CSV and scikit-learn's digits are parsed once per process; a caller that changes its tensors in
    place changes nobody else's."""
    from raysim.data.datasets import _mnist5k_arrays

    for name in ("mnist5k", "digits"):
        a = load_dataset(name)
        ref = a.train.x.clone()
        a.train.x.add_(1.0)
        a.train.y.zero_()
        b = load_dataset(name)
        assert torch.equal(b.train.x, ref) and int(b.train.y.max()) == 9
    X, y = _mnist5k_arrays()
    assert _mnist5k_arrays()[0] is X and not X.flags.writeable and not y.flags.writeable
