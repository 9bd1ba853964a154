"""Run the hostile-input probe table (tests/hostile_table.py, the very list tests/test_hostile.py runs) and print
each outcome as a Markdown table row, then the count per outcome:
``python benchmarks/hostile_probes.py > /tmp/probes.md`` (from the repository root).

Each probe runs ``raysim.app.cli.main`` in-process in a fresh working directory (:func:`tests.hostile_table.run_probe`)
and is judged by :func:`tests.hostile_table.verdict`: "as specified" (its exit code, one line naming the key or file,
no traceback, no raw control character, the tree unchanged unless it writes) or what differs."""
from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import tiny_config  # noqa: E402
from tests.hostile_table import PROBES, lines_of, run_probe, verdict  # noqa: E402


def main_() -> None:
    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    print("| # | probe | command (after `raysim`) | exit | lines | tree changed | outcome | the line |")
    print("|---|---|---|---|---|---|---|---|")
    one = Path(tempfile.mkdtemp()) / "r"  # a finished run for the probes that need one (copied to runs/r)
    run_experiment(make_config(tiny_config(rounds=1)), out_dir=one)
    counts: collections.Counter = collections.Counter()
    for i, p in enumerate(PROBES, 1):
        with tempfile.TemporaryDirectory() as d:
            code, err, changed = run_probe(p, Path(d), one if p.with_run else None)
        why = verdict(p, code, err, changed)
        outcome = "as specified" if why is None else f"NOT as specified: {why}"
        counts["as specified" if why is None else "not as specified"] += 1
        lines = lines_of(err)
        shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in p.argv)
        shown = shown.encode("unicode_escape").decode().replace("|", "\\|")
        line = (lines[-1] if lines else "").replace(d, "TMP").replace("|", "\\|")
        print(f"| {i} | {p.id}{' (with a finished run in runs/r)' if p.with_run else ''} | `{shown}` | {code} | "
              f"{len(lines)} | {'yes' if changed else 'no'} | {outcome} | {line[:300]} |")
    print()
    print(f"{len(PROBES)} probes: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main_()
