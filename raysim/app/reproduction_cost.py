"""What a reproduction costs before it runs, and the smoke form of one (``raysim reproduce --list``, ``--smoke``).

The estimate of an experiment is the sum over its runs of the mean wall time (setup + rounds, the ``wall_s`` of each
record) stored for that run's label, times the number of seeds: from ``<out>/<experiment>/reproduction.json`` when
this machine has run it, else from the stored reproductions under ``benchmarks/results/`` (measured on the machine
that stored them, at that record's scale; its CPU is named). A run label without a stored time takes the mean of the
experiment's stored runs; an experiment without any has no estimate.

``--smoke``: one seed, ``SMOKE_ROUNDS`` rounds, into ``<out>-smoke`` by default, and a table labelled "smoke test:
not a verdict" — a check that every run of the experiment starts, trains and writes its table, never a result."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SMOKE_ROUNDS = 2
SMOKE_BANNER = ("**Smoke test: not a verdict.** One seed, {rounds} rounds (`raysim reproduce --smoke`): this checks "
                "that every run starts, trains and writes its table. Its numbers and any verdict below say nothing "
                "about the method; run the experiment without --smoke for a result.\n\n")


@dataclass(frozen=True)
class Cost:
    seconds: float  # the whole experiment at its default seeds
    per_run: float  # mean stored wall seconds of one run
    source: str  # where the times come from
    cpu: Optional[str] = None


def _records(path: Path, name: str) -> Optional[tuple[list, str]]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("experiment") != name or not isinstance(d.get("runs"), list):
        return None
    runs = [r for r in d["runs"] if isinstance(r, dict) and isinstance(r.get("wall_s"), (int, float))
            and math.isfinite(r["wall_s"])]
    return (runs, str(path)) if runs else None


def stored_index(results_root: Path) -> dict[str, tuple[list, str]]:
    """experiment -> (its stored per-run records with a wall time, the file) over ``results_root``, each file read
    once; a file named after its experiment wins over another record of it."""
    out: dict = {}
    if not results_root.is_dir():
        return out
    for f in sorted(results_root.rglob("*.json")):
        try:
            name = json.loads(f.read_text()).get("experiment")
        except (OSError, ValueError, AttributeError):
            continue
        got = _records(f, name) if isinstance(name, str) else None
        if got and (name not in out or f.stem == name):
            out[name] = got
    return out


def stored_runs(name: str, out: Optional[str | Path], index: dict) -> Optional[tuple[list, str]]:
    """The stored per-run records of experiment ``name`` with a wall time, and the file they come from: this
    machine's earlier reproduction under ``out`` first, else the stored index."""
    if out is not None:
        mine = _records(Path(out) / name / "reproduction.json", name)
        if mine:
            return mine
    return index.get(name)


def estimate(exp, out: Optional[str | Path], index: dict) -> Optional[Cost]:
    got = stored_runs(exp.name, out, index)
    if got is None:
        return None
    runs, source = got
    by_label: dict[str, list[float]] = {}
    for r in runs:
        by_label.setdefault(str(r.get("label")), []).append(float(r["wall_s"]))
    overall = sum(float(r["wall_s"]) for r in runs) / len(runs)
    per_label = [sum(v) / len(v) for v in (by_label.get(spec.label) for spec in exp.runs) if v] or [overall]
    per_label += [overall] * (len(exp.runs) - len(per_label))
    cpus = {r.get("cpu") for r in runs if r.get("cpu")}
    return Cost(sum(per_label) * len(exp.seeds), sum(per_label) / len(per_label), source,
                cpus.pop() if len(cpus) == 1 else None)


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class TimeLeft:
    """``raysim reproduce``'s progress: each finished run's wall time and, from their mean, the time the runs still
    to do will take (``jobs`` at a time)."""

    def __init__(self, todo: list, jobs: int = 1):
        self.todo, self.jobs, self.spent = todo, max(1, jobs), []

    def done(self, seconds: float) -> str:
        self.spent.append(seconds)
        left = sum(q.status not in ("reuse", "diverged") for q in self.todo) - 1  # the run just done still counts
        eta = sum(self.spent) / len(self.spent) * left / self.jobs
        return f"{duration(seconds)}" + (f"; about {duration(eta)} left ({left} run(s))" if left > 0 else "")


def list_lines(exps: dict, out: Optional[str | Path], results_root: Path, sort: str = "name") -> list[str]:
    """``raysim reproduce --list``: one line per experiment (name, source, runs x seeds, estimated time), sorted by
    name or by estimated cost (cheapest first; those without an estimate last), and one line under it."""
    index = stored_index(results_root)
    rows = [(name, e, estimate(e, out, index)) for name, e in exps.items()]
    if sort == "cost":
        rows.sort(key=lambda t: (t[2] is None, t[2].seconds if t[2] else 0.0, t[0]))
    else:
        rows.sort(key=lambda t: t[0])
    lines = []
    for name, e, c in rows:
        est = f"~{duration(c.seconds)}" if c else "no stored time"
        lines.append(f"{name:<40} {est:>15}  {e.source:<22} {len(e.runs)} runs x {len(e.seeds)} seeds"
                     f"{'; scaled: ' + e.scaled if e.scaled else ''}")
        lines.append(f"  {e.title} ({e.folder.name}/)")
    lines.append("estimated time: the stored wall times of each run (setup + rounds; benchmarks/results/ or an earlier "
                 "reproduction under --out), times the seeds, one run at a time, on the machine that stored them "
                 "(--jobs N divides it by up to N)")
    return lines


def smoke_overrides(exp) -> list[str]:
    return [f"rounds={SMOKE_ROUNDS}"]


def label_smoke(md_path: Path) -> None:
    """Mark a smoke reproduction's table (Markdown and JSON) as not a verdict."""
    md_path.write_text(SMOKE_BANNER.format(rounds=SMOKE_ROUNDS) + md_path.read_text())
    js = md_path.with_name("reproduction.json")
    try:
        d = json.loads(js.read_text())
    except (OSError, ValueError):
        return
    d["smoke"] = f"smoke test: one seed, {SMOKE_ROUNDS} rounds; not a verdict"
    for c in d.get("claims") or []:
        if isinstance(c, dict) and "verdict" in c:
            c["verdict"] = "not a verdict (smoke test)"
    js.write_text(json.dumps(d, indent=1))
