"""A researcher's own dataset: scikit-learn's 8x8 digits with a fixed, stratified 80/20 train/test split.

``digits(root)`` is a raysim loader (``data.dataset: mydata:digits``; marked with ``@raysim.dataset_loader``, without
which a config may not call it): it returns the arrays x_train, y_train, x_test,
y_test (images N x 1 x 8 x 8 as float32 in [-1, 1], labels 0..9). ``write_npz(path)`` saves the very same arrays as
an .npz file (``data.dataset: npz``, ``data.root: <path>``), so both routes give the same run.
"""
import numpy as np

import raysim


def arrays(seed: int = 0) -> dict:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.images.astype(np.float32) / 16.0 - 0.5) / 0.5)[:, None]  # N x 1 x 8 x 8
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: len(idx) // 5]] = True
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test]}


@raysim.dataset_loader
def digits(root=None, seed: int = 0) -> dict:
    """The loader: ``root`` is unused (the data come with scikit-learn); ``seed`` fixes the train/test split."""
    return arrays(seed)


def write_npz(path, seed: int = 0) -> str:
    np.savez_compressed(path, **arrays(seed))
    return str(path)
