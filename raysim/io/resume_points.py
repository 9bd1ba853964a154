"""Which checkpoints of a run directory can be resumed from, in what order, and what to do about a damaged one.
Kept apart from :mod:`raysim.io.checkpoints` (which writes and loads them) so that :mod:`raysim.io.files` can name
the checkpoint before a damaged one without an import cycle."""
from __future__ import annotations

import re
from pathlib import Path

META = "meta.pt"
TRASH = ".trash"
_ROUND = re.compile(r"round_(\d+)")


def _order(d: Path) -> int:
    """A resumable checkpoint's place in time: setup -1, round_N N (numerically: round_100000 after round_99999)."""
    m = _ROUND.fullmatch(d.name)
    return int(m.group(1)) if m else -1


def _complete(d: Path) -> bool:
    """A whole resumable checkpoint: ``setup`` or ``round_N`` with its meta (never ``*.tmp`` or ``*.trash``)."""
    return (d.name == "setup" or _ROUND.fullmatch(d.name) is not None) and d.is_dir() and (d / META).exists()


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete resumable checkpoints of a run directory, oldest first (setup, then rounds by number)."""
    root = Path(run_dir) / "checkpoints"
    return sorted((d for d in root.iterdir() if _complete(d)), key=_order) if root.is_dir() else []


def damaged_hint(ck: Path) -> str:
    """What to do about a damaged checkpoint ``ck``: resume from the one before it when one is kept, else start
    again (``output.keep_checkpoints`` keeps the newest few)."""
    ck = Path(ck)
    earlier = [d for d in checkpoint_dirs(ck.parent.parent) if _order(d) < _order(ck)]
    if earlier:
        return f"remove {ck} to resume from the checkpoint before it ({earlier[-1].name}), or start the run again"
    return (f"no checkpoint before {ck.name} is kept (output.keep_checkpoints keeps the newest few): start the run "
            f"again")
