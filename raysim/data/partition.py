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

from raysim.errors import DataError


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


def _need_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) and not (
            isinstance(value, float) and value.is_integer()):
        raise DataError(_field(name), f"must be a whole number, got {value!r}")
    if value < minimum:
        raise DataError(_field(name), f"must be {'> 0' if minimum == 1 else f'>= {minimum}'}, got {value}")
    return int(value)


def iid(train_y, test_y, num_clients, rng, num_classes, samples_per_client: int | None = None,
        test_per_client: int | None = None, replace: bool = False) -> Partition:
    """Uniformly random, equal-sized shares of the train pool and of the test pool. ``replace``: every client draws
    its samples independently (clients may share samples), for populations larger than the pool; then
    ``test_per_client`` may be 0 (clients without local test data are not evaluated)."""
    n_tr, n_te = len(train_y), len(test_y)
    if replace:
        per = 1 if samples_per_client is None else _need_int("samples_per_client", samples_per_client, 1)
        tper = 0 if test_per_client is None else _need_int("test_per_client", test_per_client, 0)
        if per > n_tr:
            raise DataError(_field("samples_per_client"), f"{per} exceeds the {n_tr} training samples (with replace: "
                                                          f"true each client draws distinct samples from the whole "
                                                          f"pool); at most {n_tr}")
        if tper > n_te:
            raise DataError(_field("test_per_client"), f"{tper} exceeds the {n_te} test samples (with replace: true "
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
        per = _need_int("samples_per_client", samples_per_client, 1)
        if per * num_clients > n_tr:
            raise DataError(_field("samples_per_client"), f"{num_clients} clients x {per} samples = {per * num_clients} "
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
        tper = _need_int("test_per_client", test_per_client, 1)
        if tper * num_clients > n_te:
            raise DataError(_field("test_per_client"), f"{num_clients} clients x {tper} test samples = "
                                                       f"{tper * num_clients} exceed the {n_te} test samples; at most "
                                                       f"{n_te // num_clients} per client fit (or lower "
                                                       f"data.num_clients, or set replace: true)")
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
            raise DataError(_field("test_per_class"), f"class {c} has {len(tidx)} test samples; at most "
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
    min_samples = _need_int("min_samples", min_samples, 0)
    if samples_per_client is not None:
        _need_int("samples_per_client", samples_per_client, 1)
    if test_ratio < 0:
        raise DataError(_field("test_ratio"), f"must be >= 0, got {test_ratio}")
    if num_clients * max(min_samples, 1) > len(train_y):
        raise DataError(_field("min_samples") if min_samples > 1 else "data.num_clients",
                        f"{num_clients} clients x {max(min_samples, 1)} samples (min_samples) = "
                        f"{num_clients * max(min_samples, 1)} exceed the {len(train_y)} training samples; lower "
                        f"min_samples or data.num_clients")
    pools = _by_class(train_y, num_classes, rng)
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
        raise DataError(_field("min_samples"), f"no Dirichlet({alpha}) draw in {max_tries} tries gave every client "
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


def pathological(train_y, test_y, num_clients, rng, num_classes, classes_per_client: int = 2,
                 samples_per_client: int | None = None) -> Partition:
    """Each client holds ``classes_per_client`` classes (client i: classes i*s, i*s+1, ... mod C); a class's samples
    are shared equally among its holders; the test pool likewise."""
    if not 0 < classes_per_client <= num_classes:
        raise DataError(_field("classes_per_client"), f"must be in 1..{num_classes}, got {classes_per_client}")
    if samples_per_client is not None:
        _need_int("samples_per_client", samples_per_client, 1)
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
    _need_int("shots", shots, 1)
    _need_int("stdev", stdev, 0)
    _need_int("test_shots", test_shots, 1)
    start_state = rng.bit_generator.state
    n, k, classes, lo_k, hi_k = _kshot_draws(rng, num_clients, num_classes, ways, shots, stdev, shot_noise)
    if lo_k <= 0:
        raise DataError(_field("shots"), f"shots={shots} with stdev={stdev} gives non-positive shot counts; raise "
                                         f"shots above {stdev - 1} or lower stdev")
    tr_pools, te_pools = _by_class(train_y, num_classes, rng), _by_class(test_y, num_classes, rng)

    need = np.zeros(num_classes, dtype=np.int64)
    holders = np.zeros(num_classes, dtype=np.int64)
    for i in range(num_clients):
        for c in classes[i]:
            need[c] += k[i]
            holders[c] += 1
    short = [c for c in range(num_classes) if need[c] > len(tr_pools[c])]
    if short:
        c = short[0]
        counts = np.bincount(np.asarray(train_y, dtype=np.int64), minlength=num_classes)
        best = _largest_fitting_shots(rng, start_state, counts, num_clients, num_classes, ways, shots, stdev,
                                      shot_noise)
        hint = (f"with this seed at most shots={best} fits" if best else
                "no shots value fits with this seed") if best is not None else "lower shots"
        raise DataError(_field("shots"), f"class {c} is held by {holders[c]} clients needing {need[c]} training samples "
                                         f"but the train pool has {len(tr_pools[c])}; {hint}, or use fewer clients "
                                         f"(data.num_clients) or ways")
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


def _kshot_draws(rng, num_clients, num_classes, ways, shots, stdev, shot_noise):
    """nway_kshot's per-client draws: class counts n_i, shots k_i, classes (in this order, from ``rng``)."""
    lo_n, hi_n = max(2, ways - stdev), min(num_classes, ways + stdev)
    lo_n = min(lo_n, hi_n)
    n = rng.integers(lo_n, hi_n + 1, size=num_clients)
    lo_k, hi_k = (shots - stdev + 1, shots + stdev - 2) if shot_noise == "mnist" else (shots - stdev + 1, shots + stdev)
    if stdev == 0 or hi_k < lo_k:
        lo_k = hi_k = shots
    if lo_k <= 0:
        return n, None, None, lo_k, hi_k
    k = rng.integers(lo_k, hi_k + 1, size=num_clients)
    classes = [sorted(rng.choice(num_classes, size=int(n[i]), replace=False).tolist()) for i in range(num_clients)]
    return n, k, classes, lo_k, hi_k


def _largest_fitting_shots(rng, state, counts, num_clients, num_classes, ways, shots, stdev, shot_noise,
                           budget: int = 200_000):
    """The largest shots < ``shots`` whose draws (replayed from the generator state ``state``) fit the class counts,
    0 when none does, None when checking every value would cost more than ``budget`` client draws."""
    if (shots - 1) * num_clients > budget:
        return None
    for s in range(shots - 1, 0, -1):
        r = np.random.Generator(type(rng.bit_generator)())
        r.bit_generator.state = state
        _, k, classes, lo_k, _ = _kshot_draws(r, num_clients, num_classes, ways, s, stdev, shot_noise)
        if lo_k <= 0:
            continue
        need = np.zeros(num_classes, dtype=np.int64)
        for i in range(num_clients):
            need[classes[i]] += k[i]
        if (need <= counts).all():
            return s
    return 0


def user_label_counts(rng: np.random.Generator, num_classes: int, n: int, alpha: float,
                      classes_per_client=None, max_tries: int = 100) -> np.ndarray:
    """One user's class counts: p_i(y) ~ Dir(alpha) and counts ~ Multinomial(n, p_i). Without ``classes_per_client``
    the Dirichlet is over all C classes. With ``[lo, hi]`` the user first draws m ~ Uniform{lo..hi} classes (uniformly
    without replacement), p_i ~ Dir(alpha * 1_m) over them, and the counts are redrawn until each of the m classes has
    a sample, so the user holds exactly m classes."""
    if classes_per_client is None:
        return rng.multinomial(n, rng.dirichlet(np.full(num_classes, float(alpha))))
    lo, hi = classes_per_client
    m = int(rng.integers(lo, hi + 1))
    held = rng.choice(num_classes, size=m, replace=False)
    for _ in range(max_tries):
        sub = rng.multinomial(n, rng.dirichlet(np.full(m, float(alpha))))
        if (sub > 0).all():
            counts = np.zeros(num_classes, dtype=np.int64)
            counts[held] = sub
            return counts
    raise DataError(_field("classes_per_client"), f"no Dir({alpha:g}) draw in {max_tries} tries gave each of {m} "
                                                  f"classes a sample of {n}; lower classes_per_client or raise alpha")


def _check_classes_per_client(value, num_classes: int, n: int):
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)):
        raise DataError(_field("classes_per_client"), f"must be [lo, hi] (two integers) or null, got {value!r}")
    lo, hi = int(value[0]), int(value[1])
    if not 1 <= lo <= hi <= num_classes:
        raise DataError(_field("classes_per_client"), f"needs 1 <= lo <= hi <= {num_classes} classes, got {value!r}")
    if hi > n:
        raise DataError(_field("classes_per_client"), f"hi ({hi}) exceeds samples_per_client ({n})")
    return lo, hi


def domain_dirichlet(train_y, test_y, num_clients, rng, num_classes, alpha: float = 100.0,
                     samples_per_client: int = 100, test_ratio: float = 1 / 3, num_domains: int = 1,
                     classes_per_client=None, _domains=None) -> Partition:
    """Clustered FL data (IFCA's Rotated MNIST; the PN-ICFL seed's Dir(alpha) label skew). Client i belongs to
    domain ``i % K``. Every domain draws from its own pool -- the whole base set for rotation domains (an image may
    appear in several domains, rotated differently, but never twice within one domain, as IFCA builds Rotated
    MNIST), the domain's source for a multi-source dataset. Each client draws its class distribution
    p_i(y) ~ Dir(alpha * 1_C) (the seed: alpha = 100 ~ IID, alpha = 3 non-IID) and then |D_i| =
    ``samples_per_client`` samples with counts ~ Multinomial(|D_i|, p_i), disjoint from the other clients of its
    domain. Its local test set has its class proportions (``ceil(n_ic * test_ratio)`` per class), disjoint within the
    domain. ``_domains`` (set by build_federated_data): (K, train-pool domain ids or None, test-pool domain ids or
    None); without it ``num_domains`` gives K and every domain pools the whole base set.

    ``classes_per_client: [lo, hi]`` (default null: all C classes) restricts each user's Dirichlet to m ~ U{lo..hi}
    classes of its own (see :func:`user_label_counts`). The PN-ICFL seed (§4.1) says its Dir(alpha = 3) users hold
    "only 3-5 classes" of C = 10; Dir(3) over all 10 classes gives every user 9-10 classes (99 % of 100-sample
    users), so the seed's description is met by alpha = 3 with ``classes_per_client: [3, 5]`` [INFERRED]."""
    if alpha <= 0:
        raise DataError(_field("alpha"), f"must be > 0, got {alpha}")
    if samples_per_client <= 0:
        raise DataError(_field("samples_per_client"), f"must be > 0, got {samples_per_client}")
    if test_ratio < 0:
        raise DataError(_field("test_ratio"), f"must be >= 0, got {test_ratio}")
    k_dom, tr_dom, te_dom = _domains if _domains is not None else (num_domains, None, None)
    if k_dom <= 0:
        raise DataError(_field("num_domains"), f"must be > 0, got {k_dom}")
    cpc = _check_classes_per_client(classes_per_client, num_classes, samples_per_client)
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
            counts = user_label_counts(rng, num_classes, samples_per_client, alpha, cpc)
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
    notes = [f"domain_dirichlet: {k_dom} domain(s), client i in domain i % {k_dom}; p_i(y) ~ Dir({alpha:g})"
             f"{f' over {cpc[0]}-{cpc[1]} classes per client' if cpc else ''}, "
             f"|D_i| = {samples_per_client}, mean {per_client:.1f} classes per client; samples disjoint within a "
             f"domain{', may repeat across domains' if tr_dom is None and k_dom > 1 else ''}"]
    return Partition(train, test, classes, notes)


def domains(train_y, test_y, num_clients, rng, num_classes, _domains=None) -> Partition:
    """One client per domain of a multi-domain dataset (PACS's domains, a multi-source set's sources): client i holds
    every training-pool and every test-pool sample of domain i, nothing drawn at random. With
    ``data.local_split: {mode: dataset}`` the dataset's own parts then give each client its private, validation and
    test data (MAFML's PACS nodes)."""
    if _domains is None or _domains[1] is None:
        raise DataError("data.partition", "domains needs a dataset whose samples carry their domain (pacs, "
                                          "multisource_digits); for rotation domains use shared_base or "
                                          "domain_dirichlet")
    k, tr_dom, te_dom = _domains
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
    "domains": domains,
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
        raise DataError(_field("root"), f"missing {what} file {path}")
    try:
        d = _read_npz_data(path)
        if not isinstance(d, dict) or "x" not in d or "y" not in d:
            raise ValueError("'data' must be a dict with keys x and y")
        x, y = np.asarray(d["x"]), np.asarray(d["y"])
        if x.dtype.hasobject or y.dtype.hasobject or y.ndim != 1 or x.ndim < 1:
            raise ValueError(f"x must be a numeric array and y a 1-d label array (x {x.dtype} {x.shape}, "
                             f"y {y.dtype} {y.shape})")
    except Exception as e:
        raise DamagedFileError(path, read_problem(e), _NPZ_FIX, _field("root")) from None
    if x.shape[0] != y.shape[0]:
        raise DamagedFileError(path, f"{x.shape[0]} samples in x but {y.shape[0]} labels in y", _NPZ_FIX, _field("root"))
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
    from raysim.errors import DamagedFileError, read_problem

    try:
        meta = json.loads(cfg_path.read_text())
    except Exception as e:
        raise DamagedFileError(cfg_path, read_problem(e), _NPZ_FIX, _field("root")) from None
    try:
        n, num_classes = int(meta["num_clients"]), int(meta["num_classes"])
        if n <= 0 or num_classes <= 0:
            raise ValueError("both must be > 0")
    except Exception as e:
        raise DamagedFileError(cfg_path, f"needs integer num_clients and num_classes > 0 ({type(e).__name__}: {e})",
                               _NPZ_FIX, _field("root")) from None
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
