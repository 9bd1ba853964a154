"""Per-client data: :class:`ClientData` (a client's train / validation / test tensors, compact uint8 pixels when
exact), the population held as index ranges into shared pools (:class:`ClientSource`, :class:`LazyClients`,
:class:`ClientSet`: nothing per client until a client is used), and :class:`FederatedData` (all clients, the public
and server-held sets, the domains only the driver sees)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from raysim.data.arrays import ArrayDataset


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
        # the uint8 pixels travel (4x fewer bytes to a GPU), then become floats where they will be used
        return (u.to(device).to(torch.float32) / 255.0 - mean) / std

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
        return self._replace(self.x_train.to(device), self.y_train.to(device), self.x_test.to(device),
                             self.y_test.to(device), self.x_val.to(device), self.y_val.to(device))


def csr(parts: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-client index arrays as (offsets, indices): client i's are indices[offsets[i]:offsets[i + 1]]."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return offsets, (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))


@dataclass(eq=False)
class ClientSource:
    """Every client as index ranges into the shared train and test pools (and its validation share of the train
    pool); :meth:`make` builds client ``i``'s :class:`ClientData` exactly as an eager build would (the same subsets,
    rotation and compaction). Pickled once per process that hosts clients."""
    num_clients: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    train_csr: tuple  # (offsets, indices), see csr()
    test_csr: tuple
    val_csr: Optional[tuple]
    num_classes: int
    norm: Optional[tuple]
    rotations: tuple = ()

    def __post_init__(self):
        self.num_clients, self.rotations = int(self.num_clients), tuple(self.rotations)

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


def rotate(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate a batch of images clockwise by ``angle`` degrees (exact for multiples of 90)."""
    a = float(angle) % 360
    if a == 0:
        return x
    if a % 90 == 0:
        return torch.rot90(x, k=-int(a // 90), dims=(-2, -1)).contiguous()
    import torchvision.transforms.functional as TF

    return TF.rotate(x, -a, fill=float(x.min()))
