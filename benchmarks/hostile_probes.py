"""Run the hostile-input probe table of tests/test_hostile.py and print each outcome as a Markdown table row:
``python benchmarks/hostile_probes.py > /tmp/probes.md`` (from the repository root, PYTHONPATH=.).

Each probe runs ``raysim.cli.main`` in-process in a fresh working directory (the fixture of the tests) and records
the exit code, the number of stderr lines other than notices, whether a traceback appeared, whether the directory
tree changed, and the line itself."""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from raysim.cli import main  # noqa: E402
from tests import test_hostile as th  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def setup(w: Path) -> None:
    cfg = tiny_config(data__val_fraction=0.25)
    cfg["output"] = {"dir": "out", "progress": False}
    (w / "c.yaml").write_text(yaml.safe_dump(cfg))
    (w / "laughs.yaml").write_text(th.laughs())
    (w / "deep.yaml").write_text("x: " + "[" * 3000 + "]" * 3000 + "\n")
    (w / "deep2.yaml").write_text("x: " + "[" * 40 + "]" * 40 + "\n")
    (w / "big.yaml").write_text("# padding\n" * 120_000 + "rounds: 1\n")
    (w / "empty.yaml").write_text("")
    (w / "comments.yaml").write_text("# nothing but a comment\n")
    (w / "list.yaml").write_text("- rounds: 1\n")
    (w / "bin.yaml").write_bytes(bytes(range(256)) * 4)
    (w / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (w / "space.yaml").write_text(yaml.safe_dump({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1,
                                                                                       "high": 2.0}},
                                                  "objective": {"metric": "val_acc"}}))
    (w / "bad.log").write_text("{not json\n")
    (w / "adir").mkdir()
    (w / "nosplit").mkdir()


def run(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def main_() -> None:
    import shutil

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment

    print("| # | probe | command (after `raysim`) | exit | lines | traceback | tree changed | the line |")
    print("|---|---|---|---|---|---|---|---|")
    cwd = os.getcwd()
    one = Path(tempfile.mkdtemp()) / "r"  # a finished run for the probes that need one (copied to runs/r)
    run_experiment(make_config(tiny_config(rounds=1)), out_dir=one)
    probes = [(p, False) for p in th.PROBES] + [(p, True) for p in th.REPORT_PROBES]
    for i, ((pid, argv, _, _), with_run) in enumerate(probes, 1):
        with tempfile.TemporaryDirectory() as d:
            w = Path(d) / "work"
            w.mkdir()
            setup(w)
            if with_run:
                shutil.copytree(one, w / "runs" / "r")
            os.chdir(w)
            try:
                before = th.tree(Path(d))
                code, err = run(argv)
                changed = th.tree(Path(d)) != before
            finally:
                os.chdir(cwd)
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")]
        shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv).replace("|", "\\|")
        line = (lines[-1] if lines else "").replace(d, "TMP").replace("|", "\\|")
        print(f"| {i} | {pid}{' (with a finished run in runs/r)' if with_run else ''} | `{shown}` | {code} | {len(lines)} | {'yes' if 'Traceback' in err else 'no'} | "
              f"{'yes' if changed else 'no'} | {line[:300]} |")


if __name__ == "__main__":
    main_()
