"""Which of the user's code the Ray backend ships to its actors (``backend.code``).

``auto`` (default): the modules that the config's import paths (``model.arch``, ``model.per_client[*].arch``,
``data.dataset``, ``data.public.dataset``, ``algorithm.name``) and the run-time registrations (``register_model``,
``register_dataset``, ``register_algorithm``) were loaded from, when they are neither installed (site-packages,
the standard library) nor raysim's own packages, plus every other module the driver loaded from the same
directories (helpers they import: the user's modules in the working directory). On a local cluster, modules that sit
directly in a directory the workers already have on their path (raysim's checkout, the driver's PYTHONPATH) are not
shipped.
``none``: nothing (the code is installed on every node). A list: those module files / package directories.
``working_dir``: the whole working directory, as Ray's ``working_dir`` (the actors then run inside its copy).

The backend gives the paths to Ray as the client and server actors' ``runtime_env`` ``py_modules``: Ray uploads
them once per content hash and unpacks them on every node, so the same code runs on a one-machine cluster and on a
``backend.address`` cluster. Ray-free: only the paths are computed here.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from raysim.errors import ConfigError

OWN_PACKAGES = ("raysim", "algorithms", "envs", "tuning")
ROOT = Path(__file__).resolve().parents[2]  # raysim's checkout (or site-packages when installed)


def _installed_dirs() -> list[Path]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(Path(p).resolve())
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            dirs.add(Path(p).resolve())
    return sorted(dirs)


def _under(path: Path, dirs) -> bool:
    return any(path == d or d in path.parents for d in dirs)


def module_location(name: str):
    """(path to ship, its parent directory) of the loaded top-level module ``name``, or None."""
    mod = sys.modules.get(name)
    if mod is None:
        return None
    paths = list(getattr(mod, "__path__", []) or [])
    if paths:
        if len(paths) != 1:
            return None
        p = Path(paths[0]).resolve()
    elif getattr(mod, "__file__", None):
        p = Path(mod.__file__).resolve()
        if p.suffix != ".py":
            return None
    else:
        return None
    return p, p.parent


def config_modules(cfg) -> set[str]:
    """Top-level module names the config's import paths and the run-time registrations name."""
    from raysim.config import registry

    targets = [cfg.model.arch, cfg.data.dataset, cfg.algorithm.name]
    targets += [s.arch for s in cfg.model.per_client or []]
    if isinstance(cfg.data.public, dict) and isinstance(cfg.data.public.get("dataset"), str):
        targets.append(cfg.data.public["dataset"])
    snap = registry.snapshot()
    for group in snap.values():
        targets += list(group.values())
    names = set()
    for t in targets:
        if isinstance(t, str):
            if registry.is_import_path(t):
                names.add(t.split(":")[0].split(".")[0])
        else:
            mod = getattr(t, "__module__", None)
            if mod and mod != "__main__":
                names.add(mod.split(".")[0])
    return names


# files that hold secrets, never shipped (issue 50: ``backend.code: [~/.ssh]`` uploaded id_rsa to every node)
KEY_NAMES = frozenset({"id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk", "authorized_keys",
                       "known_hosts", ".netrc", ".pgpass", "credentials", ".git-credentials", ".npmrc", ".pypirc"})
KEY_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".gpg", ".kdbx", ".ppk", ".crt", ".der")
MAX_FILES = 20_000


def _secret(name: str) -> bool:
    return name in KEY_NAMES or name.lower().endswith(KEY_SUFFIXES) or name.startswith(("id_rsa", "id_ed25519"))


def _package_files(p: Path, key: str, given: str) -> tuple[int, int]:
    """(files, bytes) of the package directory ``p``; ConfigError naming ``key`` for a directory that is no Python
    package or holds key material."""
    if not ((p / "__init__.py").is_file() or any(p.glob("*.py"))):
        raise ConfigError(key, f"{given} holds no Python code (no __init__.py, no .py file); backend.code ships Python "
                               f"packages and modules only")
    files = size = 0
    for root, dirs, names in os.walk(p):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for n in names + [d for d in dirs if d.startswith(".")]:
            if _secret(n) or n.startswith("."):
                where = Path(root, n).relative_to(p)
                raise ConfigError(key, f"{given} holds {where}, which is {'key material' if _secret(n) else 'hidden'}; "
                                       f"backend.code ships only code: list the package's own directory")
        files += len(names)
        size += sum(os.path.getsize(os.path.join(root, n)) for n in names if os.path.isfile(os.path.join(root, n)))
        if files > MAX_FILES:
            raise ConfigError(key, f"{given} holds more than {MAX_FILES:,} files; is it a package?")
    return files, size


# backend.code paths given on the command line (``--set backend.code=[...]``): they may lie outside the working
# directory; a config file's may not (issue 50: a shared config naming ``~/.ssh`` or ``/etc`` shipped it)
COMMAND_LINE: set = set()


def allow_from_command_line(overrides) -> None:
    """Trust the ``backend.code`` paths that the command line's ``--set`` overrides name (the CLI calls it)."""
    from raysim.config.yamlio import parse_override

    for text in overrides or []:
        key, value = parse_override(text)
        if key == "backend.code" and isinstance(value, (list, tuple)):
            COMMAND_LINE.update(Path(str(c)).expanduser().resolve() for c in value if isinstance(c, str) and c)


def _check_inside(p: Path, key: str, given: str) -> None:
    """A listed path outside the working directory ships only when the command line named it (ConfigError)."""
    cwd = Path.cwd().resolve()
    if p != cwd and cwd not in p.parents and p not in COMMAND_LINE:
        raise ConfigError(key, f"{given} is outside the working directory {cwd}; a config ships only code under it "
                               f"(give a path outside on the command line: --set 'backend.code=[{given}]')")


def listed_code(code: list) -> list[tuple[str, int, int]]:
    """(path, files, bytes) of each ``backend.code`` entry: a ``.py`` module file or a Python package directory, not
    hidden, holding no key material, under the working directory unless the command line named it (ConfigError
    naming ``backend.code[i]``)."""
    out = []
    for i, c in enumerate(code):
        key, given = f"backend.code[{i}]", str(c)
        p = Path(c).expanduser().resolve()
        if p.name.startswith(".") or _secret(p.name):
            raise ConfigError(key, f"{given} is {'key material' if _secret(p.name) else 'a hidden file or directory'};"
                                   f" backend.code ships only Python modules and packages")
        _check_inside(p, key, given)
        if p.is_file() and p.suffix == ".py":
            out.append((str(p), 1, p.stat().st_size))
        elif p.is_dir():
            out.append((str(p), *_package_files(p, key, given)))
        else:
            raise ConfigError(key, f"{c} is neither a package directory nor a .py module file")
    return out


def describe_shipped(paths: list[str]) -> str:
    """What ships, in one line: each path with its files and bytes."""
    parts = []
    for p in paths:
        q = Path(p)
        files, size = (1, q.stat().st_size) if q.is_file() else _package_files(q, "backend.code", p)
        parts.append(f"{p} ({files} file{'s' if files != 1 else ''}, {size:,} bytes)")
    return "backend.code ships " + "; ".join(parts) if parts else ""


def code_to_ship(cfg) -> list[str]:
    """The paths ``backend.code`` ships (ConfigError naming backend.code when a listed path does not exist)."""
    code = cfg.backend.code
    if code in ("none", "working_dir"):
        return []
    if isinstance(code, (list, tuple)):
        return [p for p, _, _ in listed_code(list(code))]
    installed = _installed_dirs()
    own = [ROOT / p for p in OWN_PACKAGES]
    reachable = [] if cfg.backend.address else [ROOT] + [Path(p).resolve() for p in
                                                       os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

    def user(loc) -> bool:  # not installed, not raysim's, and not importable by the workers already
        p, parent = loc
        return not _under(p, installed) and not _under(p, own) and parent not in reachable

    found = {}
    for name in sorted(config_modules(cfg)):
        loc = module_location(name)
        if loc and user(loc):
            found[name] = loc
    dirs = {parent for _, parent in found.values()}
    if dirs:  # the helpers they import from the same directories
        for name in sorted(m for m in list(sys.modules) if "." not in m and m != "__main__"):
            if name in found:
                continue
            loc = module_location(name)
            if loc and loc[1] in dirs and user(loc):
                found[name] = loc
    return sorted({str(p) for p, _ in found.values()})
