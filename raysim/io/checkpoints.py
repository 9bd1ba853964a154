"""Checkpoints as directories of shards: ``checkpoints/<name>/`` holds ``server.pt`` (server state), one
``clients-<k>.pt`` per client runner (client id -> state, written by the runner itself, never gathered on the driver),
for ``server.mode: async`` ``async.pt`` (the payloads and uploads of the clients in flight, written by the server
runner) and ``meta.pt`` (round, manifest, result rows, failure log, environment state, config hash), written last. The
directory is built as ``<name>.tmp`` and renamed when complete, so a checkpoint that exists is whole. Client states
are keyed by client id, so a checkpoint restores into any number of actors."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

from raysim.io.files import atomic_save, file_sha256, load_file
from raysim.io.resume_points import META, TRASH, checkpoint_dirs


def write_checkpoint(path: Path, round_idx: int, backend, extra: dict,
                     shards: Optional[Callable[[str], dict]] = None) -> Path:
    """``shards``: writes more shards into the checkpoint's directory and returns their manifest entries (name ->
    file; server.mode: async adds ``async``: the messages of the clients in flight)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = backend.save_checkpoint(str(tmp))
    if shards is not None:
        manifest = {**manifest, **shards(str(tmp))}
    digests = {f.name: file_sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}  # verified before a resume
    atomic_save({"round_idx": int(round_idx), "manifest": manifest, "extra": extra, "sha256": digests}, tmp / META)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def find_checkpoint(run_dir: Path) -> Optional[Path]:
    """The latest complete resumable checkpoint of a run directory (round checkpoints, else the setup one)."""
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: Path, keep: int) -> list[str]:
    """Keeps the newest ``keep`` (>= 1) complete resumable checkpoints of a run directory (the setup one counts as
    the oldest) and removes the others; returns the names removed. Each goes by a rename to ``<name>.trash`` first,
    so a removal cut short never leaves a directory that looks like a whole checkpoint; leftover ``*.trash`` are
    removed too. Incomplete ones (``*.tmp``) are left to their writer; ``final`` is not a resume point and stays."""
    root = Path(run_dir) / "checkpoints"
    found = checkpoint_dirs(run_dir)
    gone = found[:-keep] if keep >= 1 else []
    for d in gone:
        d.rename(d.with_name(d.name + TRASH))
    for t in (root.glob("*" + TRASH) if root.is_dir() else []):
        shutil.rmtree(t, ignore_errors=True)
    return [d.name for d in gone]


def read_checkpoint_meta(ck_dir: Path) -> dict:
    return load_file(Path(ck_dir) / META)


def load_checkpoint(ck_dir: Path) -> dict:
    """A whole checkpoint assembled in memory (for inspection and tests): round_idx, server_state, client_states
    (client id -> state), extra."""
    ck_dir = Path(ck_dir)
    meta = read_checkpoint_meta(ck_dir)
    clients = {}
    for f in meta["manifest"]["clients"]:
        clients.update(load_file(ck_dir / f))
    return {"round_idx": meta["round_idx"], "server_state": load_file(ck_dir / meta["manifest"]["server"])["state"],
            "client_states": dict(sorted(clients.items())), "extra": meta["extra"]}
