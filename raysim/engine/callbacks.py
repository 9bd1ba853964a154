"""The run's callbacks: everything around the round loop is one. ``run_experiment(cfg, callbacks=[...])`` adds yours
(e.g. a TensorBoard or MLflow logger reading ``run.table``):

    on_run_start(run)                      after the backend started (and a resume restored its states)
    on_setup_end(run)                      after the setup schedule ran (only for methods that have one)
    on_round_end(run, round_idx, evaluated) -> stop?   after every round (and its evaluation)
    on_run_end(run, result)                after the last round (called in reverse order of registration)
    on_run_error(run, exc)                 when the run failed (reverse order)

Built in: :class:`RunDirectory` (writes the run directory atomically), :class:`Checkpointer`, :class:`ProgressBar`
(on a terminal) or :class:`ProgressLines` (otherwise: one line per evaluated round), the trackers of
:mod:`raysim.engine.tracking` (``output.tensorboard``, ``output.mlflow``),
:class:`EvalCallback` (``callback(round_idx, table) -> stop`` on evaluated rounds; tuning uses it),
:class:`ClusterAgreement` (ARI of a clustered method's ``cluster`` reports against the ground-truth domains, registered
when the data has domains and the method reports clusters)."""
from __future__ import annotations

import json
import math
import sys
from typing import Callable, Optional

import numpy as np
import yaml

from raysim.io import rundir
from raysim.runner import safety
from raysim.config import to_dict
from raysim.io.tables import RESULTS_FILE, ResultTable, write_parquet
from raysim.io.checkpoints import find_checkpoint, prune_checkpoints, write_checkpoint
from raysim.engine.run_record import SETUP_ROUND, Run, RunResult


class Callback:
    def on_run_start(self, run: Run) -> None: ...

    def on_setup_end(self, run: Run) -> None: ...

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool) -> Optional[bool]: ...

    def on_run_end(self, run: Run, result: RunResult) -> None: ...

    def on_run_error(self, run: Run, exc: BaseException) -> None: ...


class RunDirectory(Callback):
    """Writes the run directory (see :mod:`raysim.io.rundir`): the run is built in the visible, locked
    ``<name>.incomplete`` (claimed before the backend starts) and renamed to ``<name>`` when it finishes, with
    results.parquet, config.yaml and run.json. A run that stops keeps ``<name>.incomplete`` when it holds checkpoints
    (resumable) or diverged (its run.json says where); otherwise it is removed."""

    def __init__(self, rd: "rundir.RunDir"):
        self.rd = rd
        self.not_moved = False  # the run finished but its final rename failed: its directory is kept as it is

    def on_run_start(self, run: Run) -> None:
        run.dir, run.final_dir = self.rd.work, self.rd.final

    def on_run_end(self, run: Run, result: RunResult) -> None:
        cfg, d = run.cfg, self.rd.work
        digest = write_parquet(result.table, d / RESULTS_FILE, result.metadata)
        (d / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        summary = {"status": "finished", **{k: v for k, v in result.metadata.items() if k != "config"}}
        t = run.timing
        summary["timing"] = {"setup_s": t["setup_s"], "setup_phase_s": t["setup_phase_s"],
                             "total_round_s": float(np.sum(t["round_s"])),
                             "mean_round_s": float(np.mean(t["round_s"])) if t["round_s"] else math.nan,
                             "total_env_s": float(np.sum(t["env_s"])), "backend": cfg.backend.name}
        summary["store"] = run.backend_report.store if run.backend_report is not None else []
        summary["failures"] = run.failures
        summary["results_sha256"] = digest  # verified whenever the table is read (results.check_table)
        (d / "run.json").write_text(json.dumps(summary, indent=1, default=str))
        try:
            result.out_dir = self.rd.finalise()
        except rundir.RunNotMoved as e:  # never throw a finished run away: keep it whole, resumable, and say where
            self.not_moved = True
            self._keep_unmoved(run, summary, e)
            raise

    def _keep_unmoved(self, run: Run, summary: dict, e: "rundir.RunNotMoved") -> None:
        """The final checkpoint becomes a round checkpoint (``--resume`` finds it and only writes the directory
        again) and run.json says what happened; a failure here leaves the directory as it is."""
        d = self.rd.work
        try:
            ck = d / "checkpoints"
            target = ck / f"round_{run.round_idx:05d}"
            if (ck / "final").is_dir() and not target.exists():
                (ck / "final").rename(target)
            (d / "run.json").write_text(json.dumps({**summary, "status": "finished, not moved",
                                                    "error": str(e)}, indent=1, default=str))
        except OSError:
            pass

    def on_run_error(self, run: Run, exc: BaseException) -> None:
        if self.not_moved:  # finished: the directory stays whole (RunNotMoved says where)
            return
        rd, cfg = self.rd, run.cfg
        resumable = find_checkpoint(rd.work) is not None
        status = ("diverged" if isinstance(exc, safety.NonFiniteError) else
                  "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        keep = resumable or status == "diverged"
        if keep:
            info = {"status": status, "run_id": run.run_id, "config_hash": cfg.config_hash(), "seed": cfg.seed,
                    "error": (str(exc).splitlines() or [type(exc).__name__])[0], "resumable": resumable,
                    "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in run.failures]}
            if isinstance(exc, safety.NonFiniteError):
                info["nonfinite"] = exc.event.record()
            (rd.work / "run.json").write_text(json.dumps(info, indent=1, default=str))
        kept = rd.abandon(keep)
        if kept is not None and hasattr(exc, "add_note"):
            if resumable:
                exc.add_note(f"checkpoints kept in {kept}; continue with: raysim run CONFIG --resume {kept}")
            else:
                exc.add_note(f"no result table was written; {kept / 'run.json'} records where the run stopped")


class Checkpointer(Callback):
    """Every ``every`` rounds (and after the setup phase, and at the end) the backend writes state shards and the
    driver writes the checkpoint's meta (result rows so far, failure log, environment state, config hash).
    ``keep`` > 0: after each round checkpoint only the newest ``keep`` resumable ones stay, the setup one counting as
    the oldest (:func:`prune_checkpoints`); ``keep`` 0 keeps them all."""

    def __init__(self, every: int, keep: int = 2):
        self.every = every
        self.keep = keep

    def _save(self, run: Run, name: str, round_idx: int) -> None:
        shards = run.async_server.save_messages if run.async_server is not None else None
        write_checkpoint(run.dir / "checkpoints" / name, round_idx, run.backend, run.checkpoint_extra(), shards)

    def on_setup_end(self, run: Run) -> None:
        if self.every:
            self._save(run, "setup", SETUP_ROUND)

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        if self.every and (round_idx + 1) % self.every == 0:
            self._save(run, f"round_{round_idx:05d}", round_idx)
            prune_checkpoints(run.dir, self.keep)  # keep 0: nothing removed
        return None

    def on_run_end(self, run: Run, result: RunResult) -> None:
        self._save(run, "final", run.round_idx)


class ProgressBar(Callback):
    """A tqdm bar over the rounds; its postfix shows the latest evaluated value of each headline metric of the method
    (``Algorithm.headline``, e.g. ``test_acc`` as ``acc``) the run has reported, and the simulated time."""

    def __init__(self, headline: tuple = ("test_acc",)):
        self.bar = None
        self.headline = tuple(headline)

    def on_run_start(self, run: Run) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=run.cfg.rounds, desc=f"{run.cfg.algorithm.name} [{run.cfg.backend.name}]", unit="round",
                        file=sys.stderr)
        if run.start_round:
            self.bar.update(run.start_round)

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        post = {}
        for m in self.headline:
            v = run.table.latest(m)
            if v is not None:
                post[m.removeprefix("test_")] = f"{v:.4f}"
        if run.env is not None:
            post["sim"] = f"{run.env.sim_time:.0f}s"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        return None

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_run_end(self, run, result):
        self._close()

    def on_run_error(self, run, exc):
        self._close()


class ProgressLines(Callback):
    """The progress bar's non-terminal form: one line per evaluated round on stderr (``name s<seed> round r/R:
    acc 0.4123, ..., <wall s>``, r = rounds completed), chosen when stderr is not a terminal (a log file, a pipe, a batch job),
    so that a log holds lines, not tqdm's ``\\r`` frames."""

    def __init__(self, headline: tuple = ("test_acc",), stream=None):
        self.headline = tuple(headline)
        self.stream = stream
        self.t0 = 0.0

    def _say(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(text, file=stream, flush=True)

    def on_run_start(self, run: Run) -> None:
        import time

        self.t0 = time.perf_counter()
        what = f"resumed after round {run.start_round}" if run.start_round else "started"
        self._say(f"{run.cfg.name} s{run.cfg.seed} [{run.cfg.algorithm.name}, {run.cfg.backend.name}] {what}: "
                  f"{run.cfg.rounds} rounds")

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        import time

        if not evaluated:
            return None
        parts = []
        for m in self.headline:
            v = run.table.latest(m)
            if v is not None:
                parts.append(f"{m.removeprefix('test_')} {v:.4f}")
        if run.env is not None:
            parts.append(f"sim {run.env.sim_time:.0f}s")
        parts.append(f"{time.perf_counter() - self.t0:.1f}s")
        self._say(f"{run.cfg.name} s{run.cfg.seed} round {round_idx + 1}/{run.cfg.rounds}: {', '.join(parts)}")
        return None


def progress_callback(mode, headline: tuple, stream=None) -> Optional[Callback]:
    """The progress display for ``output.progress`` (or ``run_experiment(progress=)``): True/``auto`` -> a bar
    when stderr is a terminal, else lines; ``bar``; ``lines``; False -> none."""
    if mode is False or mode is None:
        return None
    if mode in (True, "auto"):
        stream = stream or sys.stderr
        mode = "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return ProgressBar(headline) if mode == "bar" else ProgressLines(headline, stream)


class ClusterAgreement(Callback):
    """ARI of a clustered method's assignment against the ground-truth domains, after every evaluated round.

    The driver alone holds the domains (``FederatedData.domains``: rotation index or data source); the methods never
    see them. A clustered method reports each evaluated client's cluster as the client metric ``cluster``; this
    callback reads those rows and writes scikit-learn's ``adjusted_rand_score(domains, clusters)`` over the evaluated
    clients as the server-scope metric ``ari`` (weight: the number of clients). The driver registers it only when the
    data has domains and the method reports clusters (``raysim.algorithm.ReportsClusters``). It runs before the
    checkpointer, so checkpoints (and a resume) carry the row."""

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        domains = run.prep.fed_data.domains
        if not evaluated or domains is None:
            return None
        clusters = {}
        for row in reversed(run.table.rows):
            if row.round != round_idx:
                break
            if row.scope == "client" and row.metric == "cluster":
                clusters[row.client_id] = int(row.value)
        if clusters:
            from sklearn.metrics import adjusted_rand_score

            ids = sorted(clusters)
            ari = adjusted_rand_score([domains[c] for c in ids], [clusters[c] for c in ids])
            run.table.add(round_idx, -1, "server", "ari", float(ari), len(ids))
        return None


class EvalCallback(Callback):
    """``fn(round_idx, table) -> stop?`` after every evaluated round (the tuning monitor's interface)."""

    def __init__(self, fn: Callable[[int, ResultTable], bool]):
        self.fn = fn

    def on_round_end(self, run: Run, round_idx: int, evaluated: bool):
        return bool(self.fn(round_idx, run.table)) if evaluated else None


