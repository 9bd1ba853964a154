"""Files that must not be half-written or silently damaged: atomic writes (a temporary file, then ``os.replace``)
with an optional SHA-256 recorded while writing, the flat tree format of client states (:func:`save_tree`: a JSON
header, then the tensors' raw bytes with a CRC-32, read without pickle; anything else falls back to ``torch.save``),
and reads that turn a damaged or changed file into one :class:`~raysim.errors.DamagedFileError` naming it and the fix.
Below both the run's files (``io/``: tables, checkpoints) and the state store (``engine/store.py``)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from raysim.messages import Rows

from raysim.io.resume_points import damaged_hint


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
    if type(obj) is dict or isinstance(obj, Rows):  # Rows: a client's row of a vectorised group's stacks
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
                _torch_save(obj, w)
        os.replace(tmp, path)
        return w.h.hexdigest() if digest else None
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _torch_save(obj, w) -> None:
    """``torch.save``; a Ctrl-C or SIGTERM (``KeyboardInterrupt``) that lands inside torch's zip writer comes back as
    the writer's own RuntimeError when it closes the half-written archive: the interruption is what happened, so it
    is raised as such (the run stops with its checkpoints kept, not with a serialisation error)."""
    try:
        torch.save(obj, w)
    except Exception as e:
        if isinstance(e.__context__, KeyboardInterrupt):
            raise e.__context__ from None
        raise


def load_file(path: Path, sha256: Optional[str] = None):
    """A state file (checkpoint shard or meta, spilled client state): tensors and plain containers only. A damaged
    or unreadable one (or one whose bytes differ from ``sha256``, when the writer recorded it) is a DamagedFileError
    naming it and saying what to do."""
    import hashlib
    import io

    from raysim.errors import DamagedFileError, check_regular, read_problem

    path = Path(path)
    try:
        check_regular(path)  # a FIFO would block forever
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
            fix = f"the checkpoint is damaged: {damaged_hint(ck)}"
        else:
            fix = ("a client state spilled to disk (backend.state_dir) is damaged: the run cannot continue; resume it "
                   "from its last checkpoint (--resume) or start it again")
        raise DamagedFileError(path, str(e) if str(e).startswith("its contents changed") else read_problem(e),
                               fix) from None
