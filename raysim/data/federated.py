"""From a config's data section to per-client data: load, split off a test pool, partition, apply domain shift."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from raysim import rng as rngmod
from raysim.config import DataConfig
from raysim.data.arrays import ArrayDataset, LoadedDataset, Partition, Pools
from raysim.data.datasets import load_dataset
from raysim.data.partition import run_partitioner
from raysim.data.splitfiles import load_split_files
from raysim.data.clients import (ClientData, ClientSet, ClientSource, FederatedData, LazyClients, client_sizes, csr,
                                 encode_exact, rotate)
from raysim.errors import DataError


def split_validation(train_idx: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): ``round(fraction * n)`` of a client's training indices (at least 1, at most n - 1) drawn at
    random as its validation split; both sorted, disjoint, together exactly ``train_idx``."""
    n = len(train_idx)
    if fraction <= 0 or n == 0:
        return train_idx, train_idx[:0]
    k = min(max(1, int(round(fraction * n))), n - 1)
    if k <= 0:
        raise DataError("data.val_fraction", f"a client with {n} training sample(s) cannot hold out a validation split")
    perm = rng.permutation(n)
    return np.sort(train_idx[perm[k:]]), np.sort(train_idx[perm[:k]])


def _split_test_pool(ds: LoadedDataset, fraction: float, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """Hold out ``fraction`` of every class as the test pool (for datasets without a test split)."""
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "test-pool")
    y = ds.train.y.numpy()
    tr, te = [], []
    for c in range(ds.num_classes):
        idx = r.permutation(np.flatnonzero(y == c))
        n_te = int(round(len(idx) * fraction))
        te.append(idx[:n_te])
        tr.append(idx[n_te:])
    return ds.train.subset(np.sort(np.concatenate(tr))), ds.train.subset(np.sort(np.concatenate(te)))


def carve_server_val(pool: ArrayDataset, size: int, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(rest of the pool, server validation set): ``size`` samples of ``pool``, class-stratified (class c gets
    size // C, the first size % C classes one more), drawn with the stream (seed, -, server, "server-val")."""
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "server-val")
    y = pool.y.numpy()
    c_all = pool.num_classes
    take = []
    for c in range(c_all):
        idx = np.flatnonzero(y == c)
        k = size // c_all + (1 if c < size % c_all else 0)
        if k > len(idx):
            raise DataError("data.server_val", f"{size} samples need {k} of class {c}; the training pool holds "
                                               f"{len(idx)}")
        take.append(r.choice(idx, size=k, replace=False) if k else idx[:0])
    val = np.sort(np.concatenate(take))
    rest = np.setdiff1d(np.arange(len(y)), val)
    out = pool.subset(val)
    out.provenance = "server_val"
    return pool.subset(rest), out


def _files_data(cfg: DataConfig, seed: int) -> FederatedData:
    """``data.partition: files``: the clients hold exactly the samples of a reference library's split files."""
    split = load_split_files(dict(cfg.partition_params), cfg.num_clients)
    notes = list(split.notes)
    clients = []
    for i, ((xtr, ytr), (xte, yte)) in enumerate(zip(split.train, split.test)):
        if len(ytr) == 0:
            raise DataError("data.partition_params.root", f"client {i} has no training samples (train/{i}.npz)")
        x_tr, y_tr = torch.as_tensor(xtr, dtype=torch.float32), torch.as_tensor(ytr, dtype=torch.int64)
        x_va = y_va = None
        if cfg.val_fraction > 0:
            keep, va = split_validation(np.arange(len(ytr)), cfg.val_fraction,
                                        rngmod.numpy_rng(seed, rngmod.NO_ROUND, i, "val-split"))
            x_va, y_va = x_tr[va], y_tr[va]
            x_tr, y_tr = x_tr[keep], y_tr[keep]
        x_te, y_te = torch.as_tensor(xte, dtype=torch.float32), torch.as_tensor(yte, dtype=torch.int64)
        if cfg.rotations:
            angle = cfg.rotations[i % len(cfg.rotations)]
            x_tr, x_te = rotate(x_tr, angle), rotate(x_te, angle)
            if x_va is not None:
                x_va = rotate(x_va, angle)
        clients.append(ClientData(i, x_tr, y_tr, x_te, y_te, sorted(set(y_tr.tolist())), split.num_classes,
                                  None, x_val=x_va, y_val=y_va))
    if cfg.val_fraction > 0:
        notes.append(f"validation split: {cfg.val_fraction:g} of each client's training samples held out")
    test = ArrayDataset(torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients]),
                        split.num_classes, provenance="test")
    public = _load_public(cfg.public, seed) if cfg.public else None
    domains = [i % len(cfg.rotations) for i in range(cfg.num_clients)] if cfg.rotations else None
    return FederatedData(clients, split.num_classes, tuple(clients[0].x_train.shape[1:]), test, public, notes,
                         domains)


@dataclass(frozen=True)
class PartitionedPools:
    """The train and test pools and the partitioner's split of them (indices into the pools, per client)."""
    train: ArrayDataset
    test: ArrayDataset
    part: Partition


def _pools(cfg: DataConfig, seed: int, ds: LoadedDataset, notes: list):
    """(train pool, test pool, server validation set or None): the loader's pools, a held-out test pool when the
    dataset has none, and ``data.server_val`` carved from the train pool before partitioning."""
    if ds.test is None:
        train_pool, test_pool = _split_test_pool(ds, cfg.test_fraction, seed)
        notes.append(f"test pool: {cfg.test_fraction:.0%} of each class held out ({len(test_pool)} samples), "
                     f"train pool {len(train_pool)} samples")
    else:
        train_pool, test_pool = ds.train, ds.test
    server_val = None
    if cfg.server_val > 0:
        train_pool, server_val = carve_server_val(train_pool, cfg.server_val, seed)
        notes.append(f"server validation set: {len(server_val)} samples of the training pool (class-stratified, "
                     f"seeded), held by the server and removed before partitioning; train pool {len(train_pool)}")
    return train_pool, test_pool, server_val


def _client_parts(cfg: DataConfig, seed: int, part: Partition) -> tuple[list, list]:
    """Each client's training indices and (``data.val_fraction``) its validation share of them, stream
    (seed, -, client, "val-split")."""
    tr_parts, va_parts = [], []
    for i in range(cfg.num_clients):
        tr_idx = np.asarray(part.train[i], dtype=np.int64)
        if len(tr_idx) == 0:
            raise DataError("data.partition_params", f"client {i} received no training samples")
        if cfg.val_fraction > 0:
            tr_idx, va_idx = split_validation(tr_idx, cfg.val_fraction,
                                              rngmod.numpy_rng(seed, rngmod.NO_ROUND, i, "val-split"))
            if len(tr_idx) == 0:
                raise DataError("data.partition_params", f"client {i} received no training samples")
            va_parts.append(np.asarray(va_idx, dtype=np.int64))
        tr_parts.append(tr_idx)
    return tr_parts, va_parts


def build_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    if cfg.public and not isinstance(cfg.public.get("unused", False), bool):
        raise DataError("data.public.unused", f"true or false; got {cfg.public['unused']!r}")
    unused = bool(cfg.public and cfg.public.get("unused"))  # public samples from the run's own pool (_unused_public)
    if unused and (cfg.partition == "files" or cfg.local_split is not None):
        raise DataError("data.public.unused", "draws from a partitioned dataset's training pool: not with "
                                              "partition: files or data.local_split")
    if unused and cfg.rotations:
        raise DataError("data.rotations", "not with data.public unused: true (the public samples would be unrotated "
                                          "while every client sees its domain's rotation)")
    if cfg.partition == "files":
        return _files_data(cfg, seed)
    ds = load_dataset(cfg.dataset, cfg.root, cfg.dataset_params)
    notes = [ds.notes]
    train_pool, test_pool, server_val = _pools(cfg, seed, ds, notes)
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "partition")
    num_domains, part_domains = _domain_structure(cfg, train_pool, test_pool)
    part = run_partitioner(cfg.partition, dict(cfg.partition_params),
                           Pools(train_pool.y.numpy(), test_pool.y.numpy(), cfg.num_clients, r, ds.num_classes,
                                 domains=part_domains, groups=ds.groups if ds.test is not None else None))
    notes += part.notes
    if cfg.local_split is not None:
        return _local_split_data(cfg, seed, ds, PartitionedPools(train_pool, test_pool, part), notes, num_domains)
    # clients hold uint8 pixels (ClientData.compact) from the start: encode each pool once (when that is exact) and
    # index the encoded pool. Clients are index ranges into the pools (ClientSource): no per-client objects or tensors
    # until a client is used (a population of 100,000 costs a few bytes per client on every process)
    u8 = None
    if train_pool.norm is not None and test_pool.norm == train_pool.norm and not cfg.rotations:
        u8 = (encode_exact(train_pool.x, train_pool.norm), encode_exact(test_pool.x, test_pool.norm))
        u8 = None if any(u is None for u in u8) else u8
    tr_parts, va_parts = _client_parts(cfg, seed, part)
    source = ClientSource(
        cfg.num_clients, u8[0] if u8 else train_pool.x, train_pool.y, u8[1] if u8 else test_pool.x, test_pool.y,
        csr(tr_parts), csr([np.asarray(t, dtype=np.int64) for t in part.test]),
        csr(va_parts) if cfg.val_fraction > 0 else None, ds.num_classes, train_pool.norm, tuple(cfg.rotations or ()))
    clients = LazyClients(source)
    if cfg.val_fraction > 0:
        notes.append(f"validation split: {cfg.val_fraction:g} of each client's training samples held out "
                     f"(stream (seed, -, client, 'val-split')), disjoint from its train and test data")
    if cfg.rotations:
        notes.append(f"rotation domains {list(cfg.rotations)} assigned by client_id % {len(cfg.rotations)}")
    public = None
    if unused:
        public = _unused_public(cfg, seed, train_pool, tr_parts + (va_parts or []))
        notes.append(f"public dataset: {cfg.public['size']} images of {cfg.dataset}'s training pool that no client "
                     f"holds (and not the server's validation set)")
    elif cfg.public:
        public = _load_public(cfg.public, seed)
        notes.append(f"public dataset: {cfg.public}")
    domains = [i % num_domains for i in range(cfg.num_clients)] if num_domains else None
    if train_pool.domain is not None:
        notes.append(f"data sources as domains: client i holds source i % {num_domains}")
    return FederatedData(clients, ds.num_classes, ds.input_shape, test_pool, public, notes, domains, server_val)


def _domain_structure(cfg: DataConfig, train_pool: ArrayDataset, test_pool: ArrayDataset):
    """(number of ground-truth domains or None, what the partitioner gets as ``domains``). Domains are the
    rotations (client i: rotations[i % R]) or a multi-source dataset's sources (client i: source i % S)."""
    params = dict(cfg.partition_params)
    if train_pool.domain is not None:
        if cfg.rotations:
            raise DataError("data.rotations", f"{cfg.dataset} already has one domain per source; remove data.rotations")
        if cfg.partition not in ("domain_dirichlet", "domains"):
            raise DataError("data.partition", f"{cfg.dataset} holds several sources: use partition domain_dirichlet "
                                              f"(client i draws from source i % sources) or domains (client i holds "
                                              f"source i)")
        k = int(train_pool.domain.max()) + 1
        tr_dom, te_dom = train_pool.domain.numpy(), test_pool.domain.numpy()
    elif cfg.rotations:
        k, tr_dom, te_dom = len(cfg.rotations), None, None
    else:
        return None, None
    if cfg.partition == "domains":
        return k, (k, tr_dom, te_dom)
    if cfg.partition != "domain_dirichlet":
        return k, None
    if "num_domains" in params and int(params["num_domains"]) != k:
        raise DataError("data.partition_params.num_domains", f"the data has {k} domains "
                                                             f"({'sources' if tr_dom is not None else 'rotations'}); "
                                                             f"got {params['num_domains']}")
    return k, (k, tr_dom, te_dom)


def local_split_sizes(n: int, split: dict) -> tuple[int, int, int, int]:
    """(private, public, val, test) sample counts of a client with ``n`` samples: ``round(f * n)`` for each named
    share, the private share the rest (at least one sample)."""
    pub, val, test = (int(round(float(split.get(k, 0.0)) * n)) for k in ("public", "val", "test"))
    pri = n - pub - val - test
    if pri <= 0:
        raise DataError("data.local_split", f"a client with {n} samples has no private share left "
                                            f"(public {pub}, val {val}, test {test})")
    return pri, pub, val, test


def _encode_pool(x: torch.Tensor, norm, chunk: int = 1024) -> Optional[torch.Tensor]:
    """``encode_exact`` in chunks (no second full-size float temporary: PACS's pools are GBs), or None."""
    if norm is None:
        return None
    parts = []
    for a in range(0, len(x), chunk):
        u = encode_exact(x[a:a + chunk], norm)
        if u is None:
            return None
        parts.append(u)
    return torch.cat(parts) if parts else x.to(torch.uint8)


def _dataset_shares(cfg: DataConfig, seed: int, pools: PartitionedPools) -> list:
    """``local_split.mode: dataset``: each client's shares from the dataset's own parts — private = its training-pool
    samples outside the dataset's validation split, val = those inside it (``val_mask``), and its test-pool samples
    split at random (stream (seed, -, client, "local-split")) into ``round(public x n)`` public and the rest test.
    Images stay uint8 pixels when the pools encode exactly (the clients are then compact from the start)."""
    train_pool, test_pool, part = pools.train, pools.test, pools.part
    if train_pool.val_mask is None:
        raise DataError("data.local_split.mode", f"{cfg.dataset} has no validation split of its own; mode: dataset "
                                                 f"is for datasets with fixed train/validation/test parts (pacs); "
                                                 f"use mode: random")
    u8_tr = _encode_pool(train_pool.x, train_pool.norm)
    same = test_pool.x.data_ptr() == train_pool.x.data_ptr() and test_pool.x.shape == train_pool.x.shape
    u8_te = (u8_tr if same else _encode_pool(test_pool.x, test_pool.norm)) if u8_tr is not None else None
    if u8_te is None or test_pool.norm != train_pool.norm:
        u8_tr = u8_te = None
    x_tr_pool = train_pool.x if u8_tr is None else u8_tr
    x_te_pool = test_pool.x if u8_te is None else u8_te
    public = float(cfg.local_split.get("public", 0.0))
    vm = train_pool.val_mask.numpy()
    per = []
    for i in range(cfg.num_clients):
        idx, tidx = np.asarray(part.train[i], dtype=np.int64), np.asarray(part.test[i], dtype=np.int64)
        pr, va = idx[~vm[idx]], idx[vm[idx]]
        if len(pr) == 0:
            raise DataError("data.partition", f"client {i} received no private (training-part) samples")
        n_pub = int(round(public * len(tidx)))
        if len(tidx) - n_pub <= 0:
            raise DataError("data.local_split.public", f"client {i} has {len(tidx)} test-part sample(s); a public "
                                                       f"share of {n_pub} leaves none to test on")
        perm = rngmod.numpy_rng(seed, rngmod.NO_ROUND, i, "local-split").permutation(len(tidx))
        pu, te = np.sort(tidx[perm[:n_pub]]), np.sort(tidx[perm[n_pub:]])
        t = lambda k: torch.as_tensor(k, dtype=torch.int64)  # noqa: E731
        per.append({"group": i, "x_tr": torch.cat([x_tr_pool[t(pr)], x_te_pool[t(pu)]]),
                    "y_tr": torch.cat([train_pool.y[t(pr)], test_pool.y[t(pu)]]),
                    "x_te": x_te_pool[t(te)], "y_te": test_pool.y[t(te)],
                    "x_va": x_tr_pool[t(va)], "y_va": train_pool.y[t(va)],
                    "x_pu": x_te_pool[t(pu)], "y_pu": test_pool.y[t(pu)],
                    "sizes": (len(pr), n_pub, len(va), len(te))})
    return per


def _local_split_data(cfg: DataConfig, seed: int, ds: LoadedDataset, pools: PartitionedPools, notes: list,
                      num_domains: Optional[int] = None) -> FederatedData:
    """``data.local_split``: each client's samples (after the partitioner and its rotation) split at random (stream
    (seed, -, client, "local-split")) into private / public / val / test shares, MAFML's D_pri / D_pub / D_val /
    D_test. The client trains on private + its own public share (``x_train``, in sample order); every client's
    public share, in client order, forms the public dataset (``owner`` = the client it came from), which every node
    may read (MAFML's soft labels refer to it by index). Each client also holds all clients' test and validation
    splits with their owners (``cross_test`` / ``cross_val``), for the cross-domain metrics only."""
    split = dict(cfg.local_split)
    by_dataset = split.get("mode", "random") == "dataset"
    per = _dataset_shares(cfg, seed, pools) if by_dataset else _random_shares(cfg, seed, pools)
    clients, public, test = _local_split_clients(per, ds.num_classes, pools.train.norm)
    notes.append(_local_split_note(split, per, len(public), by_dataset))
    if cfg.rotations:
        notes.append(f"rotation domains {list(cfg.rotations)} assigned by client_id % {len(cfg.rotations)}")
    domains = [p["group"] for p in per] if cfg.rotations else None  # ground truth: the driver's, never a client's
    if domains is None and num_domains and cfg.partition == "domains":
        domains = [i % num_domains for i in range(cfg.num_clients)]
    return FederatedData(clients, ds.num_classes, ds.input_shape, test, public, notes, domains)


def _random_shares(cfg: DataConfig, seed: int, pools: PartitionedPools) -> list:
    """``local_split.mode: random``: each client's samples (rotated by its group) split at random (stream
    (seed, -, client, "local-split")) into the private / public / val / test sizes of :func:`local_split_sizes`."""
    split, train_pool, part = dict(cfg.local_split), pools.train, pools.part
    per = []
    for i in range(cfg.num_clients):
        idx = np.asarray(part.train[i])
        if len(idx) == 0:
            raise DataError("data.partition_params", f"client {i} received no samples")
        smp = train_pool.subset(idx)
        group = i % len(cfg.rotations) if cfg.rotations else 0
        x = rotate(smp.x, cfg.rotations[group]) if cfg.rotations else smp.x
        pri, pub, val, test = local_split_sizes(len(idx), split)
        perm = rngmod.numpy_rng(seed, rngmod.NO_ROUND, i, "local-split").permutation(len(idx))
        te, va, pu = (np.sort(perm[a:b]) for a, b in ((0, test), (test, test + val), (test + val, test + val + pub)))
        pr = np.sort(perm[test + val + pub:])
        tr = np.sort(np.concatenate([pr, pu]))
        t = lambda k: torch.as_tensor(k, dtype=torch.int64)  # noqa: E731
        per.append({"group": group, "x_tr": x[t(tr)], "y_tr": smp.y[t(tr)], "x_te": x[t(te)], "y_te": smp.y[t(te)],
                    "x_va": x[t(va)], "y_va": smp.y[t(va)], "x_pu": x[t(pu)], "y_pu": smp.y[t(pu)],
                    "sizes": (pri, pub, val, test)})
    return per


def _local_split_clients(per: list, num_classes: int, norm) -> tuple[list, ArrayDataset, ArrayDataset]:
    """(the clients, the public dataset, the global test set) from the clients' shares ``per``: every client holds
    all clients' test and validation splits with their owners (``cross_test`` / ``cross_val``)."""

    def floats(x):  # uint8 pixels (mode: dataset) decoded for what every node reads as floats
        return x if x.dtype != torch.uint8 else (x.to(dtype=torch.float32) / 255.0 - norm[0]) / norm[1]

    def cross(kx, ky):
        return (floats(torch.cat([p[kx] for p in per])), torch.cat([p[ky] for p in per]),
                torch.cat([torch.full((len(p[ky]),), i, dtype=torch.int64) for i, p in enumerate(per)]))

    cross_test, cross_val = cross("x_te", "y_te"), cross("x_va", "y_va")
    clients = []
    for i, p in enumerate(per):
        clients.append(ClientData(i, p["x_tr"], p["y_tr"], p["x_te"], p["y_te"], sorted(set(p["y_tr"].tolist())),
                                  num_classes, norm, x_val=p["x_va"], y_val=p["y_va"],
                                  cross_test=cross_test, cross_val=cross_val))
    public = ArrayDataset(floats(torch.cat([p["x_pu"] for p in per])), torch.cat([p["y_pu"] for p in per]), num_classes,
                          provenance="public", owner=torch.cat([torch.full((len(p["y_pu"]),), i, dtype=torch.int64)
                                                                for i, p in enumerate(per)]))
    test = ArrayDataset(cross_test[0], cross_test[1], num_classes, provenance="test")
    return clients, public, test


def _local_split_note(split: dict, per: list, public_size: int, by_dataset: bool) -> str:
    if by_dataset:
        return (f"local split {split}: per client private = its training part, val = its validation part, "
                f"public = {split.get('public', 0.0):g} of its test part (stream (seed, -, client, "
                f"'local-split')), test = the rest; private/public/val/test sizes per client "
                f"{[p['sizes'] for p in per]}; clients train on private + own public; the public shares of all "
                f"clients form the public dataset ({public_size} samples, owner per sample)")
    sizes = sorted({p["sizes"] for p in per})
    return (f"local split {split} of each client's samples (stream (seed, -, client, 'local-split')): "
            f"private/public/val/test sizes {sizes}; clients train on private + own public; the public "
            f"shares of all clients form the public dataset ({public_size} samples, owner per sample); the "
            f"pool's test split is not used")


def _unused_public(cfg: DataConfig, seed: int, train_pool: ArrayDataset, parts: list) -> ArrayDataset:
    """``data.public: {dataset: <data.dataset>, size: n, unused: true}``: n samples of the run's own training pool that
    no client holds (train or validation part; the server's validation set is carved out of the pool before), drawn
    with the "public" stream: public data of the clients' classes and distribution that no client has seen (seed 004's
    scenario-1 candidates)."""
    spec = cfg.public
    extra = sorted(set(spec) - {"dataset", "size", "unused"})
    if extra:
        raise DataError(f"data.public.{extra[0]}", "not with unused: true (the run's own training pool is used)")
    if spec.get("dataset") != cfg.dataset:
        raise DataError("data.public.unused", f"draws from the run's own dataset ({cfg.dataset}): give exactly "
                                              f"{{dataset: {cfg.dataset}, size: N, unused: true}}")
    used = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])) if parts else np.zeros(0, int)
    free = np.setdiff1d(np.arange(len(train_pool)), used)
    size = spec.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size > len(free):
        raise DataError("data.public.size", f"with unused: true, a whole number from 1 to the {len(free)} training "
                                            f"samples no client holds; got {size!r}")
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "public")
    pub = train_pool.subset(np.sort(r.choice(free, size=size, replace=False)))
    pub.provenance = "public"
    return pub


def _load_public(spec: dict, seed: int) -> ArrayDataset:
    allowed = {"dataset", "size", "root", "params", "unused"}  # unused: false (true: _unused_public)
    for k in spec:
        if k not in allowed:
            raise DataError(f"data.public.{k}", f"unknown key; allowed: {', '.join(sorted(allowed))}")
    if "dataset" not in spec:
        raise DataError("data.public.dataset", "is required")
    ds = load_dataset(spec["dataset"], spec.get("root"), spec.get("params"), key="data.public.dataset")
    size = spec.get("size")
    if size is None:
        ds.train.provenance = "public"
        return ds.train
    if size > len(ds.train):
        raise DataError("data.public.size", f"{size} exceeds the {len(ds.train)} samples of {spec['dataset']}")
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "public")
    pub = ds.train.subset(np.sort(r.choice(len(ds.train), size=size, replace=False)))
    pub.provenance = "public"
    return pub


# the per-client data types live in raysim.data.clients; importable from here as before
__all__ = ["ClientData", "ClientSet", "ClientSource", "FederatedData", "LazyClients", "build_federated_data",
           "carve_server_val", "client_sizes", "encode_exact", "local_split_sizes", "rotate", "split_validation"]
