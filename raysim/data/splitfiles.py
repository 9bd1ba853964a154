"""Splits written by the reference libraries (PFLlib / HtFLlib: ``train/<i>.npz`` and ``test/<i>.npz`` per client),
loaded unchanged (``data.partition: files``). Pickled object arrays in them may name numpy's own array
reconstruction and nothing else: a split shared between labs is read without running code from it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raysim.errors import DataError
from raysim.data.arrays import param_field


# -- splits written by the reference libraries ---------------------------------------------------------------------

FILES_PARAMS = ["root"]


@dataclass
class FileSplit:
    """A PFLlib / HtFLlib split loaded unchanged: per client (x, y) train and test arrays."""

    train: list[tuple[np.ndarray, np.ndarray]]
    test: list[tuple[np.ndarray, np.ndarray]]
    num_classes: int
    notes: list[str] = field(default_factory=list)


_NPZ_FIX = "regenerate the split with PFLlib/HtFLlib (or copy it again) and point data.partition_params.root at it"
# what a PFLlib split file's pickled object array may name: numpy's own array reconstruction, nothing else (a split
# shared between labs is read without running code from it)
_NUMPY_GLOBALS = {("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
                  ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
                  ("numpy", "ndarray"), ("numpy", "dtype")}


def _restricted_unpickle(fp):
    import pickle

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _NUMPY_GLOBALS:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"refused to load {module}.{name} (a split file holds numpy arrays only)")

    return Unpickler(fp).load()


def _read_npz_data(path) -> dict:
    """The ``data`` entry of a PFLlib ``.npz`` split file (``np.savez_compressed(f, data={'x': x, 'y': y})``), read
    with numpy's own format reader; its pickled object array may only rebuild numpy arrays."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        from raysim.data import datasets

        size = z.getinfo("data.npy").file_size
        avail = datasets.available_memory()
        if avail is not None and size > avail // 2:  # a zip bomb, or a split too large for this machine
            raise ValueError(f"it unpacks to {size:,} bytes, more than half the {avail:,} bytes of free memory")
        with z.open("data.npy") as fp:
            version = np.lib.format.read_magic(fp)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran, dtype = read_header(fp, max_header_size=10000)
            if dtype.hasobject:
                arr = _restricted_unpickle(fp)
            else:
                raise ValueError("'data' is a plain array, not the dict {x, y} PFLlib writes")
    return arr.tolist() if isinstance(arr, np.ndarray) else arr


def _load_npz(path, what: str) -> tuple[np.ndarray, np.ndarray]:
    from pathlib import Path

    from raysim.errors import DamagedFileError, read_problem

    if not Path(path).exists():
        raise DataError(param_field("root"), f"missing {what} file {path}")
    try:
        d = _read_npz_data(path)
        if not isinstance(d, dict) or "x" not in d or "y" not in d:
            raise ValueError("'data' must be a dict with keys x and y")
        x, y = np.asarray(d["x"]), np.asarray(d["y"])
        if x.dtype.hasobject or y.dtype.hasobject or y.ndim != 1 or x.ndim < 1:
            raise ValueError(f"x must be a numeric array and y a 1-d label array (x {x.dtype} {x.shape}, "
                             f"y {y.dtype} {y.shape})")
    except Exception as e:
        raise DamagedFileError(path, read_problem(e), _NPZ_FIX, param_field("root")) from None
    if x.shape[0] != y.shape[0]:
        raise DamagedFileError(path, f"{x.shape[0]} samples in x but {y.shape[0]} labels in y", _NPZ_FIX, param_field("root"))
    return x, y


def load_split_files(params: dict, num_clients: int) -> FileSplit:
    """``data.partition: files``: ``partition_params.root`` holds PFLlib's layout (``config.json`` with
    num_clients and num_classes, ``train/<i>.npz`` and ``test/<i>.npz`` for client i, each with arrays x and y under
    the key ``data``). Loaded as written: no reshuffling, resampling or normalisation."""
    import json
    from pathlib import Path

    for key in params:
        if key not in FILES_PARAMS:
            raise DataError(param_field(key), f"unknown parameter for partition 'files'; allowed: {', '.join(FILES_PARAMS)}")
    if "root" not in params:
        raise DataError(param_field("root"), "partition 'files' needs the directory of a PFLlib/HtFLlib split")
    root = Path(str(params["root"])).expanduser()
    if not root.is_dir():
        raise DataError(param_field("root"), f"{root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise DataError(param_field("root"), f"missing {cfg_path} (PFLlib writes num_clients and num_classes there)")
    from raysim.errors import DamagedFileError, read_problem

    try:
        meta = json.loads(cfg_path.read_text())
    except Exception as e:
        raise DamagedFileError(cfg_path, read_problem(e), _NPZ_FIX, param_field("root")) from None
    try:
        n, num_classes = int(meta["num_clients"]), int(meta["num_classes"])
        if n <= 0 or num_classes <= 0:
            raise ValueError("both must be > 0")
    except Exception as e:
        raise DamagedFileError(cfg_path, f"needs integer num_clients and num_classes > 0 ({type(e).__name__}: {e})",
                               _NPZ_FIX, param_field("root")) from None
    if n != num_clients:
        raise DataError("data.num_clients", f"the split in {root} has {n} clients (config.json), the config asks for "
                                            f"{num_clients}; set data.num_clients: {n}")
    train = [_load_npz(root / "train" / f"{i}.npz", "training") for i in range(n)]
    test = [_load_npz(root / "test" / f"{i}.npz", "test") for i in range(n)]
    for i, (tr, te) in enumerate(zip(train, test)):
        for what, (x, y) in (("train", tr), ("test", te)):
            if len(y) and (y.min() < 0 or y.max() >= num_classes):
                raise DataError(param_field("root"), f"{what}/{i}.npz has labels outside 0..{num_classes - 1}")
    shapes = {tuple(x.shape[1:]) for x, _ in train + test}
    if len(shapes) != 1:
        raise DataError(param_field("root"), f"the split's samples have different shapes: {sorted(shapes)}")
    return FileSplit(train, test, num_classes, [f"split loaded unchanged from {root} (PFLlib/HtFLlib layout)"])
