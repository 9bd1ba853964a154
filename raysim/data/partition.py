"""Seeded partitioners: which training and test samples each client holds.

Each partitioner takes the :class:`Pools` (the train-pool and test-pool labels, the number of clients, a numpy
Generator, the number of classes; the domains and natural client ids where the data has them) and its own keyword
parameters (``data.partition_params``, listed by :func:`partition_params`), and returns a :class:`Partition` of index arrays. A partition that needs more samples than the
dataset has raises :class:`DataError` naming the parameter and the largest value that would fit (no silent reuse).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import numpy as np

from raysim.errors import DataError
from raysim.data.arrays import Partition, Pools, by_class, need_int, param_field
from raysim.data.skew import domain_dirichlet, nway_kshot


def iid(pools: Pools, samples_per_client: int | None = None, test_per_client: int | None = None,
        replace: bool = False) -> Partition:
    """Uniformly random, equal-sized shares of the train pool and of the test pool. ``replace``: every client draws
    its samples independently (clients may share samples), for populations larger than the pool; then
    ``test_per_client`` may be 0 (clients without local test data are not evaluated)."""
    train_y, test_y, num_clients, rng, _ = pools
    n_tr, n_te = len(train_y), len(test_y)
    if replace:
        per = 1 if samples_per_client is None else need_int("samples_per_client", samples_per_client, 1)
        tper = 0 if test_per_client is None else need_int("test_per_client", test_per_client, 0)
        if per > n_tr:
            raise DataError(param_field("samples_per_client"), f"{per} exceeds the {n_tr} training samples (with replace: "
                                                          f"true each client draws distinct samples from the whole "
                                                          f"pool); at most {n_tr}")
        if tper > n_te:
            raise DataError(param_field("test_per_client"), f"{tper} exceeds the {n_te} test samples (with replace: true "
                                                       f"each client draws distinct samples from the whole pool); at "
                                                       f"most {n_te}")
        train = [np.sort(rng.choice(n_tr, size=per, replace=False)) for _ in range(num_clients)]
        test = [np.sort(rng.choice(n_te, size=tper, replace=False)) if tper else np.zeros(0, dtype=np.int64)
                for _ in range(num_clients)]
        classes = [sorted(set(train_y[t].tolist())) for t in train]
        return Partition(train, test, classes, [f"iid with replacement: {per} train / {tper} test samples per client, "
                                                f"drawn independently per client"])
    tr = rng.permutation(n_tr)
    te = rng.permutation(n_te)
    if samples_per_client is None:
        per = n_tr // num_clients
        if per == 0:
            raise DataError("data.num_clients", f"{num_clients} clients exceed the {n_tr} training samples (each client "
                                                f"needs at least one); use at most {n_tr} clients, or set "
                                                f"data.partition_params.replace: true (clients may then share samples)")
    else:
        per = need_int("samples_per_client", samples_per_client, 1)
        if per * num_clients > n_tr:
            raise DataError(param_field("samples_per_client"), f"{num_clients} clients x {per} samples = {per * num_clients} "
                                                          f"exceed the {n_tr} training samples; at most "
                                                          f"{n_tr // num_clients} per client fit (or lower "
                                                          f"data.num_clients, or set replace: true)")
    if test_per_client is None:
        tper = n_te // num_clients
        if tper == 0:
            raise DataError("data.num_clients", f"{num_clients} clients exceed the {n_te} test samples (each client "
                                                f"needs at least one); use at most {n_te} clients, or set "
                                                f"data.partition_params.replace: true with test_per_client: 0 (clients "
                                                f"without test data are not evaluated)")
    else:
        tper = need_int("test_per_client", test_per_client, 1)
        if tper * num_clients > n_te:
            raise DataError(param_field("test_per_client"), f"{num_clients} clients x {tper} test samples = "
                                                       f"{tper * num_clients} exceed the {n_te} test samples; at most "
                                                       f"{n_te // num_clients} per client fit (or lower "
                                                       f"data.num_clients, or set replace: true)")
    train = [np.sort(tr[i * per:(i + 1) * per]) for i in range(num_clients)]
    test = [np.sort(te[i * tper:(i + 1) * tper]) for i in range(num_clients)]
    classes = [sorted(set(train_y[t].tolist())) for t in train]
    return Partition(train, test, classes)


def shared_base(pools: Pools, per_class: int = 100, test_per_class: int = 0) -> Partition:
    """Every client holds the same ``per_class`` samples of each class (drawn once from the train pool): the base
    set of domain-shift benchmarks whose domains differ only by a transform (Rotated MNIST M0/M20/M40/M60 in MAFML's
    seed: 10 x 100 MNIST images, each domain rotated; use with ``data.rotations`` and ``data.local_split``).
    ``test_per_class`` samples of each class from the test pool go to every client too (0: no pool test; the
    ``local_split`` carves each client's test split from its own samples)."""
    train_y, test_y, num_clients, rng, num_classes = pools
    if per_class <= 0 or test_per_class < 0:
        raise DataError(param_field("per_class"), f"must be > 0 (test_per_class >= 0), got {per_class} / {test_per_class}")
    base, tbase = [], []
    for c in range(num_classes):
        idx = np.flatnonzero(train_y == c)
        if len(idx) < per_class:
            raise DataError(param_field("per_class"), f"class {c} has {len(idx)} training samples; at most "
                                                 f"{min(int((train_y == k).sum()) for k in range(num_classes))} fit")
        base.append(rng.choice(idx, size=per_class, replace=False))
        tidx = np.flatnonzero(test_y == c)
        if len(tidx) < test_per_class:
            raise DataError(param_field("test_per_class"), f"class {c} has {len(tidx)} test samples; at most "
                                                      f"{min(int((test_y == k).sum()) for k in range(num_classes))} fit")
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
    pools = by_class(test_y, num_classes, rng)
    offsets = np.zeros(num_classes, dtype=np.int64)
    out = []
    for counts in train_counts:
        idx = []
        for c in np.flatnonzero(counts):
            want = int(np.ceil(counts[c] * test_ratio))
            if offsets[c] + want > len(pools[c]):
                raise DataError(param_field("test_ratio"), f"class {c} needs more test samples than its {len(pools[c])}; "
                                                      f"lower test_ratio (now {test_ratio}) or samples_per_client")
            idx.append(pools[c][offsets[c]:offsets[c] + want])
            offsets[c] += want
        out.append(np.sort(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64))
    return out


def dirichlet(pools: Pools, alpha: float = 0.5, min_samples: int = 10, samples_per_client: int | None = None,
              test_ratio: float = 1 / 3, max_tries: int = 1000) -> Partition:
    """Label skew: class c's samples are split over clients by proportions ~ Dir(alpha). PFLlib's "practical"
    setting is alpha = 0.1. ``samples_per_client`` subsamples each client afterwards (scaling to a small machine);
    each local test set has the client's class proportions and ``test_ratio`` x its train size (0.25/0.75 = PFLlib)."""
    train_y, test_y, num_clients, rng, num_classes = pools
    if alpha <= 0:
        raise DataError(param_field("alpha"), f"must be > 0, got {alpha}")
    min_samples = need_int("min_samples", min_samples, 0)
    if samples_per_client is not None:
        need_int("samples_per_client", samples_per_client, 1)
    if test_ratio < 0:
        raise DataError(param_field("test_ratio"), f"must be >= 0, got {test_ratio}")
    if num_clients * max(min_samples, 1) > len(train_y):
        raise DataError(param_field("min_samples") if min_samples > 1 else "data.num_clients",
                        f"{num_clients} clients x {max(min_samples, 1)} samples (min_samples) = "
                        f"{num_clients * max(min_samples, 1)} exceed the {len(train_y)} training samples; lower "
                        f"min_samples or data.num_clients")
    pools = by_class(train_y, num_classes, rng)
    for _ in range(max_tries):
        parts = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(pools[c])).astype(np.int64)[:-1]
            for i, chunk in enumerate(np.split(pools[c], cuts)):
                parts[i].append(chunk)
        train = [np.concatenate(p) for p in parts]
        if min(len(t) for t in train) >= max(min_samples, 1):
            break
    else:
        raise DataError(param_field("min_samples"), f"no Dirichlet({alpha}) draw in {max_tries} tries gave every client "
                                               f">= {min_samples} samples; lower min_samples or raise alpha")
    notes = []
    if samples_per_client is not None:
        train = [rng.permutation(t)[:samples_per_client] for t in train]
        notes.append(f"each client subsampled to at most {samples_per_client} training samples")
    train = [np.sort(t) for t in train]
    counts = np.stack([np.bincount(train_y[t], minlength=num_classes) for t in train])
    test = _proportional_test(counts, test_y, rng, num_classes, test_ratio)
    classes = [np.flatnonzero(c).tolist() for c in counts]
    return Partition(train, test, classes, notes)


def pathological(pools: Pools, classes_per_client: int = 2, samples_per_client: int | None = None) -> Partition:
    """Each client holds ``classes_per_client`` classes (client i: classes i*s, i*s+1, ... mod C); a class's samples
    are shared equally among its holders; the test pool likewise."""
    train_y, test_y, num_clients, rng, num_classes = pools
    if not 0 < classes_per_client <= num_classes:
        raise DataError(param_field("classes_per_client"), f"must be in 1..{num_classes}, got {classes_per_client}")
    if samples_per_client is not None:
        need_int("samples_per_client", samples_per_client, 1)
    classes = [sorted({(i * classes_per_client + j) % num_classes for j in range(classes_per_client)}) for i in range(num_clients)]
    holders = [[i for i in range(num_clients) if c in classes[i]] for c in range(num_classes)]
    tr_pools, te_pools = by_class(train_y, num_classes, rng), by_class(test_y, num_classes, rng)
    train = [[] for _ in range(num_clients)]
    test = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        for pools, out in ((tr_pools, train), (te_pools, test)):
            if holders[c]:
                for i, chunk in zip(holders[c], np.array_split(pools[c], len(holders[c]))):
                    out[i].append(chunk)
    train = [np.concatenate(t) for t in train]
    empty = [i for i, t in enumerate(train) if len(t) == 0]
    if empty:
        c = classes[empty[0]][0]
        raise DataError("data.num_clients", f"client {empty[0]} receives no training samples: class {c} has "
                                            f"{len(tr_pools[c])} for its {len(holders[c])} holders ({num_clients} "
                                            f"clients x {classes_per_client} classes each); lower data.num_clients or "
                                            f"data.partition_params.classes_per_client")
    if samples_per_client is not None:
        train = [rng.permutation(t)[:samples_per_client] for t in train]
    return Partition([np.sort(t) for t in train], [np.sort(np.concatenate(t)) for t in test], classes)


def domains(pools: Pools) -> Partition:
    """One client per domain of a multi-domain dataset (PACS's domains, a multi-source set's sources): client i holds
    every training-pool and every test-pool sample of domain i, nothing drawn at random. With
    ``data.local_split: {mode: dataset}`` the dataset's own parts then give each client its private, validation and
    test data (MAFML's PACS nodes)."""
    train_y, num_clients = pools.train_y, pools.num_clients
    if pools.domains is None or pools.domains[1] is None:
        raise DataError("data.partition", "domains needs a dataset whose samples carry their domain (pacs, "
                                          "multisource_digits); for rotation domains use shared_base or "
                                          "domain_dirichlet")
    k, tr_dom, te_dom = pools.domains
    if num_clients != k:
        raise DataError("data.num_clients", f"partition domains gives one client per domain: the data has {k} "
                                            f"domains, the config asks for {num_clients} clients; set "
                                            f"data.num_clients: {k}")
    train = [np.flatnonzero(np.asarray(tr_dom) == i) for i in range(k)]
    test = [np.flatnonzero(np.asarray(te_dom) == i) for i in range(k)]
    empty = [i for i, t in enumerate(train) if len(t) == 0]
    if empty:
        raise DataError("data.partition", f"domain {empty[0]} has no training samples")
    classes = [sorted(set(train_y[t].tolist())) for t in train]
    return Partition(train, test, classes, [f"domains: client i holds domain i ({k} domains), its whole training "
                                            f"and test pools: {[len(t) for t in train]} / {[len(t) for t in test]}"])


def natural(pools: Pools) -> Partition:
    """The data's own clients (a loader's ``groups_train`` / ``groups_test``, LEAF's writers), kept as given:
    client k holds the samples of the k-th client id (sorted), train and test. With fewer clients than ids, a
    seeded sample of the ids (sorted) is kept."""
    train_y, _, num_clients, rng, _ = pools
    if pools.groups is None:
        raise DataError("data.partition", "natural needs data with natural client ids (groups_train and groups_test "
                                          "from a loader or an npz file, or the leaf format)")
    gtr, gte, ids = pools.groups
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
    "domains": domains,
}


def partition_params(name: str) -> list[str]:
    sig = inspect.signature(PARTITIONERS[name])
    return list(sig.parameters)[1:]  # after the pools: the keyword parameters, data.partition_params


def run_partitioner(name: str, params: dict, pools: Pools) -> Partition:
    """Partitioner ``name`` over ``pools`` with its keyword ``params`` (``data.partition_params``), each checked
    against the partitioner's signature."""
    if name not in PARTITIONERS:
        raise DataError("data.partition", f"{name!r} is not allowed; choose one of: {', '.join(PARTITIONERS)}, files")
    allowed = partition_params(name)
    for key in params:
        if key not in allowed:
            raise DataError(param_field(key), f"unknown parameter for partition {name!r}; allowed: {', '.join(allowed)}")
    try:
        return PARTITIONERS[name](dataclasses.replace(pools, train_y=np.asarray(pools.train_y), test_y=np.asarray(pools.test_y)),
                                  **params)
    except TypeError as e:  # e.g. a list where a number belongs
        raise DataError("data.partition_params", f"bad parameter for partition {name!r}: {e}") from None
