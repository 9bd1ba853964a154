"""The hostile-input probe table, one list shared by tests/test_hostile.py (every probe is a test) and
benchmarks/hostile_probes.py (every probe a row of a Markdown table, with the outcome counts): what a new user might
type, and what raysim must answer. A probe runs the ``raysim`` command in-process (:func:`run_probe`) in a fresh
working directory (:func:`setup`: a valid config ``c.yaml`` with ``output.dir: out`` and the hostile files), optionally
with a finished run copied to ``runs/r`` and files of its own (``prep``), and is judged by :func:`verdict`: the exit
code it should give, exactly one line on stderr (notices aside) naming the key or file and holding the expected text,
no traceback, no raw control character, and the directory tree unchanged unless the probe is one that writes."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import yaml

from tests.conftest import tiny_config


def laughs(depth: int = 9) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    prev = "a"
    for n in "bcdefghijklmnop"[: depth - 1]:
        lines.append(f"{n}: &{n} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = n
    return "\n".join(lines) + "\n"


def setup(w: Path) -> None:
    """The working directory every probe starts from: a valid config (output.dir: out) and the hostile files."""
    cfg = tiny_config(data__val_fraction=0.25)
    cfg["output"] = {"dir": "out", "progress": False}
    (w / "c.yaml").write_text(yaml.safe_dump(cfg))
    (w / "laughs.yaml").write_text(laughs())
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


def tree(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@dataclasses.dataclass(frozen=True)
class Probe:
    id: str
    argv: list
    names: Optional[str]  # the field or file the one line must name (None: no line at all, the command succeeds)
    text: str = ""  # more text the line must hold
    code: int = 2  # the exit code it must give
    with_run: bool = False  # a finished run is copied to runs/r first
    prep: Optional[Callable] = None  # prep(w) -> cleanup or None: files (or state) of its own, before the tree is taken
    writes: bool = False  # the probe may change the tree (a run that finishes, a run kept whole)


TUNE = ["tune", "c.yaml", "--space", "space.yaml", "--trials", "1"]
RAY = ["run", "c.yaml", "--backend", "ray"]

_NO_RUN = [
    # 1. paths: values that become part of a path
    ("name-dotdot", ["run", "c.yaml", "--set", "name=../../x"], "'name'", "not a safe name"),
    ("name-slash", ["run", "c.yaml", "--set", "name=a/b"], "'name'", "not a safe name"),
    ("name-absolute", ["run", "c.yaml", "--set", "name=/tmp/x"], "'name'", "not a safe name"),
    ("name-hidden", ["run", "c.yaml", "--set", "name=.hidden"], "'name'", "not a safe name"),
    ("name-empty", ["run", "c.yaml", "--set", "name="], "'name'", "not a safe name"),
    ("name-inner-dotdot", ["run", "c.yaml", "--set", "name=x..y"], "'name'", "not a safe name"),
    ("name-space", ["run", "c.yaml", "--set", "name=a b"], "'name'", "not a safe name"),
    ("name-tilde", ["run", "c.yaml", "--set", "name=~root"], "'name'", "not a safe name"),
    ("name-backslash", ["run", "c.yaml", "--set", "name=a\\b"], "'name'", "not a safe name"),
    ("name-newline", ["run", "c.yaml", "--set", "name=\"a\\nb\""], "'name'", "not a safe name"),
    ("name-too-long", ["run", "c.yaml", "--set", "name=" + "a" * 101], "'name'", "not a safe name"),
    ("name-not-string", ["run", "c.yaml", "--set", "name=[1, 2]"], "'name'", "expected a string"),
    ("name-dry-run", ["run", "c.yaml", "--dry-run", "--set", "name=../x"], "'name'", "not a safe name"),
    ("study-name", TUNE + ["--study-name", "../../x"], "'--study-name'", "not a safe name"),
    # 2. YAML with bounds
    ("billion-laughs", ["run", "laughs.yaml"], "laughs.yaml", "billion laughs"),
    ("deep-nesting-parse", ["run", "deep.yaml"], "deep.yaml", "nested more than"),
    ("deep-nesting", ["run", "deep2.yaml"], "deep2.yaml", "nested more than"),
    ("too-large", ["run", "big.yaml"], "big.yaml", "more than the"),
    ("set-deep", ["run", "c.yaml", "--set", "data.partition_params=" + "[" * 40 + "]" * 40], "data.partition_params",
     "nested"),
    ("set-laughs", ["run", "c.yaml", "--set", "env={" + laughs().replace("\n", ", ").rstrip(", ") + "}"], "'env'",
     "billion laughs"),
    ("space-laughs", ["tune", "c.yaml", "--space", "laughs.yaml", "--trials", "1"], "laughs.yaml", "billion laughs"),
    # 3. config and space files that are not configs
    ("config-empty", ["run", "empty.yaml"], "empty.yaml", "is empty"),
    ("config-comments-only", ["run", "comments.yaml"], "comments.yaml", "is empty"),
    ("config-directory", ["run", "adir"], "adir", "is a directory"),
    ("config-binary", ["run", "bin.yaml"], "bin.yaml", "binary"),
    ("config-not-utf8", ["run", "latin1.yaml"], "latin1.yaml", "UTF-8"),
    ("config-device", ["run", "/dev/zero"], "/dev/zero", "not a regular file"),
    ("config-list", ["run", "list.yaml"], "list.yaml", "mapping"),
    ("config-missing", ["run", "nope.yaml"], "nope.yaml", "not found"),
    ("space-empty", ["tune", "c.yaml", "--space", "empty.yaml", "--trials", "1"], "empty.yaml", "is empty"),
    ("space-directory", ["tune", "c.yaml", "--space", "adir", "--trials", "1"], "--space", "is a directory"),
    # 4. tuning storage
    ("storage-scheme", TUNE + ["--storage", "mongodb://h/db"], "--storage", "not supported"),
    ("storage-driver", TUNE + ["--storage", "postgresql+psycopg2://u:p@127.0.0.1:1/db"], "--storage",
     "not installed"),
    ("storage-refused", TUNE + ["--storage", "postgresql://u:p@127.0.0.1:1/db"], "--storage", "127.0.0.1:1"),
    ("storage-unknown-host", TUNE + ["--storage", "postgresql://u:p@nohost.invalid/db"], "--storage", "unknown host"),
    ("storage-sqlite-dir", TUNE + ["--storage", "sqlite:///adir"], "--storage", "is a directory"),
    ("storage-sqlite-not-db", TUNE + ["--storage", "sqlite:///c.yaml"], "--storage", "not a SQLite database"),
    ("storage-journal-damaged", TUNE + ["--storage", "bad.log"], "--storage", "damaged"),
    ("storage-journal-dir", TUNE + ["--storage", "journal:adir"], "--storage", "is a directory"),
    ("storage-under-file", TUNE + ["--storage", "journal:c.yaml/x.log"], "--storage", "not a directory"),
    ("storage-not-url", TUNE + ["--storage", "foo.txt"], "--storage", "not a storage URL"),
    ("storage-empty", TUNE + ["--storage", ""], "--storage", "empty"),
    # 5. clusters
    ("address-refused", RAY + ["--set", "backend.address=127.0.0.1:1"], "backend.address", "Connection refused"),
    ("address-unknown-host", RAY + ["--set", "backend.address=nohost.invalid:6379"], "backend.address",
     "unknown host"),
    ("address-not-hostport", RAY + ["--set", "backend.address=http://x"], "backend.address", "HOST:PORT"),
    ("address-no-port", RAY + ["--set", "backend.address=10.0.0.1"], "backend.address", "HOST:PORT"),
    ("address-empty", RAY + ["--set", "backend.address=' '"], "backend.address", "empty"),
    ("connect-timeout-zero", ["run", "c.yaml", "--set", "backend.connect_timeout_s=0"], "backend.connect_timeout_s",
     "> 0"),
    # 6. listing and reporting what is not there
    ("runs-on-file", ["runs", "c.yaml"], "c.yaml", "not a directory"),
    ("report-missing", ["report", "nope", "--out", "rep"], "nope", "no result table"),
    ("resume-missing", ["run", "c.yaml", "--resume", "nope"], "resume", "no checkpoints"),
    # 7. sizes: true at the boundaries, values never capped silently
    ("iid-too-many-clients", ["run", "c.yaml", "--set", "data.partition=iid", "--set", "data.partition_params={}",
                              "--set", "data.num_clients=50000"], "data.num_clients", "50000 clients exceed"),
    ("iid-zero-samples", ["run", "c.yaml", "--set", "data.partition=iid", "--set",
                          "data.partition_params={samples_per_client: 0}"], "samples_per_client", "must be > 0"),
    ("kshot-zero-shots", ["run", "c.yaml", "--set", "data.partition_params.shots=0"], "shots", "must be > 0"),
    ("actors-capped-error", ["run", "c.yaml", "--dry-run", "--backend", "ray", "--set", "backend.num_actors=10",
                             "--set", "backend.num_cpus=1000"], "backend.num_actors",
     "backend.num_actors=10 capped at data.num_clients"),
    # 8. memory
    ("seeds-huge", ["run", "c.yaml", "--seeds", "1-100000000000"], "--seeds", "more than"),
    ("model-huge", ["run", "c.yaml", "--set", "model.params.hidden=1000000000"], "model.params", "parameters"),
    ("clients-huge", ["run", "c.yaml", "--set", "data.num_clients=100000000000"], "data.num_clients", "exceeds"),
    # 9. data roots that are not data
    ("files-no-config-json", ["run", "c.yaml", "--set", "data.partition=files", "--set",
                              "data.partition_params={root: nosplit}"], "data.partition_params.root", "config.json"),
    ("fashion-root-file", ["run", "c.yaml", "--set", "data.dataset=fashion_mnist", "--set", "data.root=c.yaml"],
     "data.root", "not a directory"),
    ("trace-binary", ["run", "c.yaml", "--set", "env.trace.devices=bin.yaml"], "env.trace.devices", "bin.yaml"),
]

_WITH_RUN = [
    ("report-out-is-file", ["report", "runs", "--out", "c.yaml", "--no-plots"], "--out", "is a file"),
    ("report-out-unwritable", ["report", "runs", "--out", "/proc/raysim-x", "--no-plots"], "--out", "cannot write"),
    ("report-tuned-on-not-tune", ["report", "runs", "--tuned-on", "c.yaml", "--no-plots", "--out", "rep"],
     "--tuned-on", "no trials.parquet"),
    ("report-unknown-metric", ["report", "runs", "--metric", "nope", "--no-plots", "--out", "rep"], "'nope'",
     "no client metric"),
    ("report-unknown-time-metric", ["report", "runs", "--time-metric", "nope", "--no-plots", "--out", "rep"], "'nope'",
     "no total"),
    ("report-not-a-table", ["report", "runs/r/config.yaml", "--out", "rep"], "config.yaml", "cannot read"),
    ("resume-a-file", ["run", "c.yaml", "--resume", "c.yaml"], "resume", "no checkpoints"),
    ("resume-finished-without-checkpoints", ["run", "c.yaml", "--resume", "runs/r"], "resume", "no checkpoints"),
    ("out-is-file", ["run", "c.yaml", "--out", "c.yaml"], "--out", "is a file"),
    ("set-no-key", ["run", "c.yaml", "--set", "=5"], "=5", "needs a key"),
]


# ---------------------------------------------------------------------------------------------------------------
# the probes' own files and state (each returns its cleanup, or None)

def _module(name: str, source: str) -> Callable:
    """prep: a user module ``name.py`` in the working directory (forgotten again afterwards: sys.modules, sys.path)."""
    def prep(w: Path):
        (w / f"{name}.py").write_text(source)

        def cleanup():
            sys.modules.pop(name, None)
            while str(w) in sys.path:
                sys.path.remove(str(w))
        return cleanup
    return prep


_ARRAYS = ("    import numpy as np\n"
           "    r = np.random.default_rng(0)\n"
           "    return {'x_train': r.normal(size=(60, 1, 8, 8)).astype('float32'), 'y_train': np.arange(60) % 3,\n"
           "            'x_test': r.normal(size=(30, 1, 8, 8)).astype('float32'), 'y_test': np.arange(30) % 3}\n")
UNMARKED = "def load(root):\n" + _ARRAYS
WRITER = "import raysim\n@raysim.dataset_loader\ndef load(root):\n    open('pwned.txt', 'w').write('x')\n" + _ARRAYS
SWALLOWER = ("import raysim\n@raysim.dataset_loader\ndef load(root):\n    try:\n        open('pwned.txt', 'w')\n"
             "    except OSError:\n        pass\n" + _ARRAYS)
METHOD_WRITER = ("from algorithms.fedavg import FedAvg\nclass W(FedAvg):\n    def validate(self):\n"
                 "        open('pwned.txt', 'w').close()\n")
IMPORT_WRITER = "import raysim\nopen('pwned.txt', 'w').close()\n@raysim.dataset_loader\ndef load(root):\n" + _ARRAYS


def _victim(w: Path):
    (w / "victim").mkdir()
    (w / "victim" / "thesis.tex").write_text("years of work\n")


def _symlink(name: str, target: str) -> Callable:
    def prep(w: Path):
        (w / name).symlink_to(target)
    return prep


def _empty_dir_and_link(w: Path):
    (w / "empty").mkdir()
    (w / "lnk").symlink_to("empty")


def _file(name: str, text: str) -> Callable:
    def prep(w: Path):
        (w / name).write_text(text)
    return prep


def _rewrite_table(w: Path, df, run: str = "r") -> None:
    """Replace a run's results.parquet with ``df`` and record the new digest in its run.json (so only the schema
    check can tell)."""
    import json

    from raysim.io.tables import file_sha256

    f = w / "runs" / run / "results.parquet"
    df.to_parquet(f, index=False)
    info = json.loads((f.parent / "run.json").read_text())
    info["results_sha256"] = file_sha256(f)
    (f.parent / "run.json").write_text(json.dumps(info))


def _value_strings(run: str = "r") -> Callable:
    def prep(w: Path):
        import pandas as pd

        if run != "r":
            shutil.copytree(w / "runs" / "r", w / "runs" / run)
        df = pd.read_parquet(w / "runs" / run / "results.parquet")
        _rewrite_table(w, df.assign(value=df["value"].map(lambda v: f"{v:.3f}")), run)
    return prep


def _other_columns(w: Path):
    import pandas as pd

    _rewrite_table(w, pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}))


def _digest_not_string(w: Path):
    import json

    f = w / "runs" / "r" / "run.json"
    info = json.loads(f.read_text())
    info["results_sha256"] = 12345
    f.write_text(json.dumps(info))


def _sqlite_locked(w: Path):
    """study.db held in an exclusive transaction by another connection (as another process would)."""
    import sqlite3

    from tuning import storage

    con = sqlite3.connect(str(w / "study.db"), isolation_level=None)
    con.execute("CREATE TABLE t (x)")
    con.execute("BEGIN EXCLUSIVE")
    saved = storage.SQLITE_CHECK_TIMEOUT_S
    storage.SQLITE_CHECK_TIMEOUT_S = 0.3

    def cleanup():
        storage.SQLITE_CHECK_TIMEOUT_S = saved
        con.execute("ROLLBACK")
        con.close()
    return cleanup


def _sigterm_after_checkpoint(w: Path):
    """SIGTERM to this process (as a scheduler sends it) once the run has written its second round checkpoint."""
    import signal
    import time

    stop = threading.Event()
    mark = w / "t.incomplete" / "checkpoints" / "round_00001" / "meta.pt"

    def kill():
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            if mark.exists():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.02)

    t = threading.Thread(target=kill, daemon=True)
    t.start()

    def cleanup():
        stop.set()
        t.join()
    return cleanup


def _rename_fails(w: Path):
    """The final rename of a finished run fails (another file system, a race): every other rename still works."""
    import errno

    real = os.rename

    def rename(src, dst, *a, **k):
        if str(src).endswith(".incomplete"):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return real(src, dst, *a, **k)

    os.rename = rename

    def cleanup():
        os.rename = real
    return cleanup


def _escape_name(w: Path):
    (w / "runs" / "\x1b[31mred").mkdir(parents=True)


ESC = "\x1b[2J\x1b[31m"

_NEW = [
    # 10. import paths call only what is meant to be loaded (issue 35)
    Probe("dataset-stdlib-rmtree-dry-run", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=shutil:rmtree",
                                            "--set", "data.root=victim"], "data.dataset", "standard library",
          prep=_victim),
    Probe("dataset-os-system", ["run", "c.yaml", "--set", "data.dataset=os:system", "--set",
                                "data.root=touch pwned.txt"], "data.dataset", "standard library"),
    Probe("dataset-subprocess", ["run", "c.yaml", "--set", "data.dataset=subprocess:getoutput", "--set",
                                 "data.root=touch pwned.txt"], "data.dataset", "standard library"),
    Probe("dataset-builtins-exec", ["run", "c.yaml", "--set", "data.dataset=builtins:exec", "--set",
                                    "data.root=open('pwned.txt', 'w')"], "data.dataset", "standard library"),
    Probe("dataset-stdlib-never-imported", ["run", "c.yaml", "--set", "data.dataset=antigravity:fly"], "data.dataset",
          "standard library"),
    Probe("dataset-installed-function", ["run", "c.yaml", "--set", "data.dataset=numpy:save", "--set",
                                         "data.root=pwned"], "data.dataset", "not marked as a dataset loader"),
    Probe("dataset-through-a-module-global", ["run", "c.yaml", "--set", "data.dataset=raysim.io.rundir:shutil.rmtree",
                                              "--set", "data.root=victim"], "data.dataset", "not marked",
          prep=_victim),
    Probe("dataset-unmarked-user-function", ["run", "c.yaml", "--set", "data.dataset=um35:load"], "data.dataset",
          "@raysim.dataset_loader", prep=_module("um35", UNMARKED)),
    Probe("public-dataset-stdlib", ["run", "c.yaml", "--set", "data.public={dataset: 'shutil:rmtree', size: 10}",
                                    "--set", "algorithm.name=fedmd"], "shutil:rmtree", "standard library"),
    Probe("model-stdlib", ["run", "c.yaml", "--set", "model.arch=os:system", "--set", "model.params={}"], "model.arch",
          "standard library"),
    Probe("model-installed-function", ["run", "c.yaml", "--set", "model.arch=numpy:zeros", "--set", "model.params={}"],
          "model.arch", "not marked as a model factory"),
    Probe("model-torchvision-helper", ["run", "c.yaml", "--set", "model.arch=torchvision.models:get_model_weights",
                                       "--set", "model.params={}"], "model.arch", "not marked as a model factory"),
    Probe("per-client-model-stdlib", ["run", "c.yaml", "--set", "model.per_client=[{arch: 'os:system'}]"],
          "model.per_client[0].arch", "standard library"),
    Probe("model-torchvision-builder-dry-run", ["run", "c.yaml", "--dry-run", "--set",
                                                "model.arch=torchvision.models:resnet18", "--set", "model.params={}"],
          None, code=0),
    Probe("algorithm-stdlib", ["run", "c.yaml", "--set", "algorithm.name=shutil:rmtree"], "algorithm.name",
          "standard library"),
    Probe("algorithm-control-characters", ["run", "c.yaml", "--set", "algorithm.name=x\x1b[31m:y"], "algorithm.name",
          "\\x1b[31m"),
    Probe("algorithm-installed-function", ["run", "c.yaml", "--set", "algorithm.name=numpy:save"], "algorithm.name",
          "not a subclass of raysim.algorithm.Algorithm"),
    # 11. a dry run writes nothing, whoever's code runs
    Probe("dry-run-loader-writes", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=wr35:load"], "data.dataset",
          "tried to open 'pwned.txt' for writing", prep=_module("wr35", WRITER)),
    Probe("dry-run-loader-swallows-refusal", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=sw35:load"],
          "data.dataset", "tried to open 'pwned.txt' for writing", prep=_module("sw35", SWALLOWER)),
    Probe("dry-run-module-writes-on-import", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=iw35:load"],
          "data.dataset", "importing 'iw35' tried to open", prep=_module("iw35", IMPORT_WRITER)),
    Probe("dry-run-method-writes", ["run", "c.yaml", "--dry-run", "--set", "algorithm.name=mw35:W"],
          "algorithm.name", "the method mw35:W tried to open 'pwned.txt'", prep=_module("mw35", METHOD_WRITER)),
    # 12. --out in every form: resolved and checked before any data loads
    Probe("out-root", ["run", "c.yaml", "--out", "/"], "--out", "root of the file system"),
    Probe("out-dotdot", ["run", "c.yaml", "--out", ".."], "--out", "holding other files, not a run"),
    Probe("out-dot", ["run", "c.yaml", "--out", "."], "--out", "holding other files, not a run"),
    Probe("out-dry-run-dotdot", ["run", "c.yaml", "--dry-run", "--out", ".."], "--out", "holding other files"),
    Probe("out-symlink-loop", ["run", "c.yaml", "--out", "loop"], "--out", "symbolic links",
          prep=_symlink("loop", "loop")),
    Probe("out-incomplete-name", ["run", "c.yaml", "--out", "x.incomplete"], "--out", "unfinished run"),
    Probe("out-under-file", ["run", "c.yaml", "--out", "c.yaml/x"], "--out", "is a file"),
    Probe("out-control-characters", ["run", "c.yaml", "--out", f"c.yaml/{ESC}x"], "--out", "\\x1b[2J"),
    Probe("out-symlink-to-empty-dir", ["run", "c.yaml", "--set", "rounds=1", "--out", "lnk"], None, code=0,
          prep=_empty_dir_and_link, writes=True),
    Probe("out-dangling-symlink", ["run", "c.yaml", "--set", "rounds=1", "--out", "dangling"], None, code=0,
          prep=_symlink("dangling", "nowhere"), writes=True),
    Probe("out-final-rename-fails", ["run", "c.yaml", "--set", "rounds=1", "--out", "t"], "t.incomplete",
          "nothing is lost", code=1, prep=_rename_fails, writes=True),
    # 13. values: NaN and infinity, duplicate keys, directories that are files
    Probe("lr-nan", ["run", "c.yaml", "--set", "train.lr=.nan"], "train.lr", "finite number"),
    Probe("lr-nan-quoted", ["run", "c.yaml", "--set", "train.lr='.nan'"], "train.lr", "finite number"),
    Probe("lr-inf", ["run", "c.yaml", "--set", "train.lr=.inf"], "train.lr", "finite number"),
    Probe("method-param-nan", ["run", "c.yaml", "--set", "algorithm.params.lam=.nan"], "algorithm.params.lam",
          "finite number"),
    Probe("partition-param-inf", ["run", "c.yaml", "--set", "data.partition_params.stdev=-.inf"],
          "data.partition_params.stdev", "finite number"),
    Probe("model-param-nan", ["run", "c.yaml", "--set", "model.params.dropout=.nan"], "model.params.dropout",
          "finite number"),
    Probe("yaml-duplicate-key", ["run", "dup.yaml"], "dup.yaml", "given twice",
          prep=_file("dup.yaml", "name: a\nseed: 1\nseed: 2\n")),
    Probe("set-duplicate-key", ["run", "c.yaml", "--set", "train={lr: 0.1, lr: 0.5}"], "'train'", "given twice"),
    Probe("state-dir-is-file", ["run", "c.yaml", "--set", "backend.state_dir=c.yaml"], "backend.state_dir",
          "is a file"),
    Probe("state-dir-under-file", ["run", "c.yaml", "--dry-run", "--set", "backend.state_dir=c.yaml/s"],
          "backend.state_dir", "is a file"),
    # 14. storage locked, not damaged
    Probe("storage-sqlite-locked", TUNE + ["--storage", "sqlite:///study.db"], "--storage",
          "locked by another process", prep=_sqlite_locked),
    # 15. SIGTERM as Ctrl-C: checkpoints kept, resumable, one line
    Probe("sigterm-keeps-checkpoints", ["run", "c.yaml", "--out", "t", "--set", "rounds=100000", "--set",
                                        "output.checkpoint_every=1"], "SIGTERM", "--resume t.incomplete", code=143,
          prep=_sigterm_after_checkpoint, writes=True),
]

_NEW_WITH_RUN = [
    Probe("report-value-strings", ["report", "runs/r", "--out", "rep", "--no-plots"], "results.parquet",
          "value holds string", with_run=True, prep=_value_strings()),
    Probe("report-healthy-beside-damaged", ["report", "runs", "--out", "rep", "--no-plots"], "bad/results.parquet",
          "skipped a damaged run", code=0, with_run=True, prep=_value_strings("bad"), writes=True),
    Probe("report-other-columns", ["report", "runs/r", "--out", "rep", "--no-plots"], "results.parquet",
          "not a raysim result table", with_run=True, prep=_other_columns),
    Probe("report-digest-not-a-string", ["report", "runs/r", "--out", "rep", "--no-plots"], "run.json",
          "not a sha256 digest", with_run=True, prep=_digest_not_string),
    Probe("out-holds-a-finished-run", ["run", "c.yaml", "--set", "rounds=1", "--out", "runs/r"], "runs/r",
          "holds a finished run", code=0, with_run=True, writes=True),
]

PROBES = [Probe(*p) for p in _NO_RUN] + _NEW + [Probe(*p, with_run=True) for p in _WITH_RUN] + _NEW_WITH_RUN


# ---------------------------------------------------------------------------------------------------------------
# running and judging a probe

def run_probe(p: Probe, base: Path, finished_run: Optional[Path] = None) -> tuple[int, str, bool]:
    """Run probe ``p`` in a fresh working directory ``base/work``: (exit code, stderr, whether the tree under
    ``base`` changed). ``finished_run``: a run directory copied to ``runs/r`` for probes ``with_run``."""
    from raysim.app.cli import main

    w = Path(base) / "work"
    w.mkdir(parents=True)
    setup(w)
    if p.with_run:
        shutil.copytree(finished_run, w / "runs" / "r")
    cwd = os.getcwd()
    os.chdir(w)
    cleanup = None
    try:
        cleanup = p.prep(w) if p.prep else None
        before = tree(Path(base))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(list(p.argv))
        changed = tree(Path(base)) != before
    finally:
        if cleanup:
            cleanup()
        os.chdir(cwd)
    return code, err.getvalue(), changed


def lines_of(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")]


def verdict(p: Probe, code: int, err: str, changed: bool) -> Optional[str]:
    """None when the probe ended as specified, else what differs."""
    lines = lines_of(err)
    if "Traceback" in err:
        return "a traceback"
    if any(ord(c) < 0x20 and c not in "\n\t" or c == "\x7f" for c in err):
        return "a raw control character reached the terminal"
    if code != p.code:
        return f"exit {code}, not {p.code}"
    if p.names is None:
        if lines:
            return f"{len(lines)} line(s), none expected"
    else:
        if len(lines) != 1:
            return f"{len(lines)} lines, not one"
        if p.names not in lines[0] or p.text not in lines[0]:
            return f"the line does not hold {p.names!r} and {p.text!r}"
    if changed and not p.writes:
        return "the directory tree changed"
    return None
