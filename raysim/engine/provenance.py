"""The code version a run was made with (recorded in every run's metadata, ``versions.code``), and the check
``raysim reproduce`` makes before reusing a finished run.

A code version is raysim's version plus a digest of the source of the packages a run executes (``raysim``,
``algorithms``, ``envs``: every file under them but bytecode): two runs have the same code version exactly when
that source was byte for byte the same, whether or not it was committed. The git commit of the checkout (and whether
those packages had uncommitted changes) is recorded beside it for provenance when the packages live in a git
checkout; it does not take part in the comparison (a documentation commit changes no number).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import subprocess
from pathlib import Path
from typing import Optional

from raysim._version import __version__

PACKAGES = ("raysim", "algorithms", "envs")


def _package_dirs() -> list[tuple[str, Path]]:
    out = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out.append((name, Path(list(spec.submodule_search_locations)[0])))
    return out


def source_digest(dirs: Optional[list[tuple[str, Path]]] = None) -> str:
    """sha256 (first 16 hex digits) over every source file of the packages: relative path and bytes, in path order."""
    h = hashlib.sha256()
    for name, root in (dirs if dirs is not None else _package_dirs()):
        files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.suffix not in (".pyc", ".pyo"))
        for p in files:
            h.update(f"{name}/{p.relative_to(root).as_posix()}\0".encode())
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def _git(args: list[str], cwd: Path) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state(dirs: Optional[list[tuple[str, Path]]] = None) -> tuple[Optional[str], Optional[bool]]:
    """(commit, whether the packages differ from it) when the packages live in a git checkout, else (None, None)."""
    dirs = dirs if dirs is not None else _package_dirs()
    if not dirs:
        return None, None
    root = dirs[0][1].parent
    top = _git(["rev-parse", "--show-toplevel"], root)
    if not top:
        return None, None
    commit = _git(["rev-parse", "HEAD"], root)
    paths = [str(p) for _, p in dirs if str(p.resolve()).startswith(str(Path(top).resolve()))]
    status = _git(["status", "--porcelain", "--", *paths], root) if paths else ""
    return commit, (None if status is None else bool(status))


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """This process's code version, computed once (the code a process runs is the code it loaded):
    ``{"raysim": version, "source": digest, "commit": sha or None, "dirty": bool or None}``."""
    dirs = _package_dirs()
    commit, dirty = git_state(dirs)
    return {"raysim": __version__, "source": source_digest(dirs), "commit": commit, "dirty": dirty}


def key(version: Optional[dict]) -> Optional[tuple]:
    """What two code versions must share to be the same: raysim's version and the source digest (None: unknown)."""
    if not isinstance(version, dict) or not version.get("source"):
        return None
    return (str(version.get("raysim")), str(version["source"]))


def same(a: Optional[dict], b: Optional[dict]) -> bool:
    """Whether two recorded code versions are the same code (an unrecorded one is never the same)."""
    ka, kb = key(a), key(b)
    return ka is not None and ka == kb


def label(version: Optional[dict]) -> str:
    """``raysim 0.1.0 source 1a2b3c4d5e6f7a8b (commit 0123456789ab, uncommitted changes)``; 'not recorded'."""
    if not isinstance(version, dict) or not version.get("source"):
        return "not recorded (a run made before code versions were recorded)"
    s = f"raysim {version.get('raysim')} source {version['source']}"
    if version.get("commit"):
        s += f" (commit {str(version['commit'])[:12]}" + (", uncommitted changes" if version.get("dirty") else "") + ")"
    return s


def recorded(run_dir: Path) -> Optional[dict]:
    """The code version a finished run directory's run.json records (``versions.code``), or None."""
    import json

    try:
        info = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None
    v = (info.get("versions") or {}).get("code") if isinstance(info, dict) else None
    return v if isinstance(v, dict) else None
