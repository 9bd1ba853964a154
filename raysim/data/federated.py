"""From a config's data section to per-client data: load, split off a test pool, partition, apply domain shift."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from raysim import rng as rngmod
from raysim.config import DataConfig
from raysim.data.arrays import ArrayDataset, LoadedDataset
from raysim.data.datasets import load_dataset
from raysim.data.partition import run_partitioner
from raysim.data.splitfiles import load_split_files
from raysim.errors import DataError


def encode_exact(x: torch.Tensor, norm: tuple) -> Optional[torch.Tensor]:
    """``x`` (normalised floats from uint8 pixels, ``norm`` = (mean, std)) as uint8 pixels, or None when decoding
    (:meth:`ClientData._decode`) would not give back ``x`` bit for bit."""
    mean, std = norm
    u = ((x * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
    back = (u.to(dtype=torch.float32) / 255.0 - mean) / std
    return u if torch.equal(back, x) else None


@dataclass
class ClientData:
    """What one client holds. Raw data never leaves the client runner that hosts it."""

    client_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[int]  # classes present in the client's training data
    num_classes: int = 10
    norm: Optional[tuple] = None  # (mean, std) of the uint8 source: x = (pixel / 255 - mean) / std
    provenance: str = "private"  # a client's data never leaves its runner (tests/test_privacy.py)
    x_val: Optional[torch.Tensor] = None  # validation split (data.val_fraction), carved from the training data;
    y_val: Optional[torch.Tensor] = None  # empty when there is none
    # data.local_split: every client's test (and validation) split, with the owning client of each sample, for the
    # cross-domain metrics bwt / fwt / acc (evaluation only; never trained on): (x, y, owner)
    cross_test: Optional[tuple] = None
    cross_val: Optional[tuple] = None

    def __post_init__(self):
        if self.x_val is None:
            self.x_val = self.x_test[:0]
        if self.y_val is None:
            self.y_val = self.y_test[:0]

    @property
    def has_val(self) -> bool:
        return int(self.y_val.shape[0]) > 0

    def validation_view(self) -> "ClientData":
        """The same client with its validation split in the test fields (what an evaluate function reads)."""
        return ClientData(self.client_id, self.x_train, self.y_train, self.x_val, self.y_val, self.classes,
                          self.num_classes, self.norm, self.provenance, cross_test=self.cross_val)

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.y_train, minlength=self.num_classes)

    def _replace(self, x_train, y_train, x_test, y_test, x_val, y_val) -> "ClientData":
        return ClientData(self.client_id, x_train, y_train, x_test, y_test, self.classes, self.num_classes,
                          self.norm, self.provenance, x_val, y_val, self._cross_to(self.cross_test, x_test.device),
                          self._cross_to(self.cross_val, x_test.device))

    @staticmethod
    def _cross_to(cross, device):
        return None if cross is None else tuple(t.to(device) for t in cross)

    @property
    def is_compact(self) -> bool:
        return self.x_train.dtype == torch.uint8

    def _decode(self, u: torch.Tensor, device) -> torch.Tensor:
        mean, std = self.norm
        return (u.to(device=device, dtype=torch.float32) / 255.0 - mean) / std

    def compact(self) -> "ClientData":
        """The same client with images stored as uint8 pixels (4x smaller), when the source was uint8 and decoding
        gives back exactly the same floats (else unchanged: e.g. after a non-right-angle rotation)."""
        if self.norm is None or self.is_compact:
            return self
        enc = [encode_exact(x, self.norm) for x in (self.x_train, self.x_test, self.x_val)]
        if any(u is None for u in enc):
            return self
        return self._replace(enc[0], self.y_train, enc[1], self.y_test, enc[2], self.y_val)

    def to(self, device) -> "ClientData":
        """The client's data as float tensors on ``device`` (decoded per step when stored compact)."""
        if self.is_compact:
            return self._replace(self._decode(self.x_train, device), self.y_train.to(device),
                                 self._decode(self.x_test, device), self.y_test.to(device),
                                 self._decode(self.x_val, device), self.y_val.to(device))
        if str(device) == "cpu" and (self.cross_test is None or self.cross_test[0].device.type == "cpu"):
            return self
        return self._replace(self.x_train.to(device), self.y_train.to(device), self.x_test.to(device),
                             self.y_test.to(device), self.x_val.to(device), self.y_val.to(device))


def _csr(parts: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-client index arrays as (offsets, indices): client i's are indices[offsets[i]:offsets[i + 1]]."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return offsets, (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))


class ClientSource:
    """Every client as index ranges into the shared train and test pools (and its validation share of the train
    pool); :meth:`make` builds client ``i``'s :class:`ClientData` exactly as an eager build would (the same subsets,
    rotation and compaction). Pickled once per process that hosts clients."""

    def __init__(self, num_clients: int, train_x, train_y, test_x, test_y, train_csr, test_csr, val_csr,
                 num_classes: int, norm, rotations: tuple = ()):
        self.num_clients = int(num_clients)
        self.train_x, self.train_y, self.test_x, self.test_y = train_x, train_y, test_x, test_y
        self.train_csr, self.test_csr, self.val_csr = train_csr, test_csr, val_csr
        self.num_classes, self.norm, self.rotations = num_classes, norm, tuple(rotations)

    @staticmethod
    def _idx(csr, i: int) -> torch.Tensor:
        off, idx = csr
        return torch.from_numpy(idx[off[i]:off[i + 1]].copy())  # arrays from the object store are read-only

    def sizes(self, which: str = "train") -> np.ndarray:
        csr = {"train": self.train_csr, "test": self.test_csr, "val": self.val_csr}[which]
        return np.zeros(self.num_clients, dtype=np.int64) if csr is None else np.diff(csr[0])

    def make(self, i: int) -> ClientData:
        if not 0 <= i < self.num_clients:
            raise IndexError(i)
        tr, te = self._idx(self.train_csr, i), self._idx(self.test_csr, i)
        x_tr, y_tr, x_te, y_te = self.train_x[tr], self.train_y[tr], self.test_x[te], self.test_y[te]
        x_va = y_va = None
        if self.val_csr is not None:
            va = self._idx(self.val_csr, i)
            x_va, y_va = self.train_x[va], self.train_y[va]
        if self.rotations:
            angle = self.rotations[i % len(self.rotations)]
            x_tr, x_te = rotate(x_tr, angle), rotate(x_te, angle)
            if x_va is not None:
                x_va = rotate(x_va, angle)
        classes = sorted(set(y_tr.tolist()))
        return ClientData(i, x_tr, y_tr, x_te, y_te, classes, self.num_classes, self.norm,
                          x_val=x_va, y_val=y_va).compact()

    def classes(self, i: int) -> list[int]:
        return np.unique(self.train_y.numpy()[self.train_csr[1][self.train_csr[0][i]:self.train_csr[0][i + 1]]]).tolist()


class LazyClients(Sequence):
    """All clients of a :class:`ClientSource` as a read-only sequence of :class:`ClientData`, built on access."""

    def __init__(self, source: ClientSource):
        self.source = source

    def __len__(self) -> int:
        return self.source.num_clients

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.source.make(k) for k in range(*i.indices(len(self)))]
        return self.source.make(int(i) + (len(self) if int(i) < 0 else 0))

    def view(self, client_ids=None) -> "ClientSet":
        return ClientSet(self.source, range(len(self)) if client_ids is None else client_ids)


class ClientSet(MutableMapping):
    """The clients one runner hosts, client id -> :class:`ClientData`: ids of a shared :class:`ClientSource` (a bit
    mask, no per-client object until a client is used; the last ``cache`` used are kept built) plus clients adopted
    from other runners (held as given)."""

    def __init__(self, source: ClientSource, client_ids, cache: int = 256):
        self.source = source
        self.mask = np.zeros(source.num_clients, dtype=bool)
        self.mask[np.asarray(list(client_ids) if not isinstance(client_ids, (range, np.ndarray)) else client_ids,
                             dtype=np.int64)] = True
        self.extra: dict = {}
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = int(cache)

    def __getitem__(self, cid):
        cid = int(cid)
        if cid in self.extra:
            return self.extra[cid]
        if not (0 <= cid < len(self.mask) and self.mask[cid]):
            raise KeyError(cid)
        hit = self._cache.get(cid)
        if hit is None:
            hit = self._cache[cid] = self.source.make(cid)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(cid)
        return hit

    def __setitem__(self, cid, data: ClientData) -> None:
        cid = int(cid)
        if 0 <= cid < len(self.mask):
            self.mask[cid] = False
            self._cache.pop(cid, None)
        self.extra[cid] = data

    def __delitem__(self, cid) -> None:
        cid = int(cid)
        if cid in self.extra:
            del self.extra[cid]
        elif 0 <= cid < len(self.mask) and self.mask[cid]:
            self.mask[cid] = False
            self._cache.pop(cid, None)
        else:
            raise KeyError(cid)

    def __contains__(self, cid) -> bool:
        try:
            cid = int(cid)
        except (TypeError, ValueError):
            return False
        return cid in self.extra or (0 <= cid < len(self.mask) and bool(self.mask[cid]))

    def __iter__(self):
        yield from (int(c) for c in np.flatnonzero(self.mask))
        yield from list(self.extra)

    def __len__(self) -> int:
        return int(self.mask.sum()) + len(self.extra)

    def __getstate__(self):
        return {"source": self.source, "mask": self.mask, "extra": self.extra, "_cache_size": self._cache_size}

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._cache = OrderedDict()


def client_sizes(clients, which: str = "train") -> list[int]:
    """Per client, the number of train / test / val samples, without building lazy clients."""
    if isinstance(clients, LazyClients):
        return clients.source.sizes(which).tolist()
    attr = {"train": "y_train", "test": "y_test", "val": "y_val"}[which]
    return [int(getattr(c, attr).shape[0]) for c in clients]


@dataclass
class FederatedData:
    clients: Sequence  # of ClientData: a list, or LazyClients (built on access)
    num_classes: int
    input_shape: tuple
    global_test: ArrayDataset
    public: Optional[ArrayDataset] = None
    notes: list[str] = field(default_factory=list)
    # the ground-truth domain of every client (rotation index or data source), or None. Known to the driver's
    # evaluation (ARI of a method's clustering, raysim.engine.callbacks.ClusterAgreement), never to the algorithm: it is not
    # part of ClientData, so no client_update or aggregate can see it.
    domains: Optional[list[int]] = None
    # data.server_val: the server-held validation set (carved from the training pool before partitioning), or None
    server_val: Optional[ArrayDataset] = None

    def summary(self) -> dict:
        out = {
            "num_clients": len(self.clients),
            "train_sizes": client_sizes(self.clients, "train"),
            "test_sizes": client_sizes(self.clients, "test"),
            "classes": ([self.clients.source.classes(i) for i in range(len(self.clients))]
                        if isinstance(self.clients, LazyClients) else [c.classes for c in self.clients]),
            "domains": self.domains,
            "notes": self.notes,
        }
        val = client_sizes(self.clients, "val")
        if any(v > 0 for v in val):
            out["val_sizes"] = val
        if self.server_val is not None:
            out["server_val"] = {"size": len(self.server_val),
                                 "per_class": torch.bincount(self.server_val.y, minlength=self.num_classes).tolist(),
                                 "source": "training pool, class-stratified, stream (seed, -, server, 'server-val'); "
                                           "removed before partitioning: disjoint from the clients' data and the "
                                           "test set"}
        if self.public is not None and self.public.owner is not None:
            out["public_sizes"] = torch.bincount(self.public.owner, minlength=len(self.clients)).tolist()
        return out


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


def rotate(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate a batch of images clockwise by ``angle`` degrees (exact for multiples of 90)."""
    a = float(angle) % 360
    if a == 0:
        return x
    if a % 90 == 0:
        return torch.rot90(x, k=-int(a // 90), dims=(-2, -1)).contiguous()
    import torchvision.transforms.functional as TF

    return TF.rotate(x, -a, fill=float(x.min()))


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


def build_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    if cfg.partition == "files":
        return _files_data(cfg, seed)
    ds = load_dataset(cfg.dataset, cfg.root, cfg.dataset_params)
    notes = [ds.notes]
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
    r = rngmod.numpy_rng(seed, rngmod.NO_ROUND, rngmod.SERVER, "partition")
    num_domains, part_domains = _domain_structure(cfg, train_pool, test_pool)
    part = run_partitioner(cfg.partition, dict(cfg.partition_params), train_pool.y.numpy(), test_pool.y.numpy(),
                           cfg.num_clients, r, ds.num_classes, domains=part_domains,
                           groups=ds.groups if ds.test is not None else None)
    notes += part.notes
    if cfg.local_split is not None:
        return _local_split_data(cfg, seed, ds, train_pool, part, notes, test_pool, num_domains)
    # clients hold uint8 pixels (ClientData.compact) from the start: encode each pool once (when that is exact) and
    # index the encoded pool. Clients are index ranges into the pools (ClientSource): no per-client objects or tensors
    # until a client is used (a population of 100,000 costs a few bytes per client on every process)
    u8 = None
    if train_pool.norm is not None and test_pool.norm == train_pool.norm and not cfg.rotations:
        u8 = (encode_exact(train_pool.x, train_pool.norm), encode_exact(test_pool.x, test_pool.norm))
        u8 = None if any(u is None for u in u8) else u8
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
    source = ClientSource(
        cfg.num_clients, u8[0] if u8 else train_pool.x, train_pool.y, u8[1] if u8 else test_pool.x, test_pool.y,
        _csr(tr_parts), _csr([np.asarray(t, dtype=np.int64) for t in part.test]),
        _csr(va_parts) if cfg.val_fraction > 0 else None, ds.num_classes, train_pool.norm, tuple(cfg.rotations or ()))
    clients = LazyClients(source)
    if cfg.val_fraction > 0:
        notes.append(f"validation split: {cfg.val_fraction:g} of each client's training samples held out "
                     f"(stream (seed, -, client, 'val-split')), disjoint from its train and test data")
    if cfg.rotations:
        notes.append(f"rotation domains {list(cfg.rotations)} assigned by client_id % {len(cfg.rotations)}")
    public = None
    if cfg.public:
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


def _dataset_shares(cfg: DataConfig, seed: int, train_pool: ArrayDataset, test_pool: ArrayDataset, part) -> list:
    """``local_split.mode: dataset``: each client's shares from the dataset's own parts — private = its training-pool
    samples outside the dataset's validation split, val = those inside it (``val_mask``), and its test-pool samples
    split at random (stream (seed, -, client, "local-split")) into ``round(public x n)`` public and the rest test.
    Images stay uint8 pixels when the pools encode exactly (the clients are then compact from the start)."""
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


def _local_split_data(cfg: DataConfig, seed: int, ds: LoadedDataset, train_pool: ArrayDataset, part,
                      notes: list, test_pool: Optional[ArrayDataset] = None,
                      num_domains: Optional[int] = None) -> FederatedData:
    """``data.local_split``: each client's samples (after the partitioner and its rotation) split at random (stream
    (seed, -, client, "local-split")) into private / public / val / test shares, MAFML's D_pri / D_pub / D_val /
    D_test. The client trains on private + its own public share (``x_train``, in sample order); every client's
    public share, in client order, forms the public dataset (``owner`` = the client it came from), which every node
    may read (MAFML's soft labels refer to it by index). Each client also holds all clients' test and validation
    splits with their owners (``cross_test`` / ``cross_val``), for the cross-domain metrics only."""
    split = dict(cfg.local_split)
    by_dataset = split.get("mode", "random") == "dataset"
    per = _dataset_shares(cfg, seed, train_pool, test_pool, part) if by_dataset else []
    for i in range(0 if by_dataset else cfg.num_clients):
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

    norm = train_pool.norm

    def floats(x):  # uint8 pixels (mode: dataset) decoded for what every node reads as floats
        return x if x.dtype != torch.uint8 else (x.to(dtype=torch.float32) / 255.0 - norm[0]) / norm[1]

    def cross(kx, ky):
        return (floats(torch.cat([p[kx] for p in per])), torch.cat([p[ky] for p in per]),
                torch.cat([torch.full((len(p[ky]),), i, dtype=torch.int64) for i, p in enumerate(per)]))

    cross_test, cross_val = cross("x_te", "y_te"), cross("x_va", "y_va")
    clients = []
    for i, p in enumerate(per):
        clients.append(ClientData(i, p["x_tr"], p["y_tr"], p["x_te"], p["y_te"], sorted(set(p["y_tr"].tolist())),
                                  ds.num_classes, train_pool.norm, x_val=p["x_va"], y_val=p["y_va"],
                                  cross_test=cross_test, cross_val=cross_val))
    public = ArrayDataset(floats(torch.cat([p["x_pu"] for p in per])), torch.cat([p["y_pu"] for p in per]), ds.num_classes,
                          provenance="public", owner=torch.cat([torch.full((len(p["y_pu"]),), i, dtype=torch.int64)
                                                                for i, p in enumerate(per)]))
    test = ArrayDataset(cross_test[0], cross_test[1], ds.num_classes, provenance="test")
    sizes = sorted({p["sizes"] for p in per})
    if by_dataset:
        notes.append(f"local split {split}: per client private = its training part, val = its validation part, "
                     f"public = {split.get('public', 0.0):g} of its test part (stream (seed, -, client, "
                     f"'local-split')), test = the rest; private/public/val/test sizes per client "
                     f"{[p['sizes'] for p in per]}; clients train on private + own public; the public shares of all "
                     f"clients form the public dataset ({len(public)} samples, owner per sample)")
    else:
        notes.append(f"local split {split} of each client's samples (stream (seed, -, client, 'local-split')): "
                     f"private/public/val/test sizes {sizes}; clients train on private + own public; the public "
                     f"shares of all clients form the public dataset ({len(public)} samples, owner per sample); the "
                     f"pool's test split is not used")
    if cfg.rotations:
        notes.append(f"rotation domains {list(cfg.rotations)} assigned by client_id % {len(cfg.rotations)}")
    domains = [p["group"] for p in per] if cfg.rotations else None  # ground truth: the driver's, never a client's
    if domains is None and num_domains and cfg.partition == "domains":
        domains = [i % num_domains for i in range(cfg.num_clients)]
    return FederatedData(clients, ds.num_classes, ds.input_shape, test, public, notes, domains)


def _load_public(spec: dict, seed: int) -> ArrayDataset:
    allowed = {"dataset", "size", "root", "params"}
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
