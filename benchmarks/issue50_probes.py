"""Issue 50's hostile probes, run as a user would: each is ``python -m raysim ...`` in a fresh temporary directory
holding a tiny valid config ``c.yaml`` (synthetic data, 6 clients, ``mlp``, 2 rounds, sequential) and the hostile
files it needs; a probe that does not return within its bound is killed (a hang). Prints one Markdown row per probe
and the count per grade:

    python benchmarks/issue50_probes.py                  # this checkout
    PROBE_CODE=/path/to/other/checkout python benchmarks/issue50_probes.py   # another version (before/after)

Grades: **exemplary** — the expected exit code (2 bad input, 1 run-time fault, 0 the forms that must work), exactly
one line (``raysim: note:`` notices aside) naming the key, file or resource, no traceback, nothing written, deleted
or run that the probe forbids; **acceptable** — the right exit code and text, but more lines; **poor** — the run
is refused or stopped, but late, with a traceback or without naming the cause (or a success without the notice it
owes); **bug** — a wrong result with exit 0, a hang, a program run, a file written or deleted that must not be."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(os.environ.get("PROBE_CODE", str(ROOT)))


def tiny(**over) -> dict:
    cfg = {"name": "tiny", "seed": 7, "rounds": 2,
           "data": {"dataset": "synthetic", "num_clients": 6, "partition": "nway_kshot",
                    "partition_params": {"ways": 3, "shots": 10, "stdev": 1, "test_shots": 5}},
           "model": {"arch": "mlp", "params": {"hidden": 32, "embed_dim": 16}},
           "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
           "algorithm": {"name": "fedproto", "params": {"lam": 1.0}},
           "backend": {"name": "sequential"}, "output": {"progress": False, "dir": "out"}}
    for key, value in over.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


@dataclass
class Probe:
    id: str
    argv: list
    code: int  # the exit code a specified outcome has
    text: str = ""  # what its one line must name
    setup: Optional[Callable] = None  # setup(dir) -> None
    forbid: tuple = ()  # paths (relative) that must not exist afterwards
    keep: tuple = ()  # paths that must still exist afterwards (with the same bytes)
    bound_s: float = 120
    writes: bool = False  # a probe whose run may write (out/)
    check: Optional[Callable] = None  # check(dir, stdout, stderr) -> problem or None
    env: dict = field(default_factory=dict)


def write(d: Path, name: str, text) -> None:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)


def cfg_file(name: str = "c.yaml", **over):
    return lambda d: write(d, name, yaml.safe_dump(tiny(**over)))


def both(*fns):
    def run(d):
        for f in fns:
            f(d)
    return run


LOADER = '''
import numpy as np
import raysim


@raysim.dataset_loader
def arrays(root=None):
    r = np.random.default_rng(0)
    return {"x_train": r.normal(size=(60, 1, 8, 8)).astype("float32"), "y_train": np.arange(60) % 3,
            "x_test": r.normal(size=(30, 1, 8, 8)).astype("float32"), "y_test": np.arange(30) % 3}
'''

FAILING = '''
from algorithms.fedproto import FedProto


class Failing(FedProto):
    FAIL = {FAIL}
    ERROR = {ERROR}

    def client_update(self, payload, state, data, ctx):
        if ctx.client_id in self.FAIL and ctx.round_idx >= 1:  # after round 0's checkpoint
            raise self.ERROR
        return super().client_update(payload, state, data, ctx)
'''


def failing(fail, error: str):
    return lambda d: write(d, "um50fail.py", FAILING.replace("{FAIL}", repr(set(fail))).replace("{ERROR}", error))


def mount_full_tmpfs(d: Path) -> None:
    disk = d / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        raise RuntimeError("cannot mount a tmpfs here")
    with open(disk / "fill", "wb", buffering=0) as f:
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def leaf(doc: dict):
    def run(d):
        for split in ("train", "test"):
            write(d, f"leaf/{split}/all.json", json.dumps(doc))
    return run


def images_with_fifo(d: Path) -> None:
    from PIL import Image

    for split in ("train", "test"):
        for c in ("a", "b"):
            (d / "imgs" / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new("L", (8, 8), color=40 * i).save(d / "imgs" / split / c / f"{i}.png")
    os.mkfifo(d / "imgs" / "train" / "a" / "9.png")


def finished_run(d: Path, fifo: Optional[str] = None, unfinished: bool = False) -> None:
    """A finished two-round run with checkpoints in runs/r (made with the code under test)."""
    write(d, "r.yaml", yaml.safe_dump(tiny(output={"progress": False, "checkpoint_every": 1})))
    subprocess.run([sys.executable, "-m", "raysim", "run", "r.yaml", "--out", "runs/r"], cwd=d, env=_env(),
                   capture_output=True, timeout=300, check=True)
    run = d / "runs" / "r"
    if unfinished:
        run = run.rename(d / "runs" / "r.incomplete")
        (run / "results.parquet").unlink()
    if fifo:
        target = run / fifo if fifo != "meta.pt" else sorted((run / "checkpoints").glob("round_*"))[-1] / "meta.pt"
        target.unlink()
        os.mkfifo(target)


def sqlite_app(d: Path) -> None:
    import sqlite3

    con = sqlite3.connect(d / "app.db")
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.commit()
    con.close()


def plain_study(d: Path) -> None:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="theirs", storage=JournalStorage(JournalFileBackend(str(d / "s.log"))))


SPACE = yaml.safe_dump({"params": {"algorithm.params.lam": {"type": "float", "low": 0.1, "high": 2.0}},
                        "objective": {"metric": "val_acc"}})
ASYNC = dict(server={"mode": "async", "concurrency": 2, "buffer_size": 1}, algorithm={"name": "fedavg"})
USER = dict(data={"dataset": "um50:arrays", "num_clients": 3, "partition": "iid", "partition_params": {}},
            algorithm={"name": "fedavg"}, model={"arch": "mlp", "params": {"hidden": 8}})
RUN_FILE = "open('ran_by_ipython.txt', 'w').write('x')\n"  # IPython's command line would run a file named 'run'
ATEXIT = LOADER + "import atexit\n\n\n@atexit.register\ndef bye():\n    open('from_atexit.txt', 'w').write('x')\n"
THREAD = LOADER + '''
import threading
import time


def later():
    time.sleep(3)  # the dry run has printed its last line by now
    open("from_thread.txt", "w").write("x")
    t = threading.Thread(target=lambda: open("from_inner.txt", "w").write("x"))
    t.start()
    t.join()


threading.Thread(target=later).start()
'''
PKG_MAIN = "open('ran_main.txt', 'w').write('x')\n"


def dry_lines(limit: int):
    return lambda d, out, err: None if len(out.splitlines()) <= limit else f"{len(out.splitlines())} lines of output"


def kept_files(d, out, err):
    return None if (d / "out" / "keep.incomplete" / "thesis.tex").exists() else "deleted the user's files"


def notice_of_failures(d, out, err):
    return None if "failed and were skipped" in err else "no line says that clients failed"


PROBES = [
    # 1. faults have owners
    Probe("disk-full-under-state-dir", ["run", "c.yaml", "--set", "backend.state_dir=disk/st",
                                        "--set", "backend.state_memory_mb=0"], 1, "backend.state_dir",
          both(cfg_file(), mount_full_tmpfs)),
    Probe("half-population-memoryerror", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1, "memory",
          both(cfg_file(), failing([0, 1, 2], "MemoryError()"))),
    Probe("one-client-memoryerror", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1, "memory",
          both(cfg_file(), failing([4], "MemoryError()"))),
    Probe("allocator-error", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1, "memory",
          both(cfg_file(), failing([0], "RuntimeError('[enforce fail at alloc_cpu.cpp:114] . DefaultCPUAllocator: "
                                         "can\\'t allocate memory: you tried to allocate 9000000000 bytes')"))),
    Probe("cuda-oom-text", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1, "GPU memory",
          both(cfg_file(), failing([1], "RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')"))),
    Probe("enospc-in-user-code-is-machine", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1,
          "No space left", both(cfg_file(), failing([2], "OSError(28, 'No space left on device')"))),
    Probe("skipped-failure-said", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 0, "",
          both(cfg_file(), failing([2], "ValueError('my bug')")), writes=True, check=notice_of_failures),
    Probe("most-clients-fail", ["run", "c.yaml", "--set", "algorithm.name=um50fail:Failing"], 1, "max_failed_share",
          both(cfg_file(), failing([0, 1, 2, 3], "ValueError('my bug')"))),
    Probe("max-failed-share-bad", ["run", "c.yaml", "--set", "max_failed_share=2"], 2, "max_failed_share",
          cfg_file()),
    Probe("max-failed-share-bool", ["run", "c.yaml", "--set", "max_failed_share=true"], 2, "max_failed_share",
          cfg_file()),
    # 2. a config names code; nothing else runs
    Probe("ipython-main", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=IPython.__main__:x"], 2,
          "data.dataset", both(cfg_file(), lambda d: write(d, "run", RUN_FILE)), forbid=("ran_by_ipython.txt",)),
    Probe("f2py-main", ["run", "c.yaml", "--dry-run", "--set", "model.arch=numpy.f2py.__main__:x"], 2, "model.arch",
          cfg_file()),
    Probe("tqdm-main", ["run", "c.yaml", "--set", "model.arch=tqdm.__main__:x"], 2, "model.arch", cfg_file()),
    Probe("flask-main", ["run", "c.yaml", "--set", "data.dataset=flask.__main__:x"], 2, "data.dataset", cfg_file()),
    Probe("own-package-main", ["run", "c.yaml", "--set", "model.arch=um50pkg.__main__:x"], 2, "model.arch",
          both(cfg_file(), lambda d: write(d, "um50pkg/__init__.py", ""),
               lambda d: write(d, "um50pkg/__main__.py", PKG_MAIN)), forbid=("ran_main.txt",)),
    Probe("module-raises-systemexit-0", ["run", "c.yaml", "--dry-run"], 2, "data.dataset",
          both(cfg_file(**USER), lambda d: write(d, "um50.py", "raise SystemExit(0)\n"))),
    Probe("module-raises-systemexit-3", ["run", "c.yaml"], 2, "data.dataset",
          both(cfg_file(**USER), lambda d: write(d, "um50.py", "import sys\nsys.exit(3)\n"))),
    Probe("segmentation-builder-weights", ["run", "c.yaml", "--dry-run", "--set",
                                           "model.arch=torchvision.models.segmentation:lraspp_mobilenet_v3_large",
                                           "--set", "model.params={}"], 2, "model.arch", cfg_file(),
          forbid=("torch",), env={"TORCH_HOME": "torch"}),
    # 3. a dry run writes nothing, ever
    Probe("dry-run-atexit", ["run", "c.yaml", "--dry-run"], 0, "", both(cfg_file(**USER),
                                                                        lambda d: write(d, "um50.py", ATEXIT)),
          forbid=("from_atexit.txt",)),
    Probe("dry-run-thread", ["run", "c.yaml", "--dry-run"], 0, "", both(cfg_file(**USER),
                                                                        lambda d: write(d, "um50.py", THREAD)),
          forbid=("from_thread.txt", "from_inner.txt")),
    # 4. only code ships
    Probe("code-ssh-dir", ["run", "c.yaml", "--dry-run", "--set", "backend.name=ray", "--set", "backend.code=[.ssh]"],
          2, "backend.code[0]", both(cfg_file(), lambda d: write(d, ".ssh/id_rsa", "-----BEGIN KEY-----\n"))),
    Probe("code-key-file", ["run", "c.yaml", "--dry-run", "--set", "backend.name=ray",
                            "--set", "backend.code=[keys/id_ed25519]"], 2, "backend.code[0]",
          both(cfg_file(), lambda d: write(d, "keys/id_ed25519", "secret"))),
    Probe("code-package-with-pem", ["run", "c.yaml", "--dry-run", "--set", "backend.name=ray",
                                    "--set", "backend.code=[mypkg]"], 2, "server.pem",
          both(cfg_file(), lambda d: write(d, "mypkg/__init__.py", ""), lambda d: write(d, "mypkg/server.pem", "k"))),
    Probe("code-package-with-env", ["run", "c.yaml", "--dry-run", "--set", "backend.name=ray",
                                    "--set", "backend.code=[mypkg]"], 2, ".env",
          both(cfg_file(), lambda d: write(d, "mypkg/__init__.py", ""), lambda d: write(d, "mypkg/.env", "T=1"))),
    Probe("code-data-directory", ["run", "c.yaml", "--dry-run", "--set", "backend.name=ray",
                                  "--set", "backend.code=[data]"], 2, "no Python code",
          both(cfg_file(), lambda d: write(d, "data/x.csv", "1,2\n"))),
    # 5. raysim deletes only what it made
    Probe("foreign-incomplete-out", ["run", "c.yaml", "--out", "out/keep"], 0, "did not create it", both(
        cfg_file(), lambda d: write(d, "out/keep.incomplete/thesis.tex", "years of work")), writes=True,
        keep=("out/keep.incomplete/thesis.tex",), check=kept_files),
    # 6. every reader bounded
    Probe("fifo-image", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=imagefolder", "--set", "data.root=imgs",
                         "--set", "data.num_clients=2", "--set", "data.partition=iid", "--set",
                         "data.partition_params={}"], 2, "9.png", both(cfg_file(), images_with_fifo), bound_s=60),
    Probe("fifo-config-yaml-runs", ["runs", "runs"], 0, "", lambda d: finished_run(d, "config.yaml", True),
          bound_s=60, check=lambda d, out, err: None if "FIFO" in out else "the listing does not say what is wrong"),
    Probe("fifo-run-json-runs", ["runs", "runs"], 0, "", lambda d: finished_run(d, "run.json"), bound_s=60,
          check=lambda d, out, err: None if "FIFO" in out else "the listing does not say what is wrong"),
    Probe("fifo-meta-pt-resume", ["run", "r.yaml", "--set", "rounds=3", "--resume", "runs/r"], 2, "meta.pt",
          lambda d: finished_run(d, "meta.pt"), bound_s=60),
    Probe("leaf-users-int", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set", "data.root=leaf",
                             "--set", "data.partition=natural"], 2, "all.json",
          both(cfg_file(), leaf({"users": 5, "user_data": {}}))),
    Probe("leaf-x-int", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set", "data.root=leaf",
                         "--set", "data.partition=natural"], 2, "'u0'",
          both(cfg_file(), leaf({"users": ["u0"], "user_data": {"u0": {"x": 5, "y": [1]}}}))),
    Probe("leaf-users-nested", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set", "data.root=leaf",
                                "--set", "data.partition=natural"], 2, "all.json",
          both(cfg_file(), leaf({"users": [["u0"]], "user_data": {}}))),
    Probe("leaf-label-dict", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set", "data.root=leaf",
                              "--set", "data.partition=natural"], 2, "'u0'",
          both(cfg_file(), leaf({"users": ["u0"], "user_data": {"u0": {"x": [[1.0] * 4], "y": [{"a": 1}]}}}))),
    Probe("leaf-user-data-list", ["run", "c.yaml", "--dry-run", "--set", "data.dataset=leaf", "--set",
                                  "data.root=leaf", "--set", "data.partition=natural"], 2, "user_data",
          both(cfg_file(), leaf({"users": ["u0"], "user_data": []}))),
    Probe("async-dropout-1", ["run", "c.yaml"], 2, "env.participation.dropout",
          cfg_file(env={"preset": "mobile-heterogeneous", "participation": {"dropout": 1.0}}, **ASYNC), bound_s=60),
    Probe("async-availability-0", ["run", "c.yaml"], 2, "availability.p", cfg_file(
        env={"preset": "mobile-heterogeneous", "participation": {"availability": {"mode": "bernoulli", "p": 0.0}}},
        **ASYNC), bound_s=60),
    # 7. identity means what runs
    Probe("resume-fewer-rounds", ["run", "r.yaml", "--set", "rounds=1", "--resume", "runs/r"], 2, "rounds",
          finished_run),
    Probe("partial-aggregate-1", ["run", "c.yaml", "--set", "backend.partial_aggregate=1"], 2,
          "backend.partial_aggregate", cfg_file()),
    Probe("partial-aggregate-0", ["run", "c.yaml", "--set", "backend.partial_aggregate=0"], 2,
          "backend.partial_aggregate", cfg_file()),
    Probe("embed-dim-0", ["run", "c.yaml", "--set", "model.params.embed_dim=0"], 2, "embed_dim", cfg_file()),
    Probe("embed-dim-float", ["run", "c.yaml", "--set", "model.params.embed_dim=2.5"], 2, "embed_dim", cfg_file()),
    Probe("abstract-algorithm", ["run", "c.yaml", "--set", "algorithm.name=raysim.algorithm:Algorithm"], 2,
          "algorithm.name", cfg_file()),
    Probe("objective-metric-missing", ["tune", "c.yaml", "--space", "space.yaml", "--trials", "1"], 2,
          "objective.metric", both(cfg_file(data__val_fraction=0.25), lambda d: write(
              d, "space.yaml", SPACE.replace("val_acc", "val_nothing")))),
    Probe("sqlite-of-another-app", ["tune", "c.yaml", "--space", "space.yaml", "--trials", "1", "--storage",
                                    "sqlite:///app.db"], 2, "--storage",
          both(cfg_file(data__val_fraction=0.25), lambda d: write(d, "space.yaml", SPACE), sqlite_app),
          keep=("app.db",)),
    Probe("plain-optuna-study", ["tune", "c.yaml", "--space", "space.yaml", "--trials", "1", "--storage",
                                 "journal:s.log", "--study-name", "theirs"], 2, "--study-name",
          both(cfg_file(data__val_fraction=0.25), lambda d: write(d, "space.yaml", SPACE), plain_study)),
    Probe("resume-command-quoted", ["run", "my config.yaml", "--set", "algorithm.name=um50fail:Failing"], 1,
          "raysim run 'my config.yaml' --set algorithm.name=um50fail:Failing --resume",
          both(cfg_file("my config.yaml", on_client_failure="stop",
                        output={"progress": False, "dir": "out", "checkpoint_every": 1}),
               failing([3], "ValueError('my bug')")), writes=True),
    Probe("out-dot-beside-config-yaml", ["run", "config.yaml", "--out", "."], 2, "--out", cfg_file("config.yaml"),
          check=lambda d, out, err: None if not (d.parent / f"{d.name}-2").exists() else "wrote a sibling directory"),
    Probe("dry-run-1000-clients", ["run", "c.yaml", "--dry-run", "--set", "data.num_clients=1000", "--set",
                                   "data.partition=iid", "--set", "data.partition_params={}", "--set",
                                   "data.dataset=mnist5k"], 0, "", cfg_file(), check=dry_lines(200)),
]


def _env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(CODE), PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    env.update(extra or {})
    return env


def _tree(d: Path) -> dict:
    out = {}
    for p in sorted(d.rglob("*")):
        if "disk" in p.relative_to(d).parts[:1]:
            continue
        try:
            out[str(p.relative_to(d))] = p.stat().st_size if p.is_file() else -1
        except OSError:
            out[str(p.relative_to(d))] = -2
    return out


def run_probe(p: Probe) -> tuple:
    """(exit code or 'hang', stdout, stderr, tree changed, problem of a check or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        try:
            if p.setup:
                p.setup(d)
            keep = {k: (d / k).read_bytes() for k in p.keep}
            before = _tree(d)
            env = _env({k: str(d / v) if k == "TORCH_HOME" else v for k, v in p.env.items()})
            proc = subprocess.Popen([sys.executable, "-m", "raysim", *p.argv], cwd=d, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=p.bound_s)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                code = "hang"
            after = _tree(d)
            changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
            if p.writes:
                changed = {k for k in changed if not (k.startswith("out") or k.startswith("runs"))}
            problem = p.check(d, out, err) if p.check else None
            lost = [k for k, v in keep.items() if not (d / k).exists() or (d / k).read_bytes() != v]
            forbidden = [f for f in p.forbid if (d / f).exists()]
            return code, out, err, sorted(changed), problem, lost, forbidden
        finally:
            if (d / "disk").is_dir():
                subprocess.run(["umount", str(d / "disk")], capture_output=True)


def grade(p: Probe, code, err: str, changed, problem, lost, forbidden) -> tuple[str, str]:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("raysim: note:")
             and "WARNING" not in ln and not ln.startswith("(raylet)")]
    if code == "hang":
        return "bug", "hangs"
    if lost or forbidden:
        return "bug", f"{'deleted ' + ', '.join(lost) if lost else ''}{'wrote/ran ' + ', '.join(forbidden) if forbidden else ''}"
    if p.code != 0 and code == 0:
        return "bug", "exit 0 (accepted or a wrong result)"
    if changed and not p.writes:
        return "bug", f"changed {', '.join(changed[:3])}"
    tb = any(ln.startswith("Traceback") for ln in lines)
    if code != p.code:
        return "poor", f"exit {code}{' with a traceback' if tb else ''}"
    if problem:
        return "poor", problem
    if p.code == 0:  # a success: silent, or the one notice it owes (p.text)
        if p.text:
            return ("exemplary", "") if len(lines) == 1 and p.text in lines[0] else \
                ("acceptable", f"{len(lines)} lines") if any(p.text in ln for ln in lines) else ("poor", "not said")
        return ("exemplary", "") if not lines else ("acceptable", f"{len(lines)} lines")
    if tb or (p.text and not any(p.text in ln for ln in lines)):
        return "poor", "traceback" if tb else f"no line names {p.text!r}"
    return ("exemplary", "") if len(lines) == 1 else ("acceptable", f"{len(lines)} lines")


def main() -> None:
    only = set(sys.argv[1:])
    counts: collections.Counter = collections.Counter()
    print("| # | probe | command (after `raysim`) | exit | grade | why | the last line |")
    print("|---|---|---|---|---|---|---|")
    for i, p in enumerate(PROBES, 1):
        if only and p.id not in only:
            continue
        try:
            code, out, err, changed, problem, lost, forbidden = run_probe(p)
            g, why = grade(p, code, err, changed, problem, lost, forbidden)
        except Exception as e:  # the probe's own setup failed (e.g. no tmpfs here)
            code, err, g, why = "-", "", "not run", f"{type(e).__name__}: {e}"
        counts[g] += 1
        last = ([ln for ln in err.splitlines() if ln.strip()] or [""])[-1][:220].replace("|", "\\|")
        shown = " ".join(p.argv).replace("|", "\\|")
        print(f"| {i} | {p.id} | `{shown}` | {code} | {g} | {why} | {last} |", flush=True)
    print()
    print(f"{sum(counts.values())} probes: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
