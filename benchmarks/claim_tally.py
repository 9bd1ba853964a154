"""One claim, one verdict (issue 51): the seeds' claims tallied once each, from the stored per-run records.

    python benchmarks/claim_tally.py [--check]

Reads configs/seed_claims.yaml (each claim of the five seeds once, in the seed's words, at the setting closest to the
seed, its other settings as ablations) and the stored tables under benchmarks/results/ (their per-run records, judged
by this code: raysim.app.reproduction_table.render_records, the window of the last 5 evaluated rounds where the records
hold per-round values, else the final round, and said so); writes benchmarks/results/CLAIMS.md (every claim with its
one verdict, its parts, its ablations, the final round's verdict and a Holm-corrected column across each seed's
claims) and the summary between the issue-51 markers at the top of benchmarks/REPRODUCTION.md. Ablations are never
counted. A setting's ``cross`` parts pair two stored tables' runs by seed (a baseline rerun at equal work in a table
of its own against the other table's runs; :meth:`Tables.cross`). ``--check`` writes nothing and fails when a file
would change.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
REGISTRY = ROOT / "configs" / "seed_claims.yaml"
OUT = RESULTS / "CLAIMS.md"
REPRO = ROOT / "benchmarks" / "REPRODUCTION.md"
START, END = "<!-- issue51-summary:start -->", "<!-- issue51-summary:end -->"
NO_VERDICT = "no verdict"
COUNTED = ("held", "tie", "underpowered", "reversed", NO_VERDICT)
SEED_PREFIX = {"seed000": "seed000_002", "seed002": "seed000_002"}


@functools.lru_cache(maxsize=1)
def load_registry() -> dict:
    """configs/seed_claims.yaml, parsed as configs are (raysim.config.yaml_load: a key given twice in one mapping is
    an error naming both lines, never the later one silently winning)."""
    from raysim.config import yaml_load

    return yaml_load(REGISTRY.read_text(), str(REGISTRY)) or {}


def _stored_verdicts():
    """benchmarks/stored_verdicts.py as a module (its record readers), loaded once."""
    import importlib.util

    if "_sv" not in _CACHE:
        spec = importlib.util.spec_from_file_location("stored_verdicts", ROOT / "benchmarks" / "stored_verdicts.py")
        sv = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sv)
        _CACHE["_sv"] = sv
    return _CACHE["_sv"]


_CACHE: dict = {}


class Tables:
    """The stored tables' claims as this code judges them, read once each."""

    def __init__(self):
        from raysim.app import seed_experiments as rp

        self.exps, self.numbers, self.cache, self.raws = rp.load_experiments(), rp.load_numbers(), {}, {}

    def record(self, table: str) -> dict | None:
        if table not in self.cache:
            self.cache[table] = self._load(table)
        return self.cache[table]

    def unprovenanced(self, table: str) -> int:
        """How many of the table's per-run records lack a config hash, a code version or a commit (issue 51 item 6:
        a counted table carries all three in every record); -1 when the table is not stored."""
        rec = self.record(table)
        if rec is None:
            return -1
        runs = rec.get("runs") if rec.get("runs") is not None else rec.get("records") or []

        def ok(r: dict) -> bool:
            code = r.get("code") if isinstance(r, dict) else None
            return bool(isinstance(code, dict) and code.get("source") and code.get("commit") and r.get("config_hash"))

        return sum(1 for r in runs if not ok(r)) if runs else 0

    def short_windows(self, table: str) -> int:
        """How many of the table's runs average fewer evaluated rounds than its experiment's window (``select:
        last``; issue 51 item 2: a counted value is the mean of the last k >= 5 evaluated rounds, never a whole run's
        few evaluations, nor a final round alone); 0 for a table judged by another rule, -1 when not stored."""
        rec = self.raw(table)
        if rec is None:
            return -1
        name = _stored_verdicts()._experiment_of(Path(table).name, self.exps)
        exp = self.exps.get(name) if name else None
        if exp is None or exp.select != "last":
            return 0
        runs = rec.get("runs") or []
        return sum(1 for r in runs if not (isinstance(r, dict) and (r.get("window") or 0) >= exp.window))

    def _load(self, table: str) -> dict | None:
        from raysim.app.reproduction_table import render_records

        js = RESULTS / f"{table}.json"
        if not js.exists():
            return None
        sv = _stored_verdicts()
        record = sv.attach_curves(js, json.loads(js.read_text()))
        name = sv._experiment_of(js.stem, self.exps)
        if name is None:
            return record  # not a reproduce table (fig3_shots.json): read by its own kind
        _, new = render_records(self.exps[name], record, self.numbers)
        runs = record.get("runs") or []
        new["no_code"] = sum(1 for r in runs if not (isinstance(r, dict) and r.get("code")))
        return new

    def raw(self, table: str) -> dict | None:
        """A stored table's record as stored (its per-run records under ``runs``), curves attached."""
        if table not in self.raws:
            js = RESULTS / f"{table}.json"
            self.raws[table] = _stored_verdicts().attach_curves(js, json.loads(js.read_text())) if js.exists() else None
        return self.raws[table]

    def cross(self, spec: dict) -> dict:
        """A claim across two stored tables (issue 51: a baseline rerun at equal work in a table of its own, compared
        with the other side's stored runs): ``better`` / ``worse`` each ``[table, label]``, the runs paired by seed and
        judged by the same code as a table's own claims (:func:`raysim.app.reproduction_table.render_records`: the
        value rule, the seed's difference from the runs' ``paper`` keys, the final round where both sides' records
        hold it). The two tables must share
        the experiment's value rule (metric, selection, window, minimum seeds, seed source) and overrides, and the
        two labels must differ."""
        from dataclasses import replace

        from raysim.app import seed_experiments as rp
        from raysim.app.reproduction_table import FINAL, render_records

        (tb, lb), (tw, lw) = spec["better"], spec["worse"]
        text = spec["text"]
        if lb == lw:
            raise SystemExit(f"{REGISTRY.name}: cross claim {text!r}: both sides are labelled {lb!r}")
        recs = {}
        for t in (tb, tw):
            recs[t] = self.raw(t)
            if recs[t] is None:
                return {"text": text, "verdict": NO_VERDICT, "missing": f"{t} not stored"}
        exps = {}
        for t in (tb, tw):
            name = _stored_verdicts()._experiment_of(Path(t).name, self.exps)
            if name is None:
                raise SystemExit(f"{REGISTRY.name}: cross claim {text!r}: {t} is not a reproduce table")
            exps[t] = self.exps[name]
        eb, ew = exps[tb], exps[tw]
        for k in ("source", "metric", "select", "select_per", "window", "min_seeds", "percent"):
            if getattr(eb, k) != getattr(ew, k):
                raise SystemExit(f"{REGISTRY.name}: cross claim {text!r}: {tb} and {tw} differ in {k} "
                                 f"({getattr(eb, k)!r} vs {getattr(ew, k)!r}); their runs cannot be paired")
        ob, ow = (list(recs[t].get("overrides") or []) for t in (tb, tw))
        if ob != ow:
            raise SystemExit(f"{REGISTRY.name}: cross claim {text!r}: {tb} and {tw} were made with different "
                             f"overrides ({ob} vs {ow})")
        runs = [r for r in recs[tb].get("runs") or [] if r.get("label") == lb] + [
            r for r in recs[tw].get("runs") or [] if r.get("label") == lw]
        # a final-round value only where both sides' records hold it (older records hold the seed's selection only)
        shared = set.intersection(*(set(r) for r in runs)) if runs else set()
        runs = [{k: v for k, v in r.items() if not k.endswith(FINAL) or k in shared} for r in runs]
        exp = replace(ew, name=f"{eb.name} x {ew.name}", runs=(eb.run(lb), ew.run(lw)),
                      claims=(rp.Claim(text, lb, lw, spec.get("metric"), bool(spec.get("lower_is_better"))),))
        _, new = render_records(exp, {"runs": runs, "overrides": ow}, self.numbers)
        out = dict(new["claims"][0])
        out["rule"] = f"{out.get('rule', '')}; paired across {tb} and {tw}"
        return out

    def part(self, table: str, start: str) -> dict:
        rec = self.record(table)
        if rec is None:
            return {"text": start, "verdict": NO_VERDICT, "missing": f"{table} not stored"}
        hits = [c for c in rec.get("claims", []) if c["text"] == start] or [
            c for c in rec.get("claims", []) if c["text"].startswith(start)]
        if len(hits) != 1:
            raise SystemExit(f"{REGISTRY.name}: {table}: {len(hits)} claims start with {start!r}")
        return hits[0]


def _judge_fig3(rec: dict, measure: str) -> dict:
    """Seed 000's Fig. 3 records: ``drop`` -- drop(FedAvg) - drop(FedProto) from k = 25 to 5 shots, per seed (the
    claim: FedProto falls more slowly); ``uh`` -- FedAvg - FedAvg-UH at k = 25 (the claim: UH lowers FedAvg).
    Records written with ``--window N`` (issue 51) hold each run's mean of its last N evaluated rounds as ``test_acc``
    and its final round as ``test_acc_final``: the verdict rests on the window, the final round's beside it."""
    from raysim.app import verdicts as vd

    def judge(key: str) -> tuple[dict, str]:
        acc = {}
        for r in rec["records"]:
            acc[(r["method"].split(" (")[0], int(r["shots"]), int(r["seed"]))] = 100.0 * float(r[key])
        seeds = sorted({s for (_, _, s) in acc})
        if measure == "drop":
            drop = {m: {s: acc[(m, 25, s)] - acc[(m, 5, s)] for s in seeds if (m, 5, s) in acc and (m, 25, s) in acc}
                    for m in ("FedProto", "FedAvg")}
            return vd.judge(drop["FedAvg"], drop["FedProto"]), "drop(FedAvg) - drop(FedProto), k 25 -> 5, pp"
        return (vd.judge({s: acc[("FedAvg", 25, s)] for s in seeds}, {s: acc[("FedAvg-UH", 25, s)] for s in seeds}),
                "FedAvg - FedAvg-UH at k = 25, pp")

    res, text = judge("test_acc")
    win = rec.get("window") or 0
    if not win or not all("test_acc_final" in r for r in rec["records"]):
        return _as_claim(res, text, "final round (the records hold one value per run)")
    out = _as_claim(res, text, f"mean of the last {win} evaluated rounds")
    out["final"] = {"verdict": judge("test_acc_final")[0]["verdict"]}
    return out


def _as_claim(res: dict, text: str, rule: str) -> dict:
    return {"text": text, "n": res["n"], "ours": res["mean"], "half": res["half"], "lo": res["lo"], "hi": res["hi"],
            "p": res["p"], "paper": math.nan, "verdict": res["verdict"], "rule": rule,
            "final": {"verdict": ""}}


def _rounds_to(rec: dict, target: float, better: str, worse: str) -> dict:
    """Rounds to ``target`` % from each run's stored per-round values (a run that never reaches it: rounds + 1),
    paired over seeds, fewer is better."""
    from raysim.app import verdicts as vd

    def first(curve: dict) -> float:
        pts = sorted((int(r), float(v)) for r, v in curve.items())
        return next((float(r) for r, v in pts if v >= target), float(len(pts) + 1))

    side = {lab: {int(r["seed"]): first(r["curve"]) for r in rec["runs"] if r["label"] == lab and r.get("curve")}
            for lab in (better, worse)}
    res = vd.judge(side[better], side[worse], lower_is_better=True)
    return _as_claim(res, f"rounds to {target:g} %: {worse} - {better}", "rounds to target from the stored per-round values")


def judge_setting(tables: Tables, claim: dict, setting: dict) -> dict:
    """One setting of a claim: its parts (each a stored claim, judged by this code) and the claim's one verdict
    there (:func:`raysim.app.verdicts.combine` over the parts by the claim's rule)."""
    from raysim.app import verdicts as vd

    kind = setting.get("kind", claim.get("kind", "table"))  # an ablation may be of another kind than the claim's
    if kind == "fig3":
        parts = [_judge_fig3(tables.record(setting["table"]), setting.get("measure", claim.get("measure")))]
    elif kind == "rounds_to":
        pairs = setting.get("pairs") or [[setting["better"], setting["worse"]]]  # several: one verdict by the rule
        parts = [_rounds_to(tables.record(setting["table"]), setting["target"], b, w) for b, w in pairs]
        if setting.get("seed_note"):  # the seed's own difference where it is on another scale than the runs'
            parts = [dict(p, rule=f"{p['rule']}; {setting['seed_note']}") for p in parts]
    else:
        names = setting.get("parts") or ([] if setting.get("cross") else claim["at"].get("parts") or [])
        parts = [tables.part(setting["table"], p) for p in names]
        for extra in setting.get("also") or []:
            parts += [tables.part(extra["table"], p) for p in extra["parts"]]
        parts += [tables.cross(x) for x in setting.get("cross") or []]
        if setting.get("seed_difference") is not None:  # the seed's number where the table's source has none (its
            seed_diff = float(setting["seed_difference"])  # difference on the seed's own dataset: the one power rule)
            parts = [dict(p, paper=seed_diff, verdict=vd.power(p["verdict"], p.get("half", math.nan), seed_diff))
                     if not p.get("missing") and not math.isfinite(p.get("paper", math.nan)) else p for p in parts]
    if any(p.get("missing") for p in parts):
        return {"verdict": NO_VERDICT, "p": math.nan, "sign": 1, "parts": parts,
                "missing": next(p["missing"] for p in parts if p.get("missing"))}
    out = vd.combine(parts, claim.get("rule", "all")) if len(parts) > 1 else {
        "verdict": parts[0]["verdict"], "p": parts[0].get("p", math.nan),
        "sign": -1 if parts[0]["verdict"] == vd.REVERSED else 1}
    fin = [p.get("final") or {} for p in parts]
    out["final"] = (vd.combine([{"verdict": f["verdict"], "p": math.nan} for f in fin], claim.get("rule", "all"))["verdict"]
                    if all(f.get("verdict") for f in fin) else "")
    out["parts"] = parts
    return out


def tally(tables: Tables, registry: dict) -> dict:
    """seed -> its claims, each with its one verdict (at its setting), its ablations' verdicts (not counted) and the
    Holm-adjusted p-value across the seed's claims that have a verdict."""
    from raysim.app import verdicts as vd

    out = {}
    for seed, body in registry.items():
        rows = []
        for c in body["claims"]:
            row = {"claim": c}
            if c.get("kind") == "accounting":
                row["verdict"] = "agrees" if c["agrees"] else "disagrees"
            elif c.get("no_setting"):
                row.update(verdict=NO_VERDICT, p=math.nan, sign=1)
            else:
                counted = [c["at"]["table"], *[x["table"] for x in c["at"].get("also") or []],
                           *[side[0] for x in c["at"].get("cross") or [] for side in (x["better"], x["worse"])]]
                bad = [t for t in counted if tables.unprovenanced(t) > 0]
                if bad:  # issue 51 item 6: a table whose records lack provenance is never counted
                    raise SystemExit(f"{REGISTRY.name}: {seed} {c['id']}: counted table(s) {bad} hold records without "
                                     f"config hash, code version or commit; rerun them or make the setting an ablation")
                short = [t for t in counted if tables.short_windows(t) > 0]
                if short:  # issue 51 item 2: a counted value averages the last k >= 5 evaluated rounds of every run
                    raise SystemExit(f"{REGISTRY.name}: {seed} {c['id']}: counted table(s) {short} hold runs with fewer "
                                     f"evaluated rounds than the experiment's window (or the final round only); "
                                     f"rerun them with every round evaluated or make the setting an ablation")
                row.update(judge_setting(tables, c, c["at"]))
            row["ablations"] = [dict(a, result=judge_setting(tables, c, a), no_provenance=tables.unprovenanced(a["table"]))
                                for a in c.get("ablations") or []]
            rows.append(row)
        stat = [r for r in rows if r["verdict"] in COUNTED]
        adj = vd.holm([r.get("p", math.nan) for r in stat])
        for r, q in zip(stat, adj):
            r["holm_p"] = q
            # Holm can only take a verdict away: a claim that is not held / reversed uncorrected keeps its verdict
            r["holm"] = (vd.holm_verdict(r.get("sign", 1), q) if r["verdict"] in (vd.HELD, vd.REVERSED) else
                         r["verdict"])
        out[seed] = rows
    return out


def counts(rows: list[dict]) -> dict:
    c = {k: 0 for k in (*COUNTED, "agrees", "disagrees")}
    for r in rows:
        c[r["verdict"] if r["verdict"] in c else NO_VERDICT] += 1
    c["holm_held"] = sum(1 for r in rows if r.get("holm") == "held")
    c["holm_reversed"] = sum(1 for r in rows if r.get("holm") == "reversed")
    return c


def _num(x: float, fmt: str = "{:+.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and math.isfinite(x) else "–"


def _part_line(p: dict) -> str:
    if p.get("missing"):
        return f"{p['text']}: not stored yet"
    iv = f"{_num(p.get('ours'))} ± {_num(p.get('half'), '{:.2f}')} [{_num(p.get('lo'))}, {_num(p.get('hi'))}]"
    fin = (p.get("final") or {}).get("verdict")
    return (f"{p['text']}: {iv}, half-width {_num(p.get('half'), '{:.2f}')}, seed's {_num(p.get('paper'))}, "
            f"**{p['verdict']}**" + (f" (final round: {fin})" if fin else "") + f"; value: {p.get('rule', '')}")


def _no_final(parts: list[dict]) -> str:
    """Why a claim shows no final-round verdict beside its value."""
    rules = " ".join(str(p.get("rule", "")) for p in parts)
    if "rounds to target" in rules:
        return " (rounds to a target accuracy: a whole-curve reading, no final-round one)"
    if "the seed's rule" in rules:
        return (" (the value is the seed's own rule, each node's best-validation checkpoint; the records store that "
                "value only)")
    return ""


def claim_block(i: int, r: dict) -> list[str]:
    c = r["claim"]
    head = f"**{i}. {c['claim']}** — seed: “{c['seed_words']}”"
    if c.get("kind") == "accounting":
        return [head, f"- verdict: **{r['verdict']}** (accounting, no interval): {c['evidence']}", ""]
    if c.get("no_setting"):
        lines = [head, f"- verdict: **{NO_VERDICT}** — {c['no_setting']}"]
    else:
        rule = f" (rule `{c.get('rule', 'all')}` over {len(r['parts'])} parts)" if len(r["parts"]) > 1 else ""
        lines = [head, f"- setting: {c['at']['setting']} (`{c['at']['table']}`)",
                 f"- verdict: **{r['verdict']}**{rule}; final round: {r.get('final') or '–' + _no_final(r['parts'])}; "
                 f"Holm-adjusted p "
                 f"{_num(r.get('holm_p'), '{:.3g}')}: {r.get('holm', '–')}"]
        lines += [f"  - {_part_line(p)}" for p in r["parts"]]
    for a in r["ablations"]:
        res = a["result"]
        why = "; ".join(x for x in (("degenerate: " + a["degenerate"]) if a.get("degenerate") else "",
                                     "no config hash / code version / commit in its records: never counted"
                                     if a.get("no_code_version") or a.get("no_provenance", 0) > 0 else "") if x)
        lines.append(f"- ablation, not counted — {a['setting']} (`{a['table']}`)" + (f" [{why}]" if why else "")
                     + f": **{res['verdict']}**" + (f" ({res['missing']})" if res.get("missing") else ""))
        if not res.get("missing"):
            lines += [f"  - {_part_line(p)}" for p in res["parts"]]
    return lines + [""]


def summary_table(result: dict) -> list[str]:
    lines = ["| seed | distinct claims | held | tie | underpowered | reversed | no verdict | accounting: agrees / "
             "disagrees | after Holm: held / reversed |", "|---|---|---|---|---|---|---|---|---|"]
    for seed, rows in result.items():
        c = counts(rows)
        lines.append(f"| {seed[4:]} | {len(rows)} | {c['held']} | {c['tie']} | {c['underpowered']} | {c['reversed']} "
                     f"| {c[NO_VERDICT]} | {c['agrees']} / {c['disagrees']} | {c['holm_held']} / "
                     f"{c['holm_reversed']} |")
    return lines


def work_table(body: dict) -> list[str]:
    """Per method, the work behind the seed's comparisons (issue 51 item 4): tuning trials, optimiser steps per round,
    local epochs, restarts, extra data."""
    lines = ["Work per method (as run in the headline settings):", "",
             "| method | tuning trials | optimiser steps per round | local epochs | restarts | extra data |",
             "|---|---|---|---|---|---|"]
    for w in body.get("work") or []:
        lines.append(f"| {w['method']} | {w['trials']} | {w['steps']} | {w['epochs']} | {w['restarts']} | {w['extra']} |")
    return lines + ([f"\n{body['work_note']}"] if body.get("work_note") else [])


def claims_md(result: dict, registry: dict) -> str:
    lines = ["# One claim, one verdict (issue 51)", "",
             "Written by `python benchmarks/claim_tally.py` from `configs/seed_claims.yaml` and the stored per-run "
             "records under `benchmarks/results/`; nothing here is typed by hand. Each claim of the five seeds "
             "appears once, in the seed's words, with ONE verdict at the setting closest to the seed; its other "
             "settings are ablations under it and are never counted. A run's value: the mean of its last 5 evaluated "
             "rounds (every counted table holds them: claim_tally refuses a counted table whose runs average fewer), "
             "the seed's own rule where it states one (seed 003: the checkpoint with the best validation ACC per "
             "node); ablations whose records hold the final round only are judged on it (said beside each part). Verdicts: the paired 95 % Student-t interval over seeds (held / tie / "
             "reversed); a tie whose seed difference lies inside the half-width is **underpowered**; a claim over "
             "several comparisons takes one verdict by its rule (`all`: held only if every part is held, reversed if "
             "any is; `most`: held if more than half are held and none reversed). Holm: across each seed's claims "
             "with a verdict, on the paired t-tests' two-sided p-values (a claim over several parts: the p-value of "
             "the part its verdict rests on).", "", *summary_table(result), ""]
    for seed, rows in result.items():
        lines += [f"## {seed}: {registry[seed]['paper']}", "", *work_table(registry[seed]), ""]
        for i, r in enumerate(rows, 1):
            lines += claim_block(i, r)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = ap.parse_args(argv)
    registry = load_registry()
    result = tally(Tables(), registry)
    md = claims_md(result, registry)
    repro = REPRO.read_text()
    block = START + "\n" + "\n".join(summary_table(result)) + "\n" + END
    if START in repro:
        new_repro = repro[:repro.index(START)] + block + repro[repro.index(END) + len(END):]
    else:
        new_repro = repro
    changed = [p for p, new in ((OUT, md), (REPRO, new_repro)) if not p.exists() or p.read_text() != new]
    if args.check:
        if changed:
            print("would change: " + ", ".join(str(p.relative_to(ROOT)) for p in changed), file=sys.stderr)
            return 1
        return 0
    OUT.write_text(md)
    REPRO.write_text(new_repro)
    for line in summary_table(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
