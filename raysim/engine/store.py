"""Per-client state store: lazily created states, an in-memory budget, least-recently-used spill to disk, and a
commit protocol.

A client runner (one per actor) keeps the states of the clients it hosts here; the server runner keeps server-side
per-client state (a model per client, an embedding per user) in another one. States are picklable trees of tensors.

* ``get(cid)`` returns the **committed** state (from memory, else from disk, else ``None``); ``put_initial`` stores a
  freshly created state as committed (initial states are a pure function of (seed, client), so re-creating one is
  always safe).
* ``stage(cid, state)`` holds a step's new state as **pending**; ``commit(cids)`` promotes pending states once the
  step's results have reached the driver, ``discard`` drops them. Until the commit, the previous version stays the
  one that ``get`` returns — and, once spilled, the one a replacement runner reading ``directory`` sees.
* Committed states are kept in memory up to ``memory_bytes``; beyond it the least recently used are written to
  ``directory/client_<cid>.pt`` (atomically: a temporary file, then ``os.replace``) and dropped from memory.
  ``memory_bytes = 0`` keeps nothing in memory. Spilling and reloading are exact, so the store setting never changes
  a result.
* ``durable=True`` (the Ray backend with ``on_actor_failure: retry``): a staged state is written at once to
  ``client_<cid>.pending-<token>.pt`` and ``commit(cids, token)`` renames it to ``client_<cid>.pt``; memory is only a
  cache. So every committed state survives its runner's death, and a replacement runner can still carry out a commit
  that the dead one never received (the file is there) — the rule that lets a killed actor's step be retried exactly.
* Client states are written in a flat format (:func:`save_tree`: a JSON header describing the tree, then the tensors'
  raw bytes with a CRC-32; read without pickle) — about 5x faster than ``torch.save``'s zip archive of many small
  tensors, which matters for the durable store's write per client step. Anything else in a state (a leaf that is not
  a tensor, number, string, bool or None) falls back to ``torch.save``.
* ``save_shard(path)`` writes every committed state this store holds (memory and disk) into one file keyed by
  client id; ``load_shard`` reads such files back, keeping only the clients it is asked for, so a checkpoint written
  by N actors restores into any number of actors.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Optional

import torch


def state_nbytes(obj) -> int:
    """Bytes held by the tensors of a state tree."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (torch.save writes sequentially)."""

    def __init__(self, f):
        import hashlib

        self.f, self.h = f, hashlib.sha256()

    def write(self, b) -> int:
        self.h.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


TREE_MAGIC = b"RSTREE1\n"
_ALIGN = 64


class _NotATree(TypeError):
    pass


def _encode(obj, bufs: list, pos: list):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu" or t.is_sparse or type(t) is not torch.Tensor or t.is_quantized or t.is_conj() or t.is_neg():
            raise _NotATree(type(obj).__name__)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        pad = -pos[0] % _ALIGN
        if pad:
            bufs.append(bytes(pad))
            pos[0] += pad
        off = pos[0]
        if nbytes:
            bufs.append(t.reshape(-1).view(torch.uint8).numpy())
            pos[0] += nbytes
        return {"t": [str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes, bool(obj.requires_grad)]}
    if obj is None:
        return {"n": 0}
    if isinstance(obj, bool):
        return {"b": obj}
    if isinstance(obj, int):
        return {"i": obj}
    if isinstance(obj, float):
        return {"f": repr(obj)}
    if isinstance(obj, str):
        return {"s": obj}
    if type(obj) is dict:
        items = []
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise _NotATree(f"key {type(k).__name__}")
            items.append([["s" if type(k) is str else "i", k], _encode(v, bufs, pos)])
        return {"d": items}
    if type(obj) is list:
        return {"l": [_encode(v, bufs, pos) for v in obj]}
    if type(obj) is tuple:
        return {"u": [_encode(v, bufs, pos) for v in obj]}
    raise _NotATree(type(obj).__name__)


def _decode(node, data: bytearray):
    (kind, v), = node.items()
    if kind == "t":
        dtype, shape, off, nbytes, grad = v
        dt = getattr(torch, dtype)
        if nbytes:
            t = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=off).view(dt).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dt)
        return t.requires_grad_() if grad else t
    if kind == "n":
        return None
    if kind in ("b", "i", "s"):
        return v
    if kind == "f":
        return float(v)
    if kind == "d":
        return {(str(k) if kt == "s" else int(k)): _decode(x, data) for (kt, k), x in v}
    if kind == "l":
        return [_decode(x, data) for x in v]
    if kind == "u":
        return tuple(_decode(x, data) for x in v)
    raise ValueError(f"unknown node {kind!r}")


def save_tree(obj, f) -> None:
    """Write a tree of tensors / dicts / lists / tuples / numbers / strings in the flat format (raises TypeError for
    anything else): magic, header length, JSON header (the tree, the data's length and CRC-32), the raw data."""
    import json
    import struct
    import zlib

    bufs: list = []
    pos = [0]
    tree = _encode(obj, bufs, pos)
    crc = 0
    for b in bufs:
        crc = zlib.crc32(b, crc)
    header = json.dumps({"tree": tree, "n": pos[0], "crc": crc}, separators=(",", ":")).encode()
    f.write(TREE_MAGIC)
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for b in bufs:
        f.write(b)


def load_tree(raw: bytes | bytearray):
    """Read :func:`save_tree`'s format; damage (a short file, a changed byte) raises ValueError."""
    import json
    import struct
    import zlib

    start = len(TREE_MAGIC) + 8
    if len(raw) < start or raw[:len(TREE_MAGIC)] != TREE_MAGIC:
        raise ValueError("not a raysim state file")
    (hlen,) = struct.unpack("<Q", raw[len(TREE_MAGIC):start])
    head = json.loads(bytes(raw[start:start + hlen]))
    data = bytearray(memoryview(raw)[start + hlen:])
    if len(data) != head["n"] or zlib.crc32(data) != head["crc"]:
        raise ValueError(f"its data are damaged ({len(data):,} of {head['n']:,} bytes; CRC-32 differs)")
    return _decode(head["tree"], data)


def file_sha256(path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_save(obj, path: Path, digest: bool = True, tree: bool = False) -> Optional[str]:
    """Write ``obj`` to ``path`` atomically; returns the sha256 of the bytes written (verified when read back), or
    None with ``digest=False``. ``tree=True``: the flat format of :func:`save_tree` when ``obj`` fits it (client
    states), else ``torch.save``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f) if digest else f
            written = False
            if tree:
                try:
                    save_tree(obj, w)
                    written = True
                except _NotATree:
                    f.seek(0)
                    f.truncate()
                    if digest:
                        w = _HashingWriter(f)
            if not written:
                torch.save(obj, w)
        os.replace(tmp, path)
        return w.h.hexdigest() if digest else None
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_file(path: Path, sha256: Optional[str] = None):
    """A state file (checkpoint shard or meta, spilled client state): tensors and plain containers only. A damaged
    or unreadable one (or one whose bytes differ from ``sha256``, when the writer recorded it) is a DamagedFileError
    naming it and saying what to do."""
    import hashlib
    import io

    from raysim.errors import DamagedFileError, read_problem

    path = Path(path)
    try:
        data = path.read_bytes()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"its contents changed since it was written ({len(data):,} bytes; sha256 differs from "
                             f"the one recorded when it was written)")
        if data[:len(TREE_MAGIC)] == TREE_MAGIC:
            return load_tree(data)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        if "checkpoints" in path.parts:
            i = len(path.parts) - 1 - path.parts[::-1].index("checkpoints")
            ck = Path(*path.parts[: i + 2])
            fix = (f"the checkpoint is damaged: remove {ck} to resume from the one before it, or start the run "
                   f"again")
        else:
            fix = ("a client state spilled to disk (backend.state_dir) is damaged: the run cannot continue; resume it "
                   "from its last checkpoint (--resume) or start it again")
        raise DamagedFileError(path, str(e) if str(e).startswith("its contents changed") else read_problem(e),
                               fix) from None


class StateStore:
    def __init__(self, memory_bytes: float, directory: Optional[str | Path] = None, name: str = "clients",
                 durable: bool = False, owned: Optional[Iterable[int]] = None):
        self.memory_bytes = float(memory_bytes)
        self.durable = durable
        self.owned = set(owned) if owned is not None else None  # the client ids this store answers for
        self._own_dir = directory is None
        self.directory = Path(directory) if directory is not None else None
        self.name = name
        self._mem: "OrderedDict[int, Any]" = OrderedDict()  # committed, in memory, LRU first
        self._sizes: dict[int, int] = {}
        self._total = 0  # sum of self._sizes
        self._on_disk: set[int] = set()
        self._pending: dict[int, Any] = {}
        self.spills = 0  # how many states were written to disk (diagnostics)
        self._digests: dict[int, str] = {}  # sha256 of each state this store spilled (verified when read back)
        self.loads = 0

    # -- paths ------------------------------------------------------------------------------------------------
    def _dir(self) -> Path:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"raysim-{self.name}-"))
        return self.directory

    def _path(self, cid: int) -> Path:
        return self._dir() / f"client_{int(cid)}.pt"

    def _pending_path(self, cid: int, token: Optional[str]) -> Path:
        return self._dir() / f"client_{int(cid)}.pending-{token or 'x'}.pt"

    # -- reading ------------------------------------------------------------------------------------------------
    def __contains__(self, cid: int) -> bool:
        return cid in self._mem or cid in self._on_disk or (self.durable and self._path(cid).exists())

    def client_ids(self) -> list[int]:
        ids = set(self._mem) | self._on_disk
        if self.durable and self.owned is not None and self.directory is not None:
            ids |= {c for c in self.owned if self._path(c).exists()}  # committed by a runner this one replaced
        return sorted(ids)

    def get(self, cid: int):
        """The committed state of ``cid`` or None."""
        if cid in self._mem:
            self._mem.move_to_end(cid)
            return self._mem[cid]
        if cid in self._on_disk or (self.durable and self._path(cid).exists()):
            self._on_disk.add(cid)
            self.loads += 1
            state = load_file(self._path(cid), self._digests.get(cid))
            size = state_nbytes(state)
            if self._total + size <= self.memory_bytes:  # cache it again
                self._mem[cid] = state
                self._sizes[cid] = size
                self._total += size
                if not self.durable:
                    self._on_disk.discard(cid)
                    self._delete_file(cid)
                self._enforce()
            return state
        return None

    # -- writing ------------------------------------------------------------------------------------------------
    def put_initial(self, cid: int, state) -> None:
        """A newly created state, committed at once."""
        if self.durable:
            atomic_save(state, self._path(cid), digest=False, tree=True)
            self._on_disk.add(cid)
        self._commit_one(cid, state)
        self._enforce()

    def stage(self, cid: int, state, token: Optional[str] = None) -> None:
        self._pending[cid] = (state, token)
        if self.durable:
            atomic_save(state, self._pending_path(cid, token), digest=False, tree=True)

    def put(self, cid: int, state) -> None:
        """Server steps: set a client's server-side state (committed when the step returns)."""
        self.stage(cid, state)

    def commit(self, cids: Optional[Iterable[int]] = None, token: Optional[str] = None) -> None:
        ids = list(self._pending) if cids is None else list(cids)
        for cid in ids:
            if cid in self._pending:
                state, tok = self._pending.pop(cid)
                if self.durable:
                    os.replace(self._pending_path(cid, tok), self._path(cid))
                    self._on_disk.add(cid)
                self._commit_one(cid, state)
            elif self.durable and token is not None and self._pending_path(cid, token).exists():
                # staged by a runner that died before it received this commit: the file carries it out
                os.replace(self._pending_path(cid, token), self._path(cid))
                self._on_disk.add(cid)
                if cid in self._mem:
                    self._mem.pop(cid)
                    self._total -= self._sizes.pop(cid)
        self._enforce()

    def discard(self, cids: Optional[Iterable[int]] = None) -> None:
        for cid in list(self._pending) if cids is None else list(cids):
            item = self._pending.pop(cid, None)
            if item is not None and self.durable:
                try:
                    os.unlink(self._pending_path(cid, item[1]))
                except FileNotFoundError:
                    pass

    # -- moving clients between stores (cost-aware placement) ---------------------------------------------------
    def adopt(self, cid: int, state) -> None:
        """A client moved here from another runner, with its committed state (None: never created yet)."""
        if self.owned is not None:
            self.owned.add(cid)
        if state is not None:
            self.put_initial(cid, state)

    def forget(self, cids: Iterable[int]) -> None:
        """Clients that moved to another runner: drop them here. A spilled file is left alone: the run's stores share
        one directory keyed by client id, and the client's new runner owns that path now."""
        for cid in cids:
            if cid in self._mem:
                self._mem.pop(cid)
                self._total -= self._sizes.pop(cid)
            self._on_disk.discard(cid)
            self._pending.pop(cid, None)
            if self.owned is not None:
                self.owned.discard(cid)

    def pending(self) -> list[int]:
        return sorted(self._pending)

    def _commit_one(self, cid: int, state) -> None:
        if cid in self._on_disk and not self.durable:
            self._on_disk.discard(cid)
            self._delete_file(cid)
        self._total -= self._sizes.get(cid, 0)
        self._mem[cid] = state
        self._mem.move_to_end(cid)
        self._sizes[cid] = state_nbytes(state)
        self._total += self._sizes[cid]

    def _enforce(self) -> None:
        while self._mem and self._total > self.memory_bytes:
            cid, state = self._mem.popitem(last=False)
            self._total -= self._sizes.pop(cid)
            if not self.durable:  # a durable store has the file already
                self._digests[cid] = atomic_save(state, self._path(cid), tree=True)
            self._on_disk.add(cid)
            self.spills += 1

    def _delete_file(self, cid: int) -> None:
        self._digests.pop(cid, None)
        try:
            os.unlink(self._path(cid))
        except FileNotFoundError:
            pass

    def memory_in_use(self) -> int:
        return self._total

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save_shard(self, path: Path) -> list[int]:
        """Write every committed state into one file (client id -> state); returns the client ids written."""
        states = {}
        for cid in self.client_ids():
            states[cid] = self._mem[cid] if cid in self._mem else load_file(self._path(cid), self._digests.get(cid))
        atomic_save(states, path)
        return sorted(states)

    def load_shard(self, path: Path, keep: Optional[set] = None) -> list[int]:
        """Commit the states of a shard file (only the client ids in ``keep``, when given)."""
        loaded = []
        for cid, state in load_file(path).items():
            if keep is None or cid in keep:
                if self.durable:
                    atomic_save(state, self._path(int(cid)), digest=False, tree=True)
                    self._on_disk.add(int(cid))
                self._commit_one(int(cid), state)
                loaded.append(int(cid))
        self._enforce()
        return loaded

    def clear(self) -> None:
        for cid in self.client_ids():
            self._delete_file(cid)
        self._mem.clear()
        self._sizes.clear()
        self._total = 0
        self._on_disk.clear()
        self._pending.clear()

    def close(self) -> None:
        self.clear()
        if self._own_dir and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
