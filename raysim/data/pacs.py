"""PACS (Li et al., ICCV 2017): 9,991 images of 7 object classes in 4 domains (photo, art_painting, cartoon, sketch)
with the release's fixed train / validation ("crossval") / test lists per domain. MAFML's seed 003 (Table 2) makes each
domain a node: the train part its private data, the crossval part its validation data, 10 % of the test part its public
share and the other 90 % its test data (``data.partition: domains`` with ``data.local_split: {mode: dataset,
public: 0.10}``).

Layout read (``data.root`` = the release's top folder)::

    <root>/kfold/<domain>/<class>/<file>.jpg|.png         the images (227 x 227; sketches are .png); <root>/<domain>/...
                                                          is accepted too
    <root>/<domain>_{train,crossval,test}_kfold.txt       one line per image: "<domain>/<class>/<file> <label>", the
                                                          path relative to kfold/, labels 1..7 = dog, elephant,
                                                          giraffe, guitar, horse, house, person (alphabetical)

the split lists in ``<root>`` or in ``<root>/pacs_label``, ``<root>/splits``, ``<root>/labels`` or ``<root>/kfold``
(and, when ``data.root`` is the ``kfold`` folder itself, beside it). There is no fallback without the lists: the seed's
protocol is defined by them, so a plain ``<root>/<domain>/<class>/`` tree alone is a DataError naming ``data.root``
and the places looked in.

``data.dataset_params``:

* ``size`` (default 224, the seed's): every image resized to size x size (PIL bilinear, antialiased), RGB, pixels
  normalised as (p / 255 - 0.5) / 0.5. Decoded once per process into uint8 (9,991 x 3 x 224 x 224 = 1.5 GB; the
  float32 pools the loader hands on are 6.0 GB, the seed protocol's test part sharing the training images' storage);
  ``size: 112`` quarters every figure for small machines.
* ``split``: ``seed`` (default) — the release's lists as the seed uses them. **Caveat**: in the original release each
  domain's ``*_test_kfold.txt`` lists the whole domain (it is the target split of leave-one-domain-out), so its test
  part contains every train and crossval image: the seed's protocol tests each node on images it trained on (Table 2's
  in-domain BWT of 98.6-100 % (ResNet18 rows) says as much). ``disjoint`` — a test part without those images: the test
  list minus the domain's train and crossval images; where nothing is left (the original release) ``holdout`` of the
  domain's train part is held out instead (per class round(holdout x n_c), a fixed stream: part of the dataset's
  definition), removed from the private data. Public / test are then split from that part as in the seed protocol.
* ``holdout`` (default 0.3; ``split: disjoint`` only).
* ``domains`` (default ``[photo, art_painting, cartoon, sketch]``, Table 2's column order): the domains loaded, in
  node order (client i = domains[i]).

The returned :class:`~raysim.data.datasets.LoadedDataset` has ``train`` = every domain's private + validation
images (``domain`` per sample, ``val_mask`` marking the crossval part) and ``test`` = every domain's test part.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from raysim.data.arrays import ArrayDataset, LoadedDataset
from raysim.errors import DamagedFileError, DataError, read_problem

DOMAINS = ("photo", "art_painting", "cartoon", "sketch")  # Table 2's column order: node i = DOMAINS[i]
CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")  # label k + 1 in the split files
PARTS = ("train", "crossval", "test")
NORM = (0.5, 0.5)  # pixels p in [0, 255] -> (p / 255 - 0.5) / 0.5 in [-1, 1]
DEFAULTS = {"size": 224, "split": "seed", "holdout": 0.3, "domains": list(DOMAINS)}
HOLDOUT_SEED = 20230817  # the disjoint split's held-out draw (fixed: part of the dataset's definition)
_LINE = ("a line is '<domain>/<class>/<file> <label>' with the path relative to kfold/ and labels 1..7 = "
         + ", ".join(f"{k + 1} {c}" for k, c in enumerate(CLASSES)))
_FIX = "copy the PACS release's images again (kfold/) and point data.root at it"


def _check_params(params: dict, pkey: str) -> dict:
    for k in params:
        if k not in DEFAULTS:
            raise DataError(f"{pkey}.{k}", f"unknown parameter for pacs; allowed: {', '.join(DEFAULTS)}")
    p = {**DEFAULTS, **params}
    size = p["size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DataError(f"{pkey}.size", f"must be a positive integer (pixels per side; the seed's 224), got {size!r}")
    if p["split"] not in ("seed", "disjoint"):
        raise DataError(f"{pkey}.split", f"{p['split']!r} is not allowed; choose one of: seed, disjoint")
    if "holdout" in params:
        h = params["holdout"]
        if p["split"] != "disjoint":
            raise DataError(f"{pkey}.holdout", "applies to split: disjoint only (the seed's split holds nothing out)")
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 < float(h) < 1.0:
            raise DataError(f"{pkey}.holdout", f"must be a fraction in (0, 1), got {h!r}")
    doms = p["domains"]
    if not isinstance(doms, (list, tuple)) or not doms or not all(isinstance(d, str) for d in doms):
        raise DataError(f"{pkey}.domains", f"must be a list of domain names ({', '.join(DOMAINS)}), got {doms!r}")
    bad = [d for d in doms if d not in DOMAINS]
    if bad:
        raise DataError(f"{pkey}.domains", f"{bad[0]!r} is not a PACS domain; choose from: {', '.join(DOMAINS)}")
    if len(set(doms)) != len(doms):
        raise DataError(f"{pkey}.domains", f"lists a domain twice: {list(doms)}")
    p["domains"] = list(doms)
    return p


def _split_dirs(base: Path) -> list[Path]:
    dirs = [base, base / "pacs_label", base / "splits", base / "labels", base / "kfold"]
    if base.name == "kfold":
        dirs += [base.parent, base.parent / "pacs_label", base.parent / "splits"]
    return dirs


def _find_lists(base: Path, domains: list, key: str) -> Path:
    """The folder holding every ``<domain>_<part>_kfold.txt`` of ``domains``."""
    names = [f"{d}_{part}_kfold.txt" for d in domains for part in PARTS]
    dirs = _split_dirs(base)
    best, best_n = None, 0
    for d in dirs:
        n = sum((d / f).is_file() for f in names)
        if n == len(names):
            return d
        if n > best_n:
            best, best_n = d, n
    looked = ", ".join(str(d) for d in dirs)
    if best is not None:
        missing = [f for f in names if not (best / f).is_file()]
        raise DataError(key, f"PACS split file {best / missing[0]} is missing"
                             + (f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}"
                                f"{', ...' if len(missing) > 4 else ''})" if len(missing) > 1 else "")
                             + f"; the other split files are in {best}. Looked in: {looked}")
    tree = base / "kfold" if (base / "kfold").is_dir() else base
    have_images = any((tree / d).is_dir() for d in domains)
    raise DataError(key, f"no PACS split files (<domain>_train_kfold.txt, _crossval_kfold.txt, _test_kfold.txt) in "
                         f"{looked}" + (f"; the image folders {tree}/<domain>/<class>/ are there, but the seed's "
                                        f"protocol needs the release's fixed train/crossval/test lists (pacs_label/ "
                                        "of the PACS release): copy them beside kfold/" if have_images else
                                        "; data.root should be the PACS release's folder (kfold/ and the split "
                                        "lists)"))


def _read_list(path: Path, domain: str, image_dir: Path, key: str) -> list[tuple[str, int]]:
    """(path relative to kfold/, label 0..6) per line of one split list; one DataError naming the line otherwise."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except Exception as e:
        raise DamagedFileError(path, read_problem(e), "copy the PACS split lists again", key) from None
    out, seen = [], {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue

        def bad(problem: str):
            return DataError(key, f"{path}, line {n}: {problem} ({_LINE}); the line reads {line[:120]!r}")

        fields = line.rsplit(None, 1)
        if len(fields) != 2:
            raise bad("expected a path and a label")
        rel, lab = fields[0].replace("\\", "/"), fields[1]
        if rel.startswith("./"):
            rel = rel[2:]
        if rel.startswith("kfold/"):
            rel = rel[len("kfold/"):]
        parts = rel.split("/")
        if not lab.isdigit() or not 1 <= int(lab) <= len(CLASSES):
            raise bad(f"label {lab!r} is not one of 1..{len(CLASSES)}")
        label = int(lab) - 1
        if len(parts) < 3 or any(p in ("", ".", "..") for p in parts):
            raise bad(f"path {rel!r} is not <domain>/<class>/<file>")
        if parts[0] != domain:
            raise bad(f"path {rel!r} is not in domain {domain} (this is {path.name})")
        if parts[1] not in CLASSES:
            raise bad(f"class folder {parts[1]!r} is not a PACS class")
        if CLASSES.index(parts[1]) != label:
            raise bad(f"label {lab} is {CLASSES[label]}, but the image is in the class folder {parts[1]!r} "
                      f"(label {CLASSES.index(parts[1]) + 1})")
        if rel in seen:
            raise bad(f"{rel} is listed twice (first on line {seen[rel]})")
        if not (image_dir / rel).is_file():
            raise bad(f"the image {image_dir / rel} does not exist")
        seen[rel] = n
        out.append((rel, label))
    if not out:
        raise DataError(key, f"{path} lists no images ({_LINE})")
    return out


@functools.lru_cache(maxsize=1)  # one PACS decode per process (prepare + run, several runs of a reproduction)
def _decode(image_dir: str, files: tuple, size: int, key: str) -> np.ndarray:
    """Every file as uint8 RGB pixels resized to size x size: (N, 3, size, size), read-only."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    out = np.empty((len(files), 3, size, size), dtype=np.uint8)

    def one(k: int) -> None:
        f = Path(image_dir) / files[k]
        try:
            with Image.open(f) as im:
                im = im.convert("RGB")
                if im.size != (size, size):
                    im = im.resize((size, size), Image.BILINEAR)
                out[k] = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
        except Exception as e:
            raise DamagedFileError(f, read_problem(e), _FIX, key) from None

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as ex:  # PIL decodes without the GIL
        list(ex.map(one, range(len(files))))
    out.flags.writeable = False
    return out


def _to_float(u8: np.ndarray, chunk: int = 512) -> torch.Tensor:
    """(p / 255 - 0.5) / 0.5 in float32, in chunks (no second full-size temporary); exactly what
    ``ClientData._decode`` gives for the same pixels, so clients can keep them as uint8."""
    x = torch.empty(u8.shape, dtype=torch.float32)
    for a in range(0, len(u8), chunk):
        u = torch.from_numpy(np.array(u8[a:a + chunk]))
        x[a:a + chunk] = (u.to(dtype=torch.float32) / 255.0 - NORM[0]) / NORM[1]
    return x


def _holdout(items: list, fraction: float, domain_index: int) -> set:
    """round(fraction x n_c) of each class of ``items`` (path, label), drawn with a fixed stream per domain."""
    rng = np.random.default_rng([HOLDOUT_SEED, domain_index])
    labels = np.array([lab for _, lab in items])
    out = set()
    for c in range(len(CLASSES)):
        idx = np.flatnonzero(labels == c)
        k = int(round(fraction * len(idx)))
        if k:
            out.update(items[i][0] for i in rng.choice(idx, size=k, replace=False))
    return out


def load_pacs(root: Optional[str], params: dict, key: str = "data.root") -> LoadedDataset:
    pkey = "data.dataset_params" if key == "data.root" else key.rsplit(".", 1)[0] + ".params"
    p = _check_params(dict(params or {}), pkey)
    if not root:
        raise DataError(key, "pacs needs data.root: the PACS release's folder (kfold/<domain>/<class>/ images and the "
                             "<domain>_{train,crossval,test}_kfold.txt lists); it is never downloaded")
    base = Path(root).expanduser()
    if not base.is_dir():
        raise DataError(key, f"{root} is not a directory (pacs: the PACS release's folder, holding kfold/ and the "
                             f"split lists)")
    domains, size = p["domains"], p["size"]
    lists = _find_lists(base, domains, key)
    image_dir = base / "kfold" if (base / "kfold").is_dir() else base
    train_items, test_items, per_domain = [], [], []
    for di, d in enumerate(domains):
        tr, cv, te = (_read_list(lists / f"{d}_{part}_kfold.txt", d, image_dir, key) for part in PARTS)
        both = {f for f, _ in tr} & {f for f, _ in cv}
        if both:
            raise DataError(key, f"{d}'s train and crossval lists share {len(both)} image(s), e.g. {sorted(both)[0]}: "
                                 f"the validation part must be disjoint from the training part")
        note = ""
        if p["split"] == "disjoint":
            tr, te, note = _disjoint_test(d, (tr, cv, te), p, pkey)
        train_items += [(f, lab, di, False) for f, lab in tr] + [(f, lab, di, True) for f, lab in cv]
        test_items += [(f, lab, di) for f, lab in te]
        per_domain.append(f"{d}: {len(tr)} train / {len(cv)} crossval / {len(te)} test"
                          + (f" ({note})" if note else ""))
    train, test, files, pixels = _pacs_pools(image_dir, train_items, test_items, size, key)
    notes = (f"PACS from {image_dir} (lists in {lists}), split {p['split']}: " + "; ".join(per_domain)
             + f"; {len(files)} distinct images resized to {size}x{size} RGB ({pixels.nbytes / 2**30:.2f} GiB as "
             f"uint8), (p / 255 - 0.5) / 0.5; domain i = {', '.join(domains)}; classes 0..6 = {', '.join(CLASSES)}")
    return LoadedDataset("pacs", train, test, (3, size, size), len(CLASSES), notes)


def _disjoint_test(d: str, parts: tuple, p: dict, pkey: str) -> tuple[list, list, str]:
    """``split: disjoint``: domain ``d``'s test part made disjoint from its train and crossval parts (``parts``):
    the test-list images outside them, or, when there are none, ``holdout`` of each class of the train part.
    Returns (train part, test part, the note)."""
    tr, cv, te = parts
    seen = {f for f, _ in tr} | {f for f, _ in cv}
    rest = [(f, lab) for f, lab in te if f not in seen]
    if rest:
        return tr, rest, f"test part = the {len(rest)} test-list images outside train/crossval"
    held = _holdout(tr, float(p["holdout"]), DOMAINS.index(d))
    te = [(f, lab) for f, lab in tr if f in held]
    tr = [(f, lab) for f, lab in tr if f not in held]
    note = (f"the test list holds no image outside train/crossval: {len(te)} train images "
            f"({p['holdout']:g} per class) held out as the test part")
    if not te or not tr:
        raise DataError(f"{pkey}.holdout", f"{d}: holding out {p['holdout']:g} of its {len(tr) + len(te)} "
                                           f"train images leaves {len(tr)} private and {len(te)} held out; "
                                           f"both must be > 0")
    return tr, te, note


def _pacs_pools(image_dir: Path, train_items: list, test_items: list, size: int, key: str):
    """(train pool, test pool, the distinct files, their uint8 pixels), every distinct file decoded once: the
    training pool first, then test-part files outside it; the test pool is ordered as those files sit there, so when
    it is the training images (the seed's protocol on the original release) it shares their storage instead of
    copying 6 GB."""
    index = {f: k for k, (f, *_rest) in enumerate(train_items)}
    files = [f for f, *_rest in train_items]
    for f, *_rest in test_items:
        if f not in index:
            index[f] = len(files)
            files.append(f)
    test_items.sort(key=lambda t: index[t[0]])
    pixels = _decode(str(image_dir), tuple(files), size, key)
    x = _to_float(pixels)
    n_tr = len(train_items)
    t_idx = np.array([index[f] for f, *_rest in test_items], dtype=np.int64)
    contiguous = len(t_idx) > 0 and np.array_equal(t_idx, np.arange(t_idx[0], t_idx[0] + len(t_idx)))
    x_te = x[int(t_idx[0]):int(t_idx[0]) + len(t_idx)] if contiguous else x[torch.from_numpy(t_idx)]
    train = ArrayDataset(x[:n_tr], torch.tensor([lab for _, lab, _, _ in train_items], dtype=torch.int64), len(CLASSES),
                         NORM, domain=torch.tensor([d for _, _, d, _ in train_items], dtype=torch.int64),
                         val_mask=torch.tensor([v for *_rest, v in train_items], dtype=torch.bool))
    test = ArrayDataset(x_te, torch.tensor([lab for _, lab, _ in test_items], dtype=torch.int64), len(CLASSES), NORM,
                        provenance="test", domain=torch.tensor([d for _, _, d in test_items], dtype=torch.int64))
    return train, test, files, pixels
