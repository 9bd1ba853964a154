"""The verdicts of the stored reproduction tables (issue 34), from what benchmarks/results/ holds.

    python benchmarks/stored_verdicts.py [--check]

* A table stored with its per-run records (``<experiment>.json``, or ``<experiment>_r<N>.json`` for the experiment
  run for N rounds: ``raysim reproduce``'s reproduction.json, a ``runs`` list with each run's label, seed and values)
  is written again, its ``.md`` and the JSON's ``table`` / ``claims``, by
  :func:`raysim.app.reproduction_table.render_records`: the same means (from the same per-run values), each claim's
  paired per-seed differences with their 95 % interval and verdict. The runs are untouched.
* Issue 51: a claim rests on each run's mean of its last 5 evaluated rounds (the final round beside it). Records
  written since carry each run's per-round values (``curve``); for older tables whose per-round values are stored
  beside them (``<table>_rounds_to_target.md``, written by ``benchmarks/seed004_rounds_to_target.py`` from the run
  directories: accuracy per round at 0.1 % resolution) those values are copied into the records' runs as ``curve``
  first; every other stored table keeps its final-round value and its claims say so.
* A table stored as markdown only (means ± std, no per-run values) cannot give a paired interval: a note at its top
  says so, and names the verdict that n alone decides (fewer seeds than the experiment's ``min_seeds``: n too small).

Then one line per stored table: its claims' outcome counts (held / tie / reversed / n too small / no per-run
records). ``--check`` writes nothing and fails when a file would change.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOTE_START = "<!-- issue 34: verdicts -->"


def _note(exp, seeds_in_table: int) -> str:
    if seeds_in_table < exp.min_seeds:
        why = (f"n too small for every claim: the table holds {seeds_in_table} seeds per method, this experiment's "
               f"minimum for a verdict is {exp.min_seeds}")
    else:
        why = "no verdict: a paired interval needs each seed's values"
    return (f"{NOTE_START}\n**Verdicts (issue 34): {why}. The per-run results of this table are not stored in the "
            f"repository (only the means ± std below), so its claims carry no paired 95 % interval; the column "
            f"\"held in direction\" below is the superseded rule (the sign of the mean difference) and is not a "
            f"verdict. `raysim reproduce {exp.name}` writes the table again with verdicts.**\n\n")


def _run_settings(exp, record: dict) -> list[str]:
    """Per run of the table, the work its own config sets (issue 51 item 4), read from the configs the runs were made
    from (the experiment's, the run's and the record's overrides; no data is loaded): rounds, clients per round, local
    epochs or local steps per round, batch size, learning rate, and the method parameters that differ from its
    defaults (restarts, steps, schedules, ...)."""
    from raysim.config import load_config

    extra = [o for o in record.get("overrides") or [] if isinstance(o, str)]
    lines = ["| run | method | rounds | clients per round | local epochs | local steps per round | batch | lr | "
             "method parameters set (not the defaults) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in exp.runs:
        try:
            cfg = load_config(r.config, list(exp.overrides) + list(r.overrides) + extra)
        except Exception as e:  # a config that no longer loads: say so, never guess
            lines.append(f"| {r.label} | (config does not load: {type(e).__name__}) | | | | | | | |")
            continue
        t = cfg.train
        ident = cfg.identity_dict()  # the science keys that differ from their defaults (the method's, for its params)
        params = ", ".join(f"{k[len('algorithm.params.'):]}: {v}" for k, v in ident.items()
                           if k.startswith("algorithm.params.")) or "–"
        lines.append(f"| {r.label} | {cfg.algorithm.name} | {cfg.rounds} | {cfg.clients_per_round} | "
                     f"{'–' if t.local_steps is not None else t.local_epochs} | "
                     f"{t.local_steps if t.local_steps is not None else '–'} | {t.batch_size} | {t.lr:g} | {params} |")
    return lines


def _work_section(exp, record: dict) -> str:
    """Issue 51 item 4: every stored table lists the work per method -- each run's settings from its own config
    (:func:`_run_settings`), then its seed's table in configs/seed_claims.yaml for what a config does not say (tuning
    trials, extra data, steps per round in the seed's headline settings; this table's settings are the ones above)."""
    if str(ROOT / "benchmarks") not in sys.path:  # claim_tally beside this script (called once per stored table)
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from claim_tally import load_registry, work_table

    out = ["", "Work per run (from each run's config as the repository holds it; the record's config hash names what ran):", "",
           *_run_settings(exp, record)]
    seed = exp.source.split(".")[0]
    body = load_registry().get(seed)
    if isinstance(body, dict) and body.get("work"):
        out += ["", f"Tuning trials and extra data per method ({seed}'s `work` in `configs/seed_claims.yaml`; its steps "
                    f"and epochs are the seed's headline settings, this table's are the ones above):", "",
                *work_table(body)[2:]]
    return "\n".join(out) + "\n"


def _seeds_in_table(md: str) -> int:
    m = re.search(r"mean ± sample std over seeds ([0-9, ]+?) (?:\(n = |of the mean)", md)
    return len([s for s in m.group(1).split(",") if s.strip()]) if m else 0


def _claim_rows(md: str) -> int:
    """How many claims the (old) claims table of a stored markdown table lists."""
    lines = md.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("| claim |"):
            return sum(1 for _ in itertools.takewhile(lambda x: x.startswith("| "), lines[i + 2:]))
    return 0


def _experiment_of(stem: str, exps) -> str | None:
    """The experiment a stored table belongs to: its file name, or the name before a round suffix ``_r<N>`` (the same
    experiment run for N rounds, e.g. ``slaugfl_fmnist_a005_e10_r15``); None for any other file."""
    if stem in exps:
        return stem
    m = re.fullmatch(r"(.+)_r\d+", stem)
    return m.group(1) if m and m.group(1) in exps else None


def _curves_md(path: Path) -> dict:
    """(label, seed) -> {round: value} from a ``*_rounds_to_target.md`` table (its 'accuracy per round' column)."""
    out = {}
    for ln in path.read_text().splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].isdigit() or not cells[2].isdigit():
            continue
        vals = [float(x) for x in cells[3].split()]
        if len(vals) != int(cells[2]):
            raise ValueError(f"{path}: {cells[0]} seed {cells[1]}: {len(vals)} values for {cells[2]} rounds")
        out[(cells[0], int(cells[1]))] = {str(i + 1): v for i, v in enumerate(vals)}
    return out


def attach_curves(js: Path, record: dict) -> dict:
    """The record with each run's stored per-round values (``curve``) where ``<table>_rounds_to_target.md`` holds
    them and the run has none yet."""
    md = js.with_name(js.stem + "_rounds_to_target.md")
    if not md.exists():
        return record
    curves = _curves_md(md)
    runs = [dict(r, curve=curves[(r["label"], int(r["seed"]))]) if "curve" not in r and (r["label"], int(r["seed"]))
            in curves else r for r in record.get("runs") or []]
    return dict(record, runs=runs)


def main(argv=None) -> int:
    from raysim.app import seed_experiments as rp
    from raysim.app import verdicts as vd
    from raysim.app.reproduction_table import render_records

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = ap.parse_args(argv)
    exps = rp.load_experiments()
    numbers = rp.load_numbers()
    changed = []
    for md_path in sorted(RESULTS.rglob("*.md")):
        name = _experiment_of(md_path.stem, exps)
        if name is None:
            continue
        exp = exps[name]
        js = md_path.with_suffix(".json")
        old_md = md_path.read_text()
        if js.exists():
            record = attach_curves(js, json.loads(js.read_text()))
            rounds = re.fullmatch(r".+_r(\d+)", md_path.stem) if md_path.stem != name else None
            if rounds and "overrides" not in record:  # <experiment>_r<N>: the experiment run for N rounds (issue 52)
                record["overrides"] = [f"rounds={rounds.group(1)}"]
            md, new = render_records(exp, record, numbers)
            md = md.rstrip("\n") + "\n" + _work_section(exp, record)
            new_js = json.dumps(new, indent=1) + "\n"
            if js.read_text() != new_js:
                changed.append(js)
                if not args.check:
                    js.write_text(new_js)
            counts = vd.count(c["verdict"] for c in new["claims"])
            line = ", ".join(f"{v} {counts[v]}" for v in vd.VERDICTS)
        else:
            body = old_md.split("\n\n", 1)[1] if old_md.startswith(NOTE_START) else old_md
            n = _seeds_in_table(body)
            md = _note(exp, n) + body
            k = _claim_rows(body)
            line = (f"n too small {k} ({n} of {exp.min_seeds} seeds)" if n < exp.min_seeds else
                    f"no per-run records {k}")
        if md != old_md:
            changed.append(md_path)
            if not args.check:
                md_path.write_text(md)
        print(f"{md_path.relative_to(ROOT)}: {line}")
    if args.check and changed:
        print("would change: " + ", ".join(str(p.relative_to(ROOT)) for p in changed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
