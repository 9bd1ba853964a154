"""The ``raysim runs`` listing: the run directories below a folder (finished and unfinished), one row each (name,
algorithm, dataset, rounds done/planned, final accuracy, status, path); a damaged run is a row saying so, never an
error that hides the others. Reads what :mod:`raysim.io.rundir` (the run-directory lifecycle) and
:mod:`raysim.io.results` (the tables) write."""
from __future__ import annotations

import os
from pathlib import Path

from raysim.io import results
from raysim.config import YamlBoundsError, yaml_load
from raysim.errors import ConfigError, DamagedFileError, check_regular, read_problem
from raysim.io.resume_points import checkpoint_dirs
from raysim.io.rundir import INCOMPLETE, holder



def find_run_dirs(root: Path) -> list[Path]:
    """Finished (``results.parquet``) and unfinished (``*.incomplete``) run directories below ``root``; hidden
    directories are skipped."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here != root and (here.name.endswith(INCOMPLETE) or "results.parquet" in filenames
                             or "results.parquet" in dirnames):  # a table replaced by a directory: damaged
            found.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    if (root / "results.parquet").exists():
        found.insert(0, root)
    return found


def describe(path: Path) -> dict:
    """One row of ``raysim runs``: name, algorithm, dataset, rounds (done/planned), final acc, status, path. A run
    whose files are damaged gets the status ``damaged (<file>: <what>)`` and never stops the listing."""
    path = Path(path)
    row = {"name": "?", "algorithm": "?", "dataset": "?", "rounds": "?", "final acc": "–", "status": "?",
           "path": str(path)}
    try:
        _describe(path, row)
    except Exception as e:  # never let one run hide the others
        row["status"] = (f"damaged ({Path(e.path).name}: {e.problem})" if isinstance(e, DamagedFileError) else
                         f"damaged ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
        try:  # what the run's config.yaml still says
            cfg = _config_of(path)
            row["name"] = cfg.get("name", "?")
            row["algorithm"] = (cfg.get("algorithm") or {}).get("name", "?")
            row["dataset"] = (cfg.get("data") or {}).get("dataset", "?")
        except Exception:
            pass
    return row


def _config_of(path: Path) -> dict:
    f = path / "config.yaml"
    if not f.exists():
        return {}
    try:
        check_regular(f)  # a FIFO would block `raysim runs` forever
        cfg = yaml_load(f.read_text(), str(f)) or {}
        if not isinstance(cfg, dict):
            raise ValueError("not a mapping")
    except (OSError, UnicodeDecodeError, ValueError, YamlBoundsError, Exception) as e:
        raise DamagedFileError(f, read_problem(e), "the run's config is lost; rerun it") from None
    return cfg


def _describe(path: Path, row: dict) -> None:
    info = results.read_run_info(path) or {}
    if path.name.endswith(INCOMPLETE):
        cfg = _config_of(path)
        ckpts = [d for d in checkpoint_dirs(path) if d.name != "setup"]
        done = int(ckpts[-1].name.split("_")[1]) + 1 if ckpts else 0
        who = holder(path)
        if who:
            row["status"] = f"running ({who})"
        elif info.get("status"):
            row["status"] = str(info["status"]) + (" (resumable)" if ckpts else "")
        else:
            row["status"] = "killed (resumable)" if ckpts else "killed"
        row["rounds"] = f"{done}/{cfg.get('rounds', '?')}"
    else:
        meta = results.load_metadata(path)
        cfg = meta.get("config") or {}
        df = results.load(path)
        row["rounds"] = f"{int(df['round'].max()) + 1}/{cfg.get('rounds', '?')}"
        row["status"] = "stopped early" if meta.get("stopped_early") else "finished"
        try:
            row["final acc"] = f"{float(results.final(df, 'test_acc')['mean'].iloc[0]):.4f}"
        except KeyError:
            pass
    row["name"] = cfg.get("name", "?")
    row["algorithm"] = (cfg.get("algorithm") or {}).get("name", "?")
    row["dataset"] = (cfg.get("data") or {}).get("dataset", "?")


def list_runs(root: Path) -> list[dict]:
    root = Path(root)
    try:
        is_dir = root.is_dir() and os.access(root, os.R_OK | os.X_OK) and (os.listdir(root) is not None)
    except OSError as e:
        raise ConfigError("DIR", f"cannot read {root}: {e.strerror or e}") from None
    if not is_dir:
        raise ConfigError("DIR", f"{root} is not a directory" if not root.is_dir() else f"cannot read {root} "
                                 f"(permissions)")
    return [describe(p) for p in find_run_dirs(root)]
