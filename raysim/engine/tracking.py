"""Experiment tracking: the run's numbers streamed to TensorBoard (``output.tensorboard: DIR``), MLflow
(``output.mlflow: URI``) and Weights & Biases in offline mode (``output.wandb: DIR``) by built-in callbacks.

Both log the same things: every round's summary rows (scope ``mean``: the mean over the evaluated clients of each
client metric, e.g. ``test_acc``; scopes ``server``, ``total`` and ``env`` as ``server/<metric>``, ``total/<metric>``,
``env/<metric>``) at step = rounds completed (the table's round index + 1; the setup phase at step 0), the config
as parameters (dotted keys), and at the end the result table (``results.parquet``) as an artefact. Callbacks run in
the driver, after each round, on either backend (the Ray backend's actors never see them), so the same rows reach
the tracker whatever the backend.

Both are checked before the run directory is claimed (:func:`trackers`): a directory that cannot be written or an
MLflow server that does not answer is one :class:`ConfigError` naming ``output.tensorboard`` / ``output.mlflow``.
The packages are optional (``pip install 'raysim[tracking]'``: tensorboard, mlflow-skinny; ``raysim[wandb]``)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from raysim.engine.callbacks import Callback
from raysim.errors import ConfigError

SUMMARY_SCOPES = ("mean", "server", "total", "env")


def round_rows(run, round_idx: int) -> dict[str, float]:
    """The round's summary rows as {tag: value}: ``mean`` rows under the metric's own name, the others as
    ``<scope>/<metric>`` (client rows and per-client std are left to the table)."""
    out = {}
    for row in reversed(run.table.rows):
        if row.round != round_idx:
            break
        if row.scope in SUMMARY_SCOPES:
            out.setdefault(row.metric if row.scope == "mean" else f"{row.scope}/{row.metric}", row.value)
    return dict(sorted(out.items()))


def flat_config(cfg) -> dict[str, str]:
    """The config as {dotted key: value as text} (lists and mappings without sub-sections as their repr)."""
    from raysim.config import to_dict

    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            else:
                out[key] = "" if v is None else str(v)

    walk(to_dict(cfg), "")
    return out


def _step(round_idx: int) -> int:
    return max(int(round_idx) + 1, 0)  # rounds completed; the setup phase (round -1) at 0


def _write_table(result, directory: Path) -> Path:
    from raysim.io.tables import RESULTS_FILE, write_parquet

    path = Path(directory) / RESULTS_FILE
    write_parquet(result.table, path, result.metadata)
    return path


class TensorBoardLogger(Callback):
    """Event files in ``DIR/<run id>/``: scalars per round, the config as text and as hyperparameters (TensorBoard's
    HParams tab), and at the end the result table copied beside the events with the final values as text."""

    def __init__(self, log_dir: str | Path):
        self.root = Path(log_dir)
        self.writer = None
        self.dir: Optional[Path] = None

    def on_run_start(self, run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = self.root / run.run_id
        self.writer = SummaryWriter(log_dir=str(self.dir))
        params = flat_config(run.cfg)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()), 0)
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(params, {"test_acc": 0.0}):
            self.writer.file_writer.add_summary(summary)

    def _scalars(self, run, round_idx: int) -> None:
        for tag, value in round_rows(run, round_idx).items():
            self.writer.add_scalar(tag, value, _step(round_idx))

    def on_setup_end(self, run) -> None:
        self._scalars(run, -1)

    def on_round_end(self, run, round_idx: int, evaluated: bool):
        self._scalars(run, round_idx)
        return None

    def on_run_end(self, run, result) -> None:
        path = _write_table(result, self.dir)
        last = result.table[result.table["scope"] == "mean"]
        if len(last):
            last = last[last["round"] == last["round"].max()]
            lines = [f"    {m}: {v:.6g}" for m, v in zip(last["metric"], last["value"])]
            self.writer.add_text("final", f"result table: {path.name}\n\n" + "\n".join(lines), _step(run.round_idx))
        self._close()

    def on_run_error(self, run, exc) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MLflowLogger(Callback):
    """One MLflow run per raysim run (named by the run id, in the experiment named ``cfg.name``): the config as
    parameters, per-round metrics (``/`` in tags as MLflow allows), the result table as an artefact; the MLflow run
    ends FINISHED, or FAILED when the raysim run fails."""

    def __init__(self, uri: str, client=None):
        self.uri = uri
        self.client = client
        self.mlflow_run = None

    def on_run_start(self, run) -> None:
        from mlflow.entities import Param

        client = self.client or _client(self.uri)
        self.client = client
        exp = client.get_experiment_by_name(run.cfg.name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(run.cfg.name)
        self.mlflow_run = client.create_run(exp_id, run_name=run.run_id, tags={"raysim.run_id": run.run_id})
        params = [Param(k, v[:6000]) for k, v in flat_config(run.cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            client.log_batch(self.mlflow_run.info.run_id, params=params[i:i + 100])

    def _metrics(self, run, round_idx: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(tag), float(v), now, _step(round_idx))
                   for tag, v in round_rows(run, round_idx).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.mlflow_run.info.run_id, metrics=metrics[i:i + 1000])

    def on_setup_end(self, run) -> None:
        self._metrics(run, -1)

    def on_round_end(self, run, round_idx: int, evaluated: bool):
        self._metrics(run, round_idx)
        return None

    def on_run_end(self, run, result) -> None:
        with tempfile.TemporaryDirectory(prefix="raysim-mlflow-") as tmp:
            self.client.log_artifact(self.mlflow_run.info.run_id, str(_write_table(result, Path(tmp))))
        self.client.set_terminated(self.mlflow_run.info.run_id, "FINISHED")

    def on_run_error(self, run, exc) -> None:
        if self.mlflow_run is not None:
            try:
                self.client.set_terminated(self.mlflow_run.info.run_id, "FAILED")
            except Exception:  # never hide the run's own error
                pass


def _mlflow_name(tag: str) -> str:
    """MLflow's allowed characters (``step_s@train`` -> ``step_s.train``)."""
    import re

    return re.sub(r"[^\w\-. :/]", ".", tag)


def _client(uri: str):
    if uri.startswith("file:") or "://" not in uri:  # MLflow >= 3.7 refuses its file store unless told it may
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def check_mlflow(uri: str):
    """An MLflow client for ``uri`` that has answered (a ConfigError naming output.mlflow otherwise): a file store's
    directory must be writable, a server must answer within a few seconds."""
    field = "output.mlflow"
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(field, "needs MLflow: pip install mlflow-skinny (or raysim[tracking])")
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(field, f"must be a tracking URI (file:///path/mlruns, http://host:5000), got {uri!r}")
    if uri.startswith("file:") or "://" not in uri:
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        from raysim.io.rundir import check_writable

        path = url2pathname(urlparse(uri).path) if uri.startswith("file:") else uri
        check_writable(Path(path), field)
    elif uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
        try:
            urllib.request.urlopen(probe, timeout=5).close()
        except urllib.error.HTTPError:
            pass  # the server answered (an auth or method error is the client's to report, with its own words)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise ConfigError(field, f"cannot reach the MLflow server {uri} ({reason}); start it or fix the URI") \
                from None
    client = _client(uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as e:
        text = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(field, f"cannot use the MLflow tracking URI {uri}: {text}") from None
    return client


def check_tensorboard(log_dir) -> None:
    field = "output.tensorboard"
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(field, "needs TensorBoard: pip install tensorboard (or raysim[tracking])")
    if not isinstance(log_dir, str) or not log_dir.strip():
        raise ConfigError(field, f"must be a directory for the event files, got {log_dir!r}")
    from raysim.io.rundir import check_writable

    check_writable(Path(log_dir), field)


class WandbLogger(Callback):
    """Weights & Biases in offline mode (``output.wandb: DIR``; nothing leaves the machine, no account needed): one
    W&B run per raysim run under ``DIR/wandb/offline-run-*`` (project ``cfg.name``, named by the run id), the config,
    the same per-round rows and steps as the others, the result table as an artefact; ``wandb sync DIR/wandb/
    offline-run-*`` uploads it later. The run ends with exit code 0, or 1 when the raysim run fails."""

    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        self.wb_run = None

    def on_run_start(self, run) -> None:
        import wandb

        from raysim.config import to_dict

        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.wb_run = wandb.init(dir=str(self.root), project=run.cfg.name, name=run.run_id, config=to_dict(run.cfg),
                                 tags=[run.run_id[:64]], settings=settings)

    def _log(self, run, round_idx: int) -> None:
        rows = round_rows(run, round_idx)
        if rows:
            self.wb_run.log(rows, step=_step(round_idx))

    def on_setup_end(self, run) -> None:
        self._log(run, -1)

    def on_round_end(self, run, round_idx: int, evaluated: bool):
        self._log(run, round_idx)
        return None

    def on_run_end(self, run, result) -> None:
        import wandb

        with tempfile.TemporaryDirectory(prefix="raysim-wandb-") as tmp:
            artefact = wandb.Artifact("results", type="raysim-results")
            artefact.add_file(str(_write_table(result, Path(tmp))))  # copied into W&B's staging area here
            self.wb_run.log_artifact(artefact)
            self.wb_run.finish()
        self.wb_run = None

    def on_run_error(self, run, exc) -> None:
        if self.wb_run is not None:
            try:
                self.wb_run.finish(exit_code=1)
            except Exception:  # never hide the run's own error
                pass
            self.wb_run = None


def check_wandb(directory) -> None:
    field = "output.wandb"
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(field, "needs Weights & Biases: pip install wandb (or raysim[wandb])")
    if not isinstance(directory, str) or not directory.strip():
        raise ConfigError(field, f"must be a directory for the offline runs, got {directory!r}")
    from raysim.io.rundir import check_writable

    check_writable(Path(directory), field)


def trackers(cfg) -> list[Callback]:
    """The tracking callbacks the config asks for, each checked first (one ConfigError naming its key)."""
    out: list[Callback] = []
    if cfg.output.tensorboard is not None:
        check_tensorboard(cfg.output.tensorboard)
        out.append(TensorBoardLogger(cfg.output.tensorboard))
    if cfg.output.mlflow is not None:
        out.append(MLflowLogger(cfg.output.mlflow, check_mlflow(cfg.output.mlflow)))
    if cfg.output.wandb is not None:
        check_wandb(cfg.output.wandb)
        out.append(WandbLogger(cfg.output.wandb))
    return out
