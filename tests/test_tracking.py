"""Experiment tracking (raysim/engine/tracking.py): TensorBoard event files read back with TensorBoard's own reader,
an MLflow file store read back with MLflow's client; the same rows on the Ray backend (callbacks run in the driver:
tests/test_ray_backend.py::test_failures_identical_on_ray compares the TensorBoard scalars of both backends);
an unreachable MLflow server or an unwritable directory is one line naming the key, before any run directory."""
import io

import pytest

from raysim.app.cli import main
from raysim.config import make_config
from raysim.engine.loop import run_experiment
from tests.conftest import tiny_config

pytest.importorskip("tensorboard")


def scalars(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0,
                                                                          event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def _mean_rows(table, metric):
    t = table[(table["scope"] == "mean") & (table["metric"] == metric)].sort_values("round")
    return [(int(r) + 1, float(v)) for r, v in zip(t["round"], t["value"])]


def test_tensorboard_events_hold_every_rounds_metrics_the_config_and_the_table(tmp_path):
    cfg = make_config(tiny_config(rounds=2, output={"progress": False, "tensorboard": str(tmp_path / "tb")}))
    res = run_experiment(cfg, write=False)
    run_dir = tmp_path / "tb" / res.run_id
    acc = scalars(run_dir)
    want = _mean_rows(res.table, "test_acc")
    assert [e.step for e in acc.Scalars("test_acc")] == [1, 2]  # steps: rounds completed
    assert [e.value for e in acc.Scalars("test_acc")] == pytest.approx([v for _, v in want], rel=1e-6)  # float32
    assert [e.step for e in acc.Scalars("total/up_bytes")] == [1, 2]
    texts = acc.Tags()["tensors"]
    assert "config/text_summary" in texts and "final/text_summary" in texts
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "algorithm.params.lam: 1.0" in config_text and "data.num_clients: 6" in config_text
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")  # the config in TensorBoard's HParams tab
    import pandas as pd

    table = pd.read_parquet(run_dir / "results.parquet")
    assert len(table) == len(res.table)


def test_mlflow_file_store_gets_params_metrics_and_the_table(tmp_path):
    pytest.importorskip("mlflow")
    from raysim.engine.tracking import _client

    uri = (tmp_path / "mlruns").as_uri()
    cfg = make_config(tiny_config(rounds=2, output={"progress": False, "mlflow": uri}))
    res = run_experiment(cfg, write=False)
    client = _client(uri)
    exp = client.get_experiment_by_name("tiny")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == res.run_id and run.info.status == "FINISHED"
    assert run.data.params["algorithm.params.lam"] == "1.0" and run.data.params["rounds"] == "2"
    hist = client.get_metric_history(run.info.run_id, "test_acc")
    assert sorted((m.step, m.value) for m in hist) == _mean_rows(res.table, "test_acc")
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["results.parquet"]


def test_unreachable_mlflow_is_one_line_naming_the_key_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(tiny_config(rounds=1)))
    out = tmp_path / "run"
    code = main(["run", str(cfg), "--out", str(out), "--set", f"output.mlflow=http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "output.mlflow" in err[0] and "cannot reach" in err[0]
    assert not out.exists() and not list(tmp_path.glob("run*"))


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_unwritable_tracking_dir_is_one_line(tmp_path, capsys, key):
    import yaml

    if key == "wandb":
        pytest.importorskip("wandb")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(rounds=1)))
    code = main(["run", str(cfg), "--out", str(tmp_path / "run"), "--set", f"output.{key}={blocker}/tb"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"output.{key}" in err[0]
    assert not (tmp_path / "run").exists()


def test_progress_lines_when_not_a_terminal():
    """Not a terminal (a log file): one line per evaluated round, no carriage returns."""
    from raysim.engine.callbacks import ProgressBar, ProgressLines, progress_callback

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress_callback(True, ("test_acc",), Tty()), ProgressBar)
    assert isinstance(progress_callback("lines", ("test_acc",), Tty()), ProgressLines)
    assert progress_callback(False, ("test_acc",)) is None
    log = io.StringIO()
    cb = progress_callback(True, ("test_acc", "test_acc_proto"), log)
    assert isinstance(cb, ProgressLines)
    run_experiment(make_config(tiny_config(rounds=4, eval={"every": 2})), write=False, callbacks=[cb])
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 3  # the start, rounds 2 and 4 (the evaluated ones)
    assert lines[1].startswith("tiny s7 round 2/4: acc 0.") and "acc_proto 0." in lines[1]
    assert lines[2].startswith("tiny s7 round 4/4: ")


def _wandb_records(path):
    """The records of a W&B offline run file (``run-<id>.wandb``: a ':W&B' header, then LevelDB-log blocks of
    32 KiB, each record a 7-byte header (crc, length, type: full / first / middle / last) and a protobuf)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:
            pos += left
            continue
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


def test_wandb_offline_run_holds_every_rounds_metrics_the_config_and_the_table(tmp_path):
    pytest.importorskip("wandb")
    import json

    cfg = make_config(tiny_config(rounds=2, output={"progress": False, "wandb": str(tmp_path / "wb")}))
    res = run_experiment(cfg, write=False)
    (f,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    recs = {}
    for r in _wandb_records(f):
        recs.setdefault(r.WhichOneof("record_type"), []).append(r)
    (run,) = recs["run"]
    assert run.run.display_name == res.run_id and run.run.project == "tiny"
    config = {i.key: json.loads(i.value_json) for i in run.run.config.update}
    assert config["algorithm"]["params"]["lam"] == 1.0 and config["data"]["num_clients"] == 6
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.history.item}
               for h in recs["history"]]
    got = [(h["_step"], h["test_acc"]) for h in history if "test_acc" in h]
    assert got == pytest.approx(_mean_rows(res.table, "test_acc"))  # steps: rounds completed, as TensorBoard's
    assert [a.artifact.name for a in recs["artifact"]] == ["results"]
    assert [m.path for m in recs["artifact"][0].artifact.manifest.contents] == ["results.parquet"]
    assert recs["exit"][0].exit.exit_code == 0
