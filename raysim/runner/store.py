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



from raysim.io.files import atomic_save, load_file
from raysim.messages import tensor_bytes


def state_nbytes(obj) -> int:
    """Bytes held by the tensors of a state tree (:func:`raysim.messages.tensor_bytes`, the one tensor-bytes walk)."""
    return tensor_bytes(obj)


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
