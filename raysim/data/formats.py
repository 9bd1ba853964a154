"""The user's own data: a loader reached by import path or registered name, and three generic formats.

A loader is ``loader(root, **data.dataset_params) -> mapping`` with ``x_train, y_train, x_test, y_test`` (numpy
arrays or tensors; images N x C x H x W or N x H x W; integer labels 0..C-1) and optionally ``groups_train`` /
``groups_test`` (natural client ids, integers or strings: ``data.partition: natural`` gives every id its own client)
and ``num_classes`` (default: the largest label + 1). uint8 images are pixels: x = (pixel / 255 - 0.5) / 0.5 (and
clients keep them as uint8); float images are used as given.

Formats (``data.dataset``):

* ``npz``: ``data.root`` is a ``.npz`` file holding those arrays;
* ``imagefolder``: torchvision's layout, ``data.root/train/<class>/*.png`` and ``data.root/test/<class>/*``; classes
  are the sorted folder names of train/; ``dataset_params``: ``size`` (int or [h, w]: every image resized, bilinear;
  without it every image must already have one size) and ``channels`` (1 or 3; default: 1 when every image is
  grayscale, else 3);
* ``leaf``: LEAF's JSON (FEMNIST, ...): ``data.root/train/*.json`` and ``data.root/test/*.json`` with ``users``,
  ``user_data[user] = {x, y}``; the writers are the natural clients (``groups_*``); ``dataset_params``: ``shape``
  (default 1 x s x s when a sample has s*s values) and ``num_classes`` (FEMNIST: 62; default the largest label + 1).

Every problem is one :class:`DataError` (exit 2) naming the key: ``data.dataset`` for a loader's arrays,
``data.root`` for a file's, ``data.dataset_params.<name>`` for a parameter.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from raysim.data.arrays import ArrayDataset, LoadedDataset
from raysim.errors import ConfigError, DataError, check_regular

PIXEL_NORM = (0.5, 0.5)  # uint8 pixels -> [-1, 1]
REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("groups_train", "groups_test", "num_classes")
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}


def _array(v, name: str, key: str) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    try:
        return np.asarray(v)
    except Exception as e:
        raise DataError(key, f"{name} is not an array ({type(v).__name__}: {e})") from None


def _images(x: np.ndarray, name: str, key: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DataError(key, f"{name} must hold images N x C x H x W or N x H x W, got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise DataError(key, f"{name} holds no samples")
    if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
        raise DataError(key, f"{name} has dtype {x.dtype}; give uint8 pixels or floating-point values")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataError(key, f"{name} holds NaN or infinite values")
    return x


def _labels(y: np.ndarray, n: int, name: str, key: str) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(key, f"{name} must be a vector of N labels, got shape {tuple(y.shape)}")
    if len(y) != n:
        raise DataError(key, f"{name} has {len(y)} labels for {n} images")
    if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise DataError(key, f"{name} must hold integer class labels, got dtype {y.dtype}")
    return y.astype(np.int64)


def _groups(g, n: int, name: str, key: str) -> np.ndarray:
    g = _array(g, name, key)
    if g.ndim != 1 or len(g) != n:
        raise DataError(key, f"{name} must give one client id per sample ({n}), got shape {tuple(g.shape)}")
    if not (np.issubdtype(g.dtype, np.integer) or g.dtype.kind in "US"):
        raise DataError(key, f"{name} must hold integer or string client ids, got dtype {g.dtype}")
    return g


def dataset_from_mapping(m: Any, name: str, key: str, notes: str = "") -> LoadedDataset:
    """Validate a loader's mapping and turn it into a :class:`LoadedDataset` (errors name ``key``)."""
    if isinstance(m, np.lib.npyio.NpzFile):
        m = {k: m[k] for k in m.files}
    if not hasattr(m, "keys") or not hasattr(m, "__getitem__"):
        raise DataError(key, f"{name} must give a mapping with {', '.join(REQUIRED)}, got {type(m).__name__}")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise DataError(key, f"{name} gives no {', '.join(missing)} (keys: {', '.join(map(str, m.keys())) or 'none'})")
    unknown = [k for k in m.keys() if k not in REQUIRED + OPTIONAL]
    if unknown:
        raise DataError(key, f"{name} gives unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                             f"{', '.join(REQUIRED + OPTIONAL)}")
    xtr = _images(_array(m["x_train"], "x_train", key), "x_train", key)
    xte = _images(_array(m["x_test"], "x_test", key), "x_test", key)
    ytr = _labels(_array(m["y_train"], "y_train", key), len(xtr), "y_train", key)
    yte = _labels(_array(m["y_test"], "y_test", key), len(xte), "y_test", key)
    if xtr.shape[1:] != xte.shape[1:]:
        raise DataError(key, f"train/test image-size mismatch: x_train images are {'x'.join(map(str, xtr.shape[1:]))}, "
                             f"x_test images {'x'.join(map(str, xte.shape[1:]))}")
    if (xtr.dtype == np.uint8) != (xte.dtype == np.uint8):
        raise DataError(key, f"x_train is {xtr.dtype} but x_test {xte.dtype}: give both as uint8 pixels or both as floats")
    num_classes = _num_classes(m, ytr, yte, key)
    groups = _natural_groups(m, len(ytr), len(yte), key)

    def make(x, y):
        # a fresh C-order copy: canonical strides (an N x 1 x H x W view may carry strides that make torch pick a
        # channels-last kernel, whose sums differ in the last bits)
        if x.dtype == np.uint8:
            xf = (x.astype(np.float32) / 255.0 - PIXEL_NORM[0]) / PIXEL_NORM[1]
            return ArrayDataset(torch.from_numpy(np.array(xf, order="C")), torch.from_numpy(y), num_classes, PIXEL_NORM)
        return ArrayDataset(torch.from_numpy(np.array(x, dtype=np.float32, order="C")), torch.from_numpy(y.copy()),
                            num_classes)

    train, test = make(xtr, ytr), make(xte, yte)
    test.provenance = "test"
    return LoadedDataset(name, train, test, tuple(xtr.shape[1:]), num_classes,
                         f"{notes or name}: {len(ytr)} train / {len(yte)} test images of "
                         f"{'x'.join(map(str, xtr.shape[1:]))}, {num_classes} classes", groups)


def _num_classes(m, ytr: np.ndarray, yte: np.ndarray, key: str) -> int:
    """The mapping's ``num_classes`` (default: the largest label + 1), checked against the labels (at least 2)."""
    lo = min(int(ytr.min()), int(yte.min()) if len(yte) else 0)
    hi = max(int(ytr.max()), int(yte.max()) if len(yte) else 0)
    if "num_classes" in m and m["num_classes"] is not None:
        c = _array(m["num_classes"], "num_classes", key)
        if c.size != 1 or not np.issubdtype(c.dtype, np.integer) or int(c) <= 0:
            raise DataError(key, f"num_classes must be a positive integer, got {m['num_classes']!r}")
        num_classes = int(c)
    else:
        num_classes = hi + 1
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise DataError(key, f"label {bad} is outside the classes 0..{num_classes - 1}")
    if num_classes < 2:
        raise DataError(key, f"the labels name {num_classes} class; a classification task needs at least 2")
    return num_classes


def _natural_groups(m, n_train: int, n_test: int, key: str) -> Optional[tuple]:
    """The natural client ids (``groups_train``, ``groups_test``) as (train codes, test codes (-1: an id without
    training samples), the ids as strings), client k holding the k-th sorted id; None without them."""
    if "groups_train" not in m and "groups_test" not in m:
        return None
    if "groups_train" not in m or "groups_test" not in m:
        raise DataError(key, "natural client ids need both groups_train and groups_test")
    gtr = _groups(m["groups_train"], n_train, "groups_train", key)
    gte = _groups(m["groups_test"], n_test, "groups_test", key)
    if (gtr.dtype.kind in "US") != (gte.dtype.kind in "US"):
        raise DataError(key, "groups_train and groups_test must both be integers or both be strings")
    ids = np.unique(gtr)  # sorted: client k holds the k-th id
    code_te = np.searchsorted(ids, gte)
    code_te = np.where((code_te < len(ids)) & (ids[np.minimum(code_te, len(ids) - 1)] == gte), code_te, -1)
    return np.searchsorted(ids, gtr).astype(np.int64), code_te.astype(np.int64), [str(i) for i in ids]


# -- formats ---------------------------------------------------------------------------------------------------------

def _params(params: dict, allowed: tuple, fmt: str) -> dict:
    for k in params:
        if k not in allowed:
            raise DataError(f"data.dataset_params.{k}", f"unknown parameter for {fmt}; allowed: {', '.join(allowed) or 'none'}")
    return dict(params)


def _root(root: Optional[str], what: str) -> Path:
    if not root:
        raise DataError("data.root", f"is required: {what}")
    return Path(root).expanduser()


def load_npz(root: Optional[str], params: dict, key: str = "data.root") -> LoadedDataset:
    _params(params, (), "npz")
    path = _root(root, "the .npz file holding x_train, y_train, x_test, y_test")
    if not path.is_file():
        raise DataError(key, f"{path} is not a file (npz: data.root is the .npz file)")
    _check_unpacked_size(path, key)
    try:
        with np.load(path, allow_pickle=False) as f:
            m = {k: f[k] for k in f.files}
    except Exception as e:
        raise DataError(key, f"cannot read {path} as .npz ({type(e).__name__}: {e})") from None
    return dataset_from_mapping(m, "npz", key, f"npz file {path}")


def _check_unpacked_size(path: Path, key: str) -> None:
    """A ``.npz`` whose arrays unpack to more than half the free memory (a zip bomb: 19 MB on disk, 4.5 GB
    unpacked) is refused from its zip header, before anything is unpacked (as the split-file loader does)."""
    import zipfile

    from raysim.data.arrays import available_memory

    try:
        with zipfile.ZipFile(path) as z:
            size = sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not a zip: numpy's reader names the problem below
    avail = available_memory()
    if avail is not None and size > avail // 2:
        raise DataError(key, f"{path} unpacks to {size:,} bytes, more than half the {avail:,} bytes of free memory "
                             f"(a zip bomb, or data too large for this machine)")


def _size(v) -> Optional[tuple]:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(a, int) and a > 0 for a in v):
        return (int(v[0]), int(v[1]))
    raise DataError("data.dataset_params.size", f"must be a positive integer or [height, width], got {v!r}")


def load_imagefolder(root: Optional[str], params: dict, key: str = "data.root") -> LoadedDataset:
    p = _params(params, ("size", "channels"), "imagefolder")
    size = _size(p.get("size"))
    channels = p.get("channels")
    if channels not in (None, 1, 3):
        raise DataError("data.dataset_params.channels", f"must be 1 or 3, got {channels!r}")
    base = _root(root, "a directory with train/<class>/ and test/<class>/ image folders")
    for split in ("train", "test"):
        if not (base / split).is_dir():
            raise DataError(key, f"{base / split} is not a directory (imagefolder: train/<class>/*.png and "
                                 f"test/<class>/*.png)")
    classes = sorted(d.name for d in (base / "train").iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(classes) < 2:
        raise DataError(key, f"{base / 'train'} holds {len(classes)} class folder(s); at least 2 are needed")
    files = _image_files(base, classes, key)
    opened = _open_images(files, key)
    gray = {"1", "L", "I", "I;16", "F", "LA"}
    if channels is None:
        channels = 1 if all(im.mode in gray for ims in opened.values() for im in ims) else 3
    arrays = _image_arrays(files, opened, channels, size)
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError("data.dataset_params.size", f"train/test image-size mismatch: train images are "
                                                    f"{'x'.join(map(str, arrays['x_train'].shape[2:]))}, test images "
                                                    f"{'x'.join(map(str, arrays['x_test'].shape[2:]))}; set "
                                                    f"data.dataset_params.size to resize both")
    arrays["num_classes"] = len(classes)
    return dataset_from_mapping(arrays, "imagefolder", key,
                                f"imagefolder {base}: classes {', '.join(classes)} (label = index), "
                                f"{len(files['train'])} train / {len(files['test'])} test images, {channels} channel(s)"
                                f"{f', resized to {size[0]}x{size[1]}' if size else ''}")


def _image_files(base: Path, classes: list, key: str) -> dict:
    """{split: [(image file, label)]} of train/<class>/ and test/<class>/, classes and files in sorted order."""
    files: dict = {}
    for split in ("train", "test"):
        folders = sorted(d.name for d in (base / split).iterdir() if d.is_dir() and not d.name.startswith("."))
        for c in folders:
            if c not in classes:
                raise DataError(key, f"{base / split / c} is a class that train/ does not have (labels outside "
                                     f"the classes {', '.join(classes)})")
        items = []
        for c in folders:
            imgs = sorted(f for f in (base / split / c).iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS)
            if not imgs:
                raise DataError(key, f"empty class folder {base / split / c}: no image files "
                                     f"({', '.join(sorted(IMAGE_EXTENSIONS))})")
            items += [(f, classes.index(c)) for f in imgs]
        files[split] = items
    return files


def _open_images(files: dict, key: str) -> dict:
    """{split: the opened images}, every file read now (an unreadable one named)."""
    from PIL import Image

    opened = {}
    for split, items in files.items():
        out = []
        for f, _ in items:
            try:
                check_regular(f)  # a FIFO named like an image would block forever
                im = Image.open(f)
                im.load()
            except Exception as e:
                raise DataError(key, f"cannot read image {f} ({type(e).__name__}: {e})") from None
            out.append(im)
        opened[split] = out
    return opened


def _image_arrays(files: dict, opened: dict, channels: int, size: Optional[tuple]) -> dict:
    """{x_train, y_train, x_test, y_test}: uint8 (N, channels, H, W) pixels (resized to ``size`` when given) and
    the labels; the images of a split must share one size."""
    from PIL import Image

    arrays = {}
    for split, ims in opened.items():
        xs = []
        for (f, _), im in zip(files[split], ims):
            im = im.convert("L" if channels == 1 else "RGB")
            if size is not None:
                im = im.resize((size[1], size[0]), Image.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
            xs.append(a[None] if channels == 1 else a.transpose(2, 0, 1))
        shapes = sorted({x.shape[1:] for x in xs})
        if len(shapes) > 1:
            raise DataError("data.dataset_params.size", f"the {split} images have different sizes "
                                                        f"({', '.join('x'.join(map(str, s)) for s in shapes[:4])}); "
                                                        f"set data.dataset_params.size to resize them")
        arrays[f"x_{split}"] = np.stack(xs)
        arrays[f"y_{split}"] = np.array([c for _, c in files[split]], dtype=np.int64)
    return arrays


def load_leaf(root: Optional[str], params: dict, key: str = "data.root") -> LoadedDataset:
    p = _params(params, ("shape", "num_classes"), "leaf")
    base = _root(root, "LEAF's data directory holding train/*.json and test/*.json")
    parts: dict = {}
    for split in ("train", "test"):
        files = sorted((base / split).glob("*.json")) if (base / split).is_dir() else []
        if not files:
            raise DataError(key, f"no LEAF JSON files in {base / split} (leaf: train/*.json and test/*.json)")
        xs, ys, gs = [], [], []
        for f in files:
            for u, x, y in _leaf_users(f, key):
                xs += x
                ys += y
                gs += [str(u)] * len(y)
        try:
            x = np.asarray(xs, dtype=np.float32)
        except (ValueError, TypeError) as e:
            raise DataError(key, f"the {split} samples of {base} are not equal-length number lists ({e})") from None
        y = np.asarray(ys)
        if y.size and np.issubdtype(y.dtype, np.floating) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        parts[split] = (x, y, np.asarray(gs))
    feat = int(np.prod(parts["train"][0].shape[1:]))
    shape = p.get("shape")
    if shape is None:
        s = int(round(feat ** 0.5))
        if s * s != feat:
            raise DataError("data.dataset_params.shape", f"samples have {feat} values, not a square image; give the "
                                                         f"shape, e.g. [1, {feat}, 1]")
        shape = (1, s, s)
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(a, int) and a > 0 for a in shape)):
        raise DataError("data.dataset_params.shape", f"must be [channels, height, width], got {shape!r}")
    m = {}
    for split, (x, y, g) in parts.items():
        if int(np.prod(x.shape[1:])) != int(np.prod(shape)):
            raise DataError("data.dataset_params.shape", f"{split} samples have {int(np.prod(x.shape[1:]))} values, "
                                                         f"shape {list(shape)} needs {int(np.prod(shape))}")
        m[f"x_{split}"], m[f"y_{split}"], m[f"groups_{split}"] = x.reshape(-1, *shape), y, g
    nc = p.get("num_classes")
    if nc is not None:
        if isinstance(nc, bool) or not isinstance(nc, int) or nc < 2:
            raise DataError("data.dataset_params.num_classes", f"must be an integer >= 2, got {nc!r}")
        m["num_classes"] = nc
    users = len(np.unique(m["groups_train"]))
    return dataset_from_mapping(m, "leaf", key, f"LEAF data {base}: {users} writers (natural clients), "
                                                f"{len(m['y_train'])} train / {len(m['y_test'])} test samples")


def _leaf_users(f: Path, key: str) -> list:
    """[(user, x, y)] of one LEAF JSON file, every value checked by type: ``users`` a list of names, ``user_data`` a
    mapping of each to ``{x: [sample, ...], y: [label, ...]}`` of equal length, a sample a list of numbers (or of
    lists of numbers), a label a number; anything else a DataError naming the file and the user."""
    try:
        check_regular(f)  # a FIFO would block forever
        d = json.loads(f.read_text())
        users, data = d["users"], d["user_data"]
    except Exception as e:
        raise DataError(key, f"{f} is not a LEAF JSON file with users and user_data ({type(e).__name__}: {e})") from None
    if not isinstance(users, list) or not all(isinstance(u, (str, int)) and not isinstance(u, bool) for u in users):
        raise DataError(key, f"{f}: 'users' must be a list of user names, got {type(users).__name__}"
                             f"{'' if not isinstance(users, list) else ' holding ' + _kinds(users)}")
    if not isinstance(data, dict):
        raise DataError(key, f"{f}: 'user_data' must map each user to its x and y, got {type(data).__name__}")
    out = []
    for u in users:
        ud = data.get(u, data.get(str(u)))
        if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
            raise DataError(key, f"{f}: user {u!r} has no x / y in user_data")
        x, y = ud["x"], ud["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise DataError(key, f"{f}: user {u!r}: x and y must be lists, got x {type(x).__name__}, "
                                 f"y {type(y).__name__}")
        if len(x) != len(y):
            raise DataError(key, f"{f}: user {u!r} has {len(x)} samples but {len(y)} labels")
        if not all(_number(v) for v in y):
            raise DataError(key, f"{f}: user {u!r}: every label in y must be a number, found {_kinds(y)}")
        if not all(isinstance(v, list) and all(_number(a) or (isinstance(a, list) and all(map(_number, a)))
                                               for a in v) for v in x):
            raise DataError(key, f"{f}: user {u!r}: every sample in x must be a list of numbers, found {_kinds(x)}")
        out.append((u, x, y))
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kinds(values: list) -> str:
    return ", ".join(sorted({type(v).__name__ for v in values})) or "nothing"


FORMAT_LOADERS: dict[str, Callable] = {"npz": load_npz, "imagefolder": load_imagefolder, "leaf": load_leaf}


def load_user_dataset(loader: Callable, name: str, root: Optional[str], params: dict, key: str) -> LoadedDataset:
    """Call a user loader ``loader(root, **params)`` and validate its mapping (errors name ``key``)."""
    from raysim.config.registry import check_signature

    params_key = "data.dataset_params" if key == "data.dataset" else key.rsplit(".", 1)[0] + ".params"
    check_signature(loader, (root,), params, key, params_key, "loader(root, **data.dataset_params)")
    import contextlib

    from raysim.config import dryrun
    from raysim.config.registry import installed_object

    guard = contextlib.nullcontext() if installed_object(loader) else \
        dryrun.user_code(key, f"the loader {name}")  # a dry run lets no user code write
    try:
        with guard:
            m = loader(root, **params)
    except (ConfigError, DataError):
        raise
    except Exception as e:
        raise DataError(key, f"{name}({root!r}) raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return dataset_from_mapping(m, name, key, f"{name}({root!r})")
