"""Seeded partitioners: which training and test samples each client holds.

Each partitioner takes the train-pool and test-pool labels, the number of clients, a numpy Generator and its own
keyword parameters, and returns a :class:`Partition` of index arrays. A partition that needs more samples than the
dataset has raises :class:`DataError` naming the parameter and the largest value that would fit (no silent reuse).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from raysim.data.datasets import DataError


@dataclass
class Partition:
    train: list[np.ndarray]  # per client: indices into the train pool
    test: list[np.ndarray]  # per client: indices into the test pool (its local test set)
    classes: list[list[int]]  # per client: classes it holds
    notes: list[str] = field(default_factory=list)


def _by_class(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each class, shuffled with ``rng`` (a deterministic function of the seed)."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _field(name: str) -> str:
    return f"data.partition_params.{name}"


def iid(train_y, test_y, num_clients, rng, num_classes, samples_per_client: int | None = None,
        test_per_client: int | None = None, replace: bool = False) -> Partition:
    """Uniformly random, equal-sized shares of the train pool and of the test pool. ``replace``: every client draws
    its samples independently (clients may share samples), for populations larger than the pool; then
    ``test_per_client`` may be 0 (clients without local test data are not evaluated)."""
    if replace:
        per = 1 if samples_per_client is None else samples_per_client
        tper = 0 if test_per_client is None else test_per_client
        if per <= 0 or tper < 0:
            raise DataError(_field("samples_per_client"), f"must be > 0 (test_per_client >= 0), got {per} / {tper}")
        train = [np.sort(rng.choice(len(train_y), size=per, replace=False)) for _ in range(num_clients)]
        test = [np.sort(rng.choice(len(test_y), size=tper, replace=False)) if tper else np.zeros(0, dtype=np.int64)
                for _ in range(num_clients)]
        classes = [sorted(set(train_y[t].tolist())) for t in train]
        return Partition(train, test, classes, [f"iid with replacement: {per} train / {tper} test samples per client, "
                                                f"drawn independently per client"])
    tr = rng.permutation(len(train_y))
    te = rng.permutation(len(test_y))
    per = len(tr) // num_clients if samples_per_client is None else samples_per_client
    if per * num_clients > len(tr) or per <= 0:
        raise DataError(_field("samples_per_client"), f"{num_clients} clients x {per} samples exceed the {len(tr)} training "
                                                      f"samples; at most {len(tr) // num_clients} fit")
    tper = len(te) // num_clients if test_per_client is None else test_per_client
    if tper * num_clients > len(te) or tper <= 0:
        raise DataError(_field("test_per_client"), f"{num_clients} clients x {tper} test samples exceed the {len(te)} "
                                                   f"test samples; at most {len(te) // num_clients} fit")
    train = [np.sort(tr[i * per:(i + 1) * per]) for i in range(num_clients)]
    test = [np.sort(te[i * tper:(i + 1) * tper]) for i in range(num_clients)]
    classes = [sorted(set(train_y[t].tolist())) for t in train]
    return Partition(train, test, classes)


def shared_base(train_y, test_y, num_clients, rng, num_classes, per_class: int = 100,
                test_per_class: int = 0) -> Partition:
    """Every client holds the same ``per_class`` samples of each class (drawn once from the train pool): the base
    set of domain-shift benchmarks whose domains differ only by a transform (Rotated MNIST M0/M20/M40/M60 in MAFML's
    seed: 10 x 100 MNIST images, each domain rotated; use with ``data.rotations`` and ``data.local_split``).
    ``test_per_class`` samples of each class from the test pool go to every client too (0: no pool test; the
    ``local_split`` carves each client's test split from its own samples)."""
    if per_class <= 0 or test_per_class < 0:
        raise DataError(_field("per_class"), f"must be > 0 (test_per_class >= 0), got {per_class} / {test_per_class}")
    base, tbase = [], []
    for c in range(num_classes):
        idx = np.flatnonzero(train_y == c)
        if len(idx) < per_class:
            raise DataError(_field("per_class"), f"class {c} has {len(idx)} training samples; at most "
                                                 f"{min(int((train_y == k).sum()) for k in range(num_classes))} fit")
        base.append(rng.choice(idx, size=per_class, replace=False))
        tidx = np.flatnonzero(test_y == c)
        if len(tidx) < test_per_class:
            raise DataError(_field("test_per_class"), f"class {c} has {len(tidx)} test samples")
        tbase.append(rng.choice(tidx, size=test_per_class, replace=False) if test_per_class else tidx[:0])
    train = np.sort(np.concatenate(base))
    test = np.sort(np.concatenate(tbase)).astype(np.int64)
    classes = sorted(set(train_y[train].tolist()))
    return Partition([train.copy() for _ in range(num_clients)], [test.copy() for _ in range(num_clients)],
                     [list(classes) for _ in range(num_clients)],
                     [f"shared_base: every client holds the same {per_class} samples per class "
                      f"({len(train)} in all; domains differ by data.rotations)"])


def _proportional_test(train_counts: np.ndarray, test_y, rng, num_classes, test_ratio: float) -> list[np.ndarray]:
    """Disjoint local test sets with each client's train class proportions, ``test_ratio`` x its train size."""
    pools = _by_class(test_y, num_classes, rng)
    offsets = np.zeros(num_classes, dtype=np.int64)
    out = []
    for counts in train_counts:
        idx = []
        for c in np.flatnonzero(counts):
            want = int(np.ceil(counts[c] * test_ratio))
            if offsets[c] + want > len(pools[c]):
                raise DataError(_field("test_ratio"), f"class {c} needs more test samples than its {len(pools[c])}; "
                                                      f"lower test_ratio (now {test_ratio}) or samples_per_client")
            idx.append(pools[c][offsets[c]:offsets[c] + want])
            offsets[c] += want
        out.append(np.sort(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64))
    return out


def dirichlet(train_y, test_y, num_clients, rng, num_classes, alpha: float = 0.5, min_samples: int = 10,
              samples_per_client: int | None = None, test_ratio: float = 1 / 3, max_tries: int = 1000) -> Partition:
    """Label skew: class c's samples are split over clients by proportions ~ Dir(alpha). PFLlib's "practical"
    setting is alpha = 0.1. ``samples_per_client`` subsamples each client afterwards (scaling to a small machine);
    each local test set has the client's class proportions and ``test_ratio`` x its train size (0.25/0.75 = PFLlib)."""
    if alpha <= 0:
        raise DataError(_field("alpha"), f"must be > 0, got {alpha}")
    pools = _by_class(train_y, num_classes, rng)
    for _ in range(max_tries):
        parts = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(pools[c])).astype(np.int64)[:-1]
            for i, chunk in enumerate(np.split(pools[c], cuts)):
                parts[i].append(chunk)
        train = [np.concatenate(p) for p in parts]
        if min(len(t) for t in train) >= min_samples:
            break
    else:
        raise DataError(_field("min_samples"), f"no Dirichlet({alpha}) draw in {max_tries} tries gave every client "
                                               f">= {min_samples} samples; lower min_samples or raise alpha")
    notes = []
    if samples_per_client is not None:
        if samples_per_client <= 0:
            raise DataError(_field("samples_per_client"), f"must be > 0, got {samples_per_client}")
        train = [rng.permutation(t)[:samples_per_client] for t in train]
        notes.append(f"each client subsampled to at most {samples_per_client} training samples")
    train = [np.sort(t) for t in train]
    counts = np.stack([np.bincount(train_y[t], minlength=num_classes) for t in train])
    test = _proportional_test(counts, test_y, rng, num_classes, test_ratio)
    classes = [np.flatnonzero(c).tolist() for c in counts]
    return Partition(train, test, classes, notes)


def pathological(train_y, test_y, num_clients, rng, num_classes, classes_per_client: int = 2,
                 samples_per_client: int | None = None) -> Partition:
    """Each client holds ``classes_per_client`` classes (client i: classes i*s, i*s+1, ... mod C); a class's samples
    are shared equally among its holders; the test pool likewise."""
    if not 0 < classes_per_client <= num_classes:
        raise DataError(_field("classes_per_client"), f"must be in 1..{num_classes}, got {classes_per_client}")
    classes = [sorted({(i * classes_per_client + j) % num_classes for j in range(classes_per_client)}) for i in range(num_clients)]
    holders = [[i for i in range(num_clients) if c in classes[i]] for c in range(num_classes)]
    tr_pools, te_pools = _by_class(train_y, num_classes, rng), _by_class(test_y, num_classes, rng)
    train = [[] for _ in range(num_clients)]
    test = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        for pools, out in ((tr_pools, train), (te_pools, test)):
            if holders[c]:
                for i, chunk in zip(holders[c], np.array_split(pools[c], len(holders[c]))):
                    out[i].append(chunk)
    train = [np.concatenate(t) for t in train]
    if samples_per_client is not None:
        train = [rng.permutation(t)[:samples_per_client] for t in train]
    return Partition([np.sort(t) for t in train], [np.sort(np.concatenate(t)) for t in test], classes)


def nway_kshot(train_y, test_y, num_clients, rng, num_classes, ways: int = 3, shots: int = 100, stdev: int = 2,
               test_shots: int = 15, shot_noise: str = "mnist", test_overlap: bool = False) -> Partition:
    """FedProto's split (Tan et al. 2022, official ``lib/sampling.py``).

    Client i holds n_i ~ UniformInt[max(2, ways-stdev), min(C, ways+stdev)] classes chosen at random, and k_i samples
    of each: ``shot_noise="mnist"`` draws k_i from [shots-stdev+1, shots+stdev-2] (the official MNIST code: {99, 100}
    for 100/2), ``"cifar"`` from [shots-stdev+1, shots+stdev]. Train samples are disjoint across clients. The local
    test set holds ``test_shots`` test samples of each held class; disjoint across clients unless ``test_overlap``
    (then each client draws its own, overlapping with other clients' test sets but never with training data).
    """
    if shot_noise not in ("mnist", "cifar"):
        raise DataError(_field("shot_noise"), f"{shot_noise!r} is not allowed; choose one of: mnist, cifar")
    if not 1 <= ways <= num_classes:
        raise DataError(_field("ways"), f"must be in 1..{num_classes}, got {ways}")
    lo_n, hi_n = max(2, ways - stdev), min(num_classes, ways + stdev)
    lo_n = min(lo_n, hi_n)
    n = rng.integers(lo_n, hi_n + 1, size=num_clients)
    lo_k, hi_k = (shots - stdev + 1, shots + stdev - 2) if shot_noise == "mnist" else (shots - stdev + 1, shots + stdev)
    if stdev == 0 or hi_k < lo_k:
        lo_k = hi_k = shots
    if lo_k <= 0:
        raise DataError(_field("shots"), f"shots={shots} with stdev={stdev} gives non-positive shot counts")
    k = rng.integers(lo_k, hi_k + 1, size=num_clients)
    classes = [sorted(rng.choice(num_classes, size=int(n[i]), replace=False).tolist()) for i in range(num_clients)]
    tr_pools, te_pools = _by_class(train_y, num_classes, rng), _by_class(test_y, num_classes, rng)

    need = np.zeros(num_classes, dtype=np.int64)
    holders = np.zeros(num_classes, dtype=np.int64)
    for i in range(num_clients):
        for c in classes[i]:
            need[c] += k[i]
            holders[c] += 1
    short = [c for c in range(num_classes) if need[c] > len(tr_pools[c])]
    if short:
        fit = min(len(tr_pools[c]) // max(1, holders[c]) for c in range(num_classes)) - (hi_k - shots)
        c = short[0]
        raise DataError(_field("shots"), f"class {c} is held by {holders[c]} clients needing {need[c]} training samples "
                                         f"but the train pool has {len(tr_pools[c])}; with this seed at most shots={max(fit, 0)} "
                                         f"fits (or use fewer clients / ways)")
    if not test_overlap:
        tshort = [c for c in range(num_classes) if holders[c] * test_shots > len(te_pools[c])]
        if tshort:
            c = tshort[0]
            fit = min(len(te_pools[c]) // max(1, holders[c]) for c in range(num_classes))
            raise DataError(_field("test_shots"), f"class {c} is held by {holders[c]} clients x {test_shots} test samples "
                                                  f"but the test pool has {len(te_pools[c])}; at most test_shots={fit} fits "
                                                  f"disjointly, or set test_overlap: true")
    elif any(test_shots > len(te_pools[c]) for c in range(num_classes)):
        raise DataError(_field("test_shots"), f"{test_shots} exceeds the smallest class test pool "
                                              f"({min(len(p) for p in te_pools)})")
    tr_off = np.zeros(num_classes, dtype=np.int64)
    te_off = np.zeros(num_classes, dtype=np.int64)
    train, test = [], []
    for i in range(num_clients):
        tr_idx, te_idx = [], []
        for c in classes[i]:
            tr_idx.append(tr_pools[c][tr_off[c]:tr_off[c] + k[i]])
            tr_off[c] += k[i]
            if test_overlap:
                te_idx.append(rng.choice(te_pools[c], size=test_shots, replace=False))
            else:
                te_idx.append(te_pools[c][te_off[c]:te_off[c] + test_shots])
                te_off[c] += test_shots
        train.append(np.sort(np.concatenate(tr_idx)))
        test.append(np.sort(np.concatenate(te_idx)))
    notes = [f"nway_kshot: ways={ways} stdev={stdev} shots={shots} (k_i in [{lo_k},{hi_k}]) test_shots={test_shots}"
             f"{' (test sets may overlap across clients)' if test_overlap else ''}"]
    return Partition(train, test, classes, notes)


def domain_dirichlet(train_y, test_y, num_clients, rng, num_classes, alpha: float = 100.0,
                     samples_per_client: int = 100, test_ratio: float = 1 / 3, num_domains: int = 1,
                     _domains=None) -> Partition:
    """Clustered FL data (IFCA's Rotated MNIST; the PN-ICFL seed's Dir(alpha) label skew). Client i belongs to
    domain ``i % K``. Every domain draws from its own pool -- the whole base set for rotation domains (an image may
    appear in several domains, rotated differently, but never twice within one domain, as IFCA builds Rotated
    MNIST), the domain's source for a multi-source dataset. Each client draws its class distribution
    p_i(y) ~ Dir(alpha * 1_C) (the seed: alpha = 100 ~ IID, alpha = 3 non-IID) and then |D_i| =
    ``samples_per_client`` samples with counts ~ Multinomial(|D_i|, p_i), disjoint from the other clients of its
    domain. Its local test set has its class proportions (``ceil(n_ic * test_ratio)`` per class), disjoint within the
    domain. ``_domains`` (set by build_federated_data): (K, train-pool domain ids or None, test-pool domain ids or
    None); without it ``num_domains`` gives K and every domain pools the whole base set."""
    if alpha <= 0:
        raise DataError(_field("alpha"), f"must be > 0, got {alpha}")
    if samples_per_client <= 0:
        raise DataError(_field("samples_per_client"), f"must be > 0, got {samples_per_client}")
    if test_ratio < 0:
        raise DataError(_field("test_ratio"), f"must be >= 0, got {test_ratio}")
    k_dom, tr_dom, te_dom = _domains if _domains is not None else (num_domains, None, None)
    if k_dom <= 0:
        raise DataError(_field("num_domains"), f"must be > 0, got {k_dom}")
    train = [None] * num_clients
    test = [None] * num_clients
    classes = [None] * num_clients
    for k in range(k_dom):
        in_tr = np.ones(len(train_y), bool) if tr_dom is None else np.asarray(tr_dom) == k
        in_te = np.ones(len(test_y), bool) if te_dom is None else np.asarray(te_dom) == k
        tr_pools = [rng.permutation(np.flatnonzero(in_tr & (train_y == c))) for c in range(num_classes)]
        te_pools = [rng.permutation(np.flatnonzero(in_te & (test_y == c))) for c in range(num_classes)]
        tr_off = np.zeros(num_classes, dtype=np.int64)
        te_off = np.zeros(num_classes, dtype=np.int64)
        for i in range(k, num_clients, k_dom):
            counts = rng.multinomial(samples_per_client, rng.dirichlet(np.full(num_classes, float(alpha))))
            tr_idx, te_idx = [], []
            for c in np.flatnonzero(counts):
                n_c, t_c = int(counts[c]), int(np.ceil(counts[c] * test_ratio))
                if tr_off[c] + n_c > len(tr_pools[c]):
                    raise DataError(_field("samples_per_client"),
                                    f"domain {k}: class {c} has {len(tr_pools[c])} training samples, fewer than its "
                                    f"clients draw ({num_clients // k_dom} clients x {samples_per_client}); lower "
                                    f"samples_per_client or use a larger dataset")
                if te_off[c] + t_c > len(te_pools[c]):
                    raise DataError(_field("test_ratio"), f"domain {k}: class {c} has {len(te_pools[c])} test samples, "
                                                          f"too few for test_ratio {test_ratio}; lower it")
                tr_idx.append(tr_pools[c][tr_off[c]:tr_off[c] + n_c])
                te_idx.append(te_pools[c][te_off[c]:te_off[c] + t_c])
                tr_off[c] += n_c
                te_off[c] += t_c
            train[i] = np.sort(np.concatenate(tr_idx))
            test[i] = np.sort(np.concatenate(te_idx)) if te_idx else np.zeros(0, dtype=np.int64)
            classes[i] = np.flatnonzero(counts).tolist()
    per_client = np.mean([len(c) for c in classes])
    notes = [f"domain_dirichlet: {k_dom} domain(s), client i in domain i % {k_dom}; p_i(y) ~ Dir({alpha:g}), "
             f"|D_i| = {samples_per_client}, mean {per_client:.1f} classes per client; samples disjoint within a "
             f"domain{', may repeat across domains' if tr_dom is None and k_dom > 1 else ''}"]
    return Partition(train, test, classes, notes)


def natural(train_y, test_y, num_clients, rng, num_classes, _groups=None) -> Partition:
    """The data's own clients (a loader's ``groups_train`` / ``groups_test``, LEAF's writers), kept as given:
    client k holds the samples of the k-th client id (sorted), train and test. With fewer clients than ids, a
    seeded sample of the ids (sorted) is kept."""
    if _groups is None:
        raise DataError("data.partition", "natural needs data with natural client ids (groups_train and groups_test "
                                          "from a loader or an npz file, or the leaf format)")
    gtr, gte, ids = _groups
    k = len(ids)
    if num_clients > k:
        raise DataError("data.num_clients", f"the data has {k} natural clients; at most {k}")
    keep = np.arange(k) if num_clients == k else np.sort(rng.choice(k, size=num_clients, replace=False))
    train = [np.flatnonzero(gtr == g) for g in keep]
    test = [np.flatnonzero(gte == g) for g in keep]
    classes = [sorted(set(train_y[t].tolist())) for t in train]
    notes = [f"natural: {num_clients} of the data's {k} clients"
             + (" (all, in id order)" if num_clients == k else " (a seeded sample of ids, in id order)")
             + f", {int(np.mean([len(t) for t in train])):d} train samples per client on average"]
    dropped = int((gte < 0).sum())
    if dropped:
        notes.append(f"natural: {dropped} test samples belong to ids without training samples (unused)")
    return Partition(train, test, classes, notes)


PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "pathological": pathological,
    "nway_kshot": nway_kshot,
    "domain_dirichlet": domain_dirichlet,
    "shared_base": shared_base,
    "natural": natural,
}


# -- splits written by the reference libraries ---------------------------------------------------------------------

FILES_PARAMS = ["root"]


@dataclass
class FileSplit:
    """A PFLlib / HtFLlib split loaded unchanged: per client (x, y) train and test arrays."""

    train: list[tuple[np.ndarray, np.ndarray]]
    test: list[tuple[np.ndarray, np.ndarray]]
    num_classes: int
    notes: list[str] = field(default_factory=list)


def _load_npz(path, what: str) -> tuple[np.ndarray, np.ndarray]:
    from pathlib import Path

    if not Path(path).exists():
        raise DataError(_field("root"), f"missing {what} file {path}")
    try:
        with open(path, "rb") as f:
            d = np.load(f, allow_pickle=True)["data"].tolist()
        x, y = np.asarray(d["x"]), np.asarray(d["y"])
    except DataError:
        raise
    except Exception as e:
        raise DataError(_field("root"), f"cannot read {path} as a PFLlib split file (np.load(f, allow_pickle=True)"
                                        f"['data'] with keys x and y): {type(e).__name__}: {e}") from None
    if x.shape[0] != y.shape[0]:
        raise DataError(_field("root"), f"{path}: {x.shape[0]} samples in x but {y.shape[0]} labels in y")
    return x, y


def load_split_files(params: dict, num_clients: int) -> FileSplit:
    """``data.partition: files``: ``partition_params.root`` holds PFLlib's layout (``config.json`` with
    num_clients and num_classes, ``train/<i>.npz`` and ``test/<i>.npz`` for client i, each with arrays x and y under
    the key ``data``). Loaded as written: no reshuffling, resampling or normalisation."""
    import json
    from pathlib import Path

    for key in params:
        if key not in FILES_PARAMS:
            raise DataError(_field(key), f"unknown parameter for partition 'files'; allowed: {', '.join(FILES_PARAMS)}")
    if "root" not in params:
        raise DataError(_field("root"), "partition 'files' needs the directory of a PFLlib/HtFLlib split")
    root = Path(str(params["root"])).expanduser()
    if not root.is_dir():
        raise DataError(_field("root"), f"{root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise DataError(_field("root"), f"missing {cfg_path} (PFLlib writes num_clients and num_classes there)")
    try:
        meta = json.loads(cfg_path.read_text())
        n, num_classes = int(meta["num_clients"]), int(meta["num_classes"])
    except Exception as e:
        raise DataError(_field("root"), f"{cfg_path} needs integer num_clients and num_classes: {e}") from None
    if n != num_clients:
        raise DataError("data.num_clients", f"the split in {root} has {n} clients (config.json), the config asks for "
                                            f"{num_clients}; set data.num_clients: {n}")
    train = [_load_npz(root / "train" / f"{i}.npz", "training") for i in range(n)]
    test = [_load_npz(root / "test" / f"{i}.npz", "test") for i in range(n)]
    for i, (tr, te) in enumerate(zip(train, test)):
        for what, (x, y) in (("train", tr), ("test", te)):
            if len(y) and (y.min() < 0 or y.max() >= num_classes):
                raise DataError(_field("root"), f"{what}/{i}.npz has labels outside 0..{num_classes - 1}")
    shapes = {tuple(x.shape[1:]) for x, _ in train + test}
    if len(shapes) != 1:
        raise DataError(_field("root"), f"the split's samples have different shapes: {sorted(shapes)}")
    return FileSplit(train, test, num_classes, [f"split loaded unchanged from {root} (PFLlib/HtFLlib layout)"])


def partition_params(name: str) -> list[str]:
    sig = inspect.signature(PARTITIONERS[name])
    return [p for p in list(sig.parameters)[5:] if not p.startswith("_")]


def run_partitioner(name: str, params: dict, train_y, test_y, num_clients, rng, num_classes,
                    domains=None, groups=None) -> Partition:
    """``domains``: (K, train-pool domain ids, test-pool domain ids) for partitioners that take ``_domains``."""
    if name not in PARTITIONERS:
        raise DataError("data.partition", f"{name!r} is not allowed; choose one of: {', '.join(PARTITIONERS)}, files")
    allowed = partition_params(name)
    for key in params:
        if key not in allowed:
            raise DataError(_field(key), f"unknown parameter for partition {name!r}; allowed: {', '.join(allowed)}")
    try:
        sig = inspect.signature(PARTITIONERS[name]).parameters
        extra = {"_domains": domains} if domains is not None and "_domains" in sig else {}
        if "_groups" in sig:
            extra["_groups"] = groups
        return PARTITIONERS[name](np.asarray(train_y), np.asarray(test_y), num_clients, rng, num_classes, **params,
                                  **extra)
    except TypeError as e:  # e.g. a list where a number belongs
        raise DataError("data.partition_params", f"bad parameter for partition {name!r}: {e}") from None
