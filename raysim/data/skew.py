"""Partitioners with structured label skew: FedProto's n-way k-shot (each client ``ways`` classes with about
``shots`` samples each) and PN-ICFL's per-domain Dirichlet label sampling (users of a domain draw their label mix from
Dirichlet(alpha), optionally restricted to ``classes_per_client`` classes, the seed's 3-5). Registered in
:data:`raysim.data.partition.PARTITIONERS`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from raysim.errors import DataError
from raysim.data.arrays import Partition, Pools, by_class, need_int, param_field


@dataclass(frozen=True)
class KShot:
    """nway_kshot's shape: ``ways`` classes per client (+- ``stdev``), about ``shots`` samples of each (the noise of
    ``shot_noise``), ``test_shots`` test samples of each held class (overlapping across clients with
    ``test_overlap``)."""
    ways: int
    shots: int
    stdev: int
    test_shots: int
    shot_noise: str
    test_overlap: bool


def nway_kshot(pools: Pools, ways: int = 3, shots: int = 100, stdev: int = 2, test_shots: int = 15,
               shot_noise: str = "mnist", test_overlap: bool = False) -> Partition:
    """FedProto's split (Tan et al. 2022, official ``lib/sampling.py``).

    Client i holds n_i ~ UniformInt[max(2, ways-stdev), min(C, ways+stdev)] classes chosen at random, and k_i samples
    of each: ``shot_noise="mnist"`` draws k_i from [shots-stdev+1, shots+stdev-2] (the official MNIST code: {99, 100}
    for 100/2), ``"cifar"`` from [shots-stdev+1, shots+stdev]. Train samples are disjoint across clients. The local
    test set holds ``test_shots`` test samples of each held class; disjoint across clients unless ``test_overlap``
    (then each client draws its own, overlapping with other clients' test sets but never with training data).
    """
    train_y, test_y, num_clients, rng, num_classes = pools
    if shot_noise not in ("mnist", "cifar"):
        raise DataError(param_field("shot_noise"), f"{shot_noise!r} is not allowed; choose one of: mnist, cifar")
    if not 1 <= ways <= num_classes:
        raise DataError(param_field("ways"), f"must be in 1..{num_classes}, got {ways}")
    need_int("shots", shots, 1)
    need_int("stdev", stdev, 0)
    need_int("test_shots", test_shots, 1)
    shape = KShot(ways, shots, stdev, test_shots, shot_noise, test_overlap)
    start_state = rng.bit_generator.state
    n, k, classes, lo_k, hi_k = _kshot_draws(rng, num_clients, num_classes, shape)
    if lo_k <= 0:
        raise DataError(param_field("shots"), f"shots={shots} with stdev={stdev} gives non-positive shot counts; raise "
                                         f"shots above {stdev - 1} or lower stdev")
    tr_pools, te_pools = by_class(train_y, num_classes, rng), by_class(test_y, num_classes, rng)
    need = np.zeros(num_classes, dtype=np.int64)
    holders = np.zeros(num_classes, dtype=np.int64)
    for i in range(num_clients):
        for c in classes[i]:
            need[c] += k[i]
            holders[c] += 1
    _check_kshot_train(pools, shape, start_state, need, holders, tr_pools)
    _check_kshot_test(shape, holders, te_pools)
    train, test = _kshot_assign(rng, shape, classes, k, tr_pools, te_pools)
    notes = [f"nway_kshot: ways={ways} stdev={stdev} shots={shots} (k_i in [{lo_k},{hi_k}]) test_shots={test_shots}"
             f"{' (test sets may overlap across clients)' if test_overlap else ''}"]
    return Partition(train, test, classes, notes)


def _check_kshot_train(pools: Pools, shape: KShot, start_state, need, holders, tr_pools) -> None:
    """Refuses a draw whose clients need more training samples of a class than the train pool has, naming the
    largest ``shots`` that fits with this seed (replayed from ``start_state``)."""
    num_classes = pools.num_classes
    short = [c for c in range(num_classes) if need[c] > len(tr_pools[c])]
    if short:
        c = short[0]
        counts = np.bincount(np.asarray(pools.train_y, dtype=np.int64), minlength=num_classes)
        best = _largest_fitting_shots(pools, start_state, counts, shape)
        hint = (f"with this seed at most shots={best} fits" if best else
                "no shots value fits with this seed") if best is not None else "lower shots"
        raise DataError(param_field("shots"), f"class {c} is held by {holders[c]} clients needing {need[c]} training samples "
                                         f"but the train pool has {len(tr_pools[c])}; {hint}, or use fewer clients "
                                         f"(data.num_clients) or ways")


def _check_kshot_test(shape: KShot, holders, te_pools) -> None:
    """Refuses test sets larger than the test pool: disjointly across the holders unless ``test_overlap``."""
    num_classes, test_shots = len(te_pools), shape.test_shots
    if not shape.test_overlap:
        tshort = [c for c in range(num_classes) if holders[c] * test_shots > len(te_pools[c])]
        if tshort:
            c = tshort[0]
            fit = min(len(te_pools[c]) // max(1, holders[c]) for c in range(num_classes))
            raise DataError(param_field("test_shots"), f"class {c} is held by {holders[c]} clients x {test_shots} test samples "
                                                  f"but the test pool has {len(te_pools[c])}; at most test_shots={fit} fits "
                                                  f"disjointly, or set test_overlap: true")
    elif any(test_shots > len(te_pools[c]) for c in range(num_classes)):
        raise DataError(param_field("test_shots"), f"{test_shots} exceeds the smallest class test pool "
                                              f"({min(len(p) for p in te_pools)})")


def _kshot_assign(rng, shape: KShot, classes, k, tr_pools, te_pools) -> tuple[list, list]:
    """Each client's train indices (k_i of each of its classes, disjoint) and test indices (``test_shots`` of each;
    drawn per client with ``test_overlap``), in client order."""
    num_classes, test_shots = len(tr_pools), shape.test_shots
    tr_off = np.zeros(num_classes, dtype=np.int64)
    te_off = np.zeros(num_classes, dtype=np.int64)
    train, test = [], []
    for i in range(len(classes)):
        tr_idx, te_idx = [], []
        for c in classes[i]:
            tr_idx.append(tr_pools[c][tr_off[c]:tr_off[c] + k[i]])
            tr_off[c] += k[i]
            if shape.test_overlap:
                te_idx.append(rng.choice(te_pools[c], size=test_shots, replace=False))
            else:
                te_idx.append(te_pools[c][te_off[c]:te_off[c] + test_shots])
                te_off[c] += test_shots
        train.append(np.sort(np.concatenate(tr_idx)))
        test.append(np.sort(np.concatenate(te_idx)))
    return train, test


def _kshot_draws(rng, num_clients, num_classes, shape: KShot):
    """nway_kshot's per-client draws: class counts n_i, shots k_i, classes (in this order, from ``rng``)."""
    ways, shots, stdev = shape.ways, shape.shots, shape.stdev
    lo_n, hi_n = max(2, ways - stdev), min(num_classes, ways + stdev)
    lo_n = min(lo_n, hi_n)
    n = rng.integers(lo_n, hi_n + 1, size=num_clients)
    lo_k, hi_k = (shots - stdev + 1, shots + stdev - 2) if shape.shot_noise == "mnist" else (shots - stdev + 1, shots + stdev)
    if stdev == 0 or hi_k < lo_k:
        lo_k = hi_k = shots
    if lo_k <= 0:
        return n, None, None, lo_k, hi_k
    k = rng.integers(lo_k, hi_k + 1, size=num_clients)
    classes = [sorted(rng.choice(num_classes, size=int(n[i]), replace=False).tolist()) for i in range(num_clients)]
    return n, k, classes, lo_k, hi_k


def _largest_fitting_shots(pools: Pools, state, counts, shape: KShot, budget: int = 200_000):
    """The largest shots < ``shape.shots`` whose draws (replayed from the generator state ``state``) fit the class
    counts, 0 when none does, None when checking every value would cost more than ``budget`` client draws."""
    num_clients, num_classes = pools.num_clients, pools.num_classes
    if (shape.shots - 1) * num_clients > budget:
        return None
    for s in range(shape.shots - 1, 0, -1):
        r = np.random.Generator(type(pools.rng.bit_generator)())
        r.bit_generator.state = state
        _, k, classes, lo_k, _ = _kshot_draws(r, num_clients, num_classes, replace(shape, shots=s))
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
    raise DataError(param_field("classes_per_client"), f"no Dir({alpha:g}) draw in {max_tries} tries gave each of {m} "
                                                  f"classes a sample of {n}; lower classes_per_client or raise alpha")


def _check_classes_per_client(value, num_classes: int, n: int):
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)):
        raise DataError(param_field("classes_per_client"), f"must be [lo, hi] (two integers) or null, got {value!r}")
    lo, hi = int(value[0]), int(value[1])
    if not 1 <= lo <= hi <= num_classes:
        raise DataError(param_field("classes_per_client"), f"needs 1 <= lo <= hi <= {num_classes} classes, got {value!r}")
    if hi > n:
        raise DataError(param_field("classes_per_client"), f"hi ({hi}) exceeds samples_per_client ({n})")
    return lo, hi


@dataclass(frozen=True)
class UserDraw:
    """How a domain_dirichlet user draws its data: p_i(y) ~ Dir(``alpha``) (over ``classes_per_client`` = (lo, hi)
    classes of its own, or all), |D_i| = ``samples_per_client``, a test set of ``test_ratio`` x each class count."""
    alpha: float
    samples_per_client: int
    test_ratio: float
    classes_per_client: Optional[tuple]


def domain_dirichlet(pools: Pools, alpha: float = 100.0, samples_per_client: int = 100, test_ratio: float = 1 / 3,
                     num_domains: int = 1, classes_per_client=None) -> Partition:
    """Clustered FL data (IFCA's Rotated MNIST; the PN-ICFL seed's Dir(alpha) label skew). Client i belongs to
    domain ``i % K``. Every domain draws from its own pool -- the whole base set for rotation domains (an image may
    appear in several domains, rotated differently, but never twice within one domain, as IFCA builds Rotated
    MNIST), the domain's source for a multi-source dataset. Each client draws its class distribution
    p_i(y) ~ Dir(alpha * 1_C) (the seed: alpha = 100 ~ IID, alpha = 3 non-IID) and then |D_i| =
    ``samples_per_client`` samples with counts ~ Multinomial(|D_i|, p_i), disjoint from the other clients of its
    domain. Its local test set has its class proportions (``ceil(n_ic * test_ratio)`` per class), disjoint within the
    domain. ``pools.domains`` (set by build_federated_data): (K, train-pool domain ids or None, test-pool domain ids
    or None); without it ``num_domains`` gives K and every domain pools the whole base set.

    ``classes_per_client: [lo, hi]`` (default null: all C classes) restricts each user's Dirichlet to m ~ U{lo..hi}
    classes of its own (see :func:`user_label_counts`). The PN-ICFL seed (§4.1) says its Dir(alpha = 3) users hold
    "only 3-5 classes" of C = 10; Dir(3) over all 10 classes gives every user 9-10 classes (99 % of 100-sample
    users), so the seed's description is met by alpha = 3 with ``classes_per_client: [3, 5]`` [INFERRED]."""
    num_clients, num_classes = pools.num_clients, pools.num_classes
    if alpha <= 0:
        raise DataError(param_field("alpha"), f"must be > 0, got {alpha}")
    if samples_per_client <= 0:
        raise DataError(param_field("samples_per_client"), f"must be > 0, got {samples_per_client}")
    if test_ratio < 0:
        raise DataError(param_field("test_ratio"), f"must be >= 0, got {test_ratio}")
    k_dom, tr_dom, te_dom = pools.domains if pools.domains is not None else (num_domains, None, None)
    if k_dom <= 0:
        raise DataError(param_field("num_domains"), f"must be > 0, got {k_dom}")
    cpc = _check_classes_per_client(classes_per_client, num_classes, samples_per_client)
    draw = UserDraw(alpha, samples_per_client, test_ratio, cpc)
    train = [None] * num_clients
    test = [None] * num_clients
    classes = [None] * num_clients
    for k in range(k_dom):
        by_cls = _domain_pools(pools, k, tr_dom, te_dom)
        for i, tr, te, held in _domain_users(pools, (k, k_dom), draw, by_cls):
            train[i], test[i], classes[i] = tr, te, held
    per_client = np.mean([len(c) for c in classes])
    notes = [f"domain_dirichlet: {k_dom} domain(s), client i in domain i % {k_dom}; p_i(y) ~ Dir({alpha:g})"
             f"{f' over {cpc[0]}-{cpc[1]} classes per client' if cpc else ''}, "
             f"|D_i| = {samples_per_client}, mean {per_client:.1f} classes per client; samples disjoint within a "
             f"domain{', may repeat across domains' if tr_dom is None and k_dom > 1 else ''}"]
    return Partition(train, test, classes, notes)


def _domain_pools(pools: Pools, k: int, tr_dom, te_dom) -> tuple[list, list]:
    """Domain ``k``'s train and test pools per class, shuffled (the whole pools when the domains have no ids)."""
    train_y, test_y, _, rng, num_classes = pools
    in_tr = np.ones(len(train_y), bool) if tr_dom is None else np.asarray(tr_dom) == k
    in_te = np.ones(len(test_y), bool) if te_dom is None else np.asarray(te_dom) == k
    tr_pools = [rng.permutation(np.flatnonzero(in_tr & (train_y == c))) for c in range(num_classes)]
    te_pools = [rng.permutation(np.flatnonzero(in_te & (test_y == c))) for c in range(num_classes)]
    return tr_pools, te_pools


def _domain_users(pools: Pools, domain: tuple[int, int], draw: UserDraw, by_cls: tuple[list, list]):
    """(client, train indices, test indices, classes) of each client i of domain k (i % K == k; ``domain`` = (k, K)),
    drawn in client order from the domain's pools ``by_cls``, disjoint within the domain."""
    (k, k_dom), (tr_pools, te_pools) = domain, by_cls
    num_clients, rng, num_classes = pools.num_clients, pools.rng, pools.num_classes
    tr_off = np.zeros(num_classes, dtype=np.int64)
    te_off = np.zeros(num_classes, dtype=np.int64)
    for i in range(k, num_clients, k_dom):
        counts = user_label_counts(rng, num_classes, draw.samples_per_client, draw.alpha, draw.classes_per_client)
        tr_idx, te_idx = [], []
        for c in np.flatnonzero(counts):
            n_c, t_c = int(counts[c]), int(np.ceil(counts[c] * draw.test_ratio))
            if tr_off[c] + n_c > len(tr_pools[c]):
                raise DataError(param_field("samples_per_client"),
                                f"domain {k}: class {c} has {len(tr_pools[c])} training samples, fewer than its "
                                f"clients draw ({num_clients // k_dom} clients x {draw.samples_per_client}); lower "
                                f"samples_per_client or use a larger dataset")
            if te_off[c] + t_c > len(te_pools[c]):
                raise DataError(param_field("test_ratio"), f"domain {k}: class {c} has {len(te_pools[c])} test samples, "
                                                      f"too few for test_ratio {draw.test_ratio}; lower it")
            tr_idx.append(tr_pools[c][tr_off[c]:tr_off[c] + n_c])
            te_idx.append(te_pools[c][te_off[c]:te_off[c] + t_c])
            tr_off[c] += n_c
            te_off[c] += t_c
        yield (i, np.sort(np.concatenate(tr_idx)),
               np.sort(np.concatenate(te_idx)) if te_idx else np.zeros(0, dtype=np.int64), np.flatnonzero(counts).tolist())
