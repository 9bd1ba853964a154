"""Faults have owners (issue 50): a client's own failure may be skipped, and is always said (a notice, a count in
the table and the metadata, a stop beyond ``max_failed_share``); a fault of the machine — a full disk under the
client-state store (the real one on a small tmpfs where mounting works, and torch.save's own form: a RuntimeError
raised while handling the OSError), out of memory — stops the run with one line naming the resource and the key."""
from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import yaml

from raysim.app.cli import main
from raysim.runner.faults import MachineFault, classify
from raysim.engine.loop import run_experiment
from raysim.errors import ConfigError, SimulationError
from tests.conftest import register_for_test, tiny_config


@pytest.fixture(autouse=True)
def _algorithms(monkeypatch):
    register_for_test(monkeypatch, failing_fedavg="tests.failing_algo:FailingFedAvg")


def torch_save_on_full_disk(*args, **kwargs):
    """What torch.save raises on a full disk: a RuntimeError whose context (not cause) is the OSError."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0; "
                           "PytorchStreamWriter failed writing file data/0: file write failed")


# -- the classifier (pure) ---------------------------------------------------------------------------------------------

def test_a_disk_full_chain_is_the_machines():
    with pytest.raises(RuntimeError) as e:
        torch_save_on_full_disk()
    assert e.value.__cause__ is None and isinstance(e.value.__context__, OSError)
    f = classify(e.value)
    assert f is not None and f.resource.startswith("disk") and "No space left" in f.problem


@pytest.mark.parametrize("make", [
    lambda: MemoryError(),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:114] . DefaultCPUAllocator: can't allocate memory: you tried "
                         "to allocate 4500000000 bytes"),
    lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: OSError(errno.EROFS, "Read-only file system", "/x"),
    lambda: OSError(errno.EIO, "Input/output error"),
])
def test_memory_and_broken_disks_are_the_machines(make):
    f = classify(make())
    assert f is not None and ("memory" in f.resource or "disk" in f.resource)
    assert any(k in f.fix for k in ("backend.", "train.batch_size"))


def test_cuda_oom_error_names_gpu_keys():
    torch = pytest.importorskip("torch")
    f = classify(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert f.resource == "GPU memory" and "train.batch_size" in f.fix and "gpu_memory_mb" in f.fix


@pytest.mark.parametrize("make", [
    lambda: RuntimeError("boom on client 3"),
    lambda: ValueError("shapes do not match"),
    lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "my_side_file.txt"),  # the user's own code
    lambda: ZeroDivisionError(),
])
def test_the_clients_own_failures_stay_the_clients(make):
    assert classify(make()) is None


def test_an_oserror_raised_inside_the_store_is_the_machines(tmp_path):
    from raysim.runner.store import StateStore

    (tmp_path / "st").write_text("a file where the store wants its directory")
    s = StateStore(0, tmp_path / "st" / "clients")
    with pytest.raises(OSError) as e:
        s.put_initial(0, {"w": __import__("torch").zeros(3)})
    f = classify(e.value)
    assert f is not None and "client-state store" in f.resource and "backend.state_dir" in f.fix


def test_machine_fault_crosses_processes_intact():
    import pickle

    e = pickle.loads(pickle.dumps(MachineFault("disk (the client-state store): full; fix")))
    assert isinstance(e, MachineFault) and isinstance(e, SimulationError) and str(e).startswith("disk")


# -- in a run ----------------------------------------------------------------------------------------------------------

def spill_cfg(tmp_path, **over):
    c = tiny_config(rounds=3, **over)
    c["backend"].update({"state_dir": str(tmp_path / "states"), "state_memory_mb": 0})
    c["output"] = {"progress": False, "dir": str(tmp_path / "out"), "checkpoint_every": 1}
    return c


def test_a_full_disk_under_the_store_stops_the_run_instead_of_skipping_clients(tmp_path, monkeypatch):
    """Before issue 50, 5 of 6 clients 'failed' every round and the run ended 0 with accuracy 0.19. Now round 1's
    first spill that meets the full disk stops the run: one MachineFault naming the store and backend.state_dir, the
    checkpoints of round 0 kept to resume."""
    import raysim.runner.store as store
    from raysim.config import make_config

    real, calls = store.atomic_save, [0]

    def fills_up(obj, path, *a, **k):
        calls[0] += 1
        if "round" in str(path) or calls[0] <= 12:  # round 0's states fit; then the disk is full
            return real(obj, path, *a, **k)
        return torch_save_on_full_disk()

    monkeypatch.setattr(store, "atomic_save", fills_up)
    with pytest.raises(MachineFault, match=r"disk \(the client-state store\).*backend.state_dir") as e:
        run_experiment(make_config(spill_cfg(tmp_path)))
    assert "clients failed" not in str(e.value)  # not counted as client failures
    kept = list((tmp_path / "out").glob("*.incomplete"))
    assert kept and list((kept[0] / "checkpoints").glob("round_*")), "the run's checkpoints are kept"


def test_cli_disk_full_is_one_line_with_the_quoted_resume_command(tmp_path, monkeypatch, capsys):
    import raysim.runner.store as store

    real, calls = store.atomic_save, [0]

    def fills_up(obj, path, *a, **k):
        calls[0] += 1
        return real(obj, path, *a, **k) if "round" in str(path) or calls[0] <= 12 else torch_save_on_full_disk()

    monkeypatch.setattr(store, "atomic_save", fills_up)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my config.yaml").write_text(yaml.safe_dump(spill_cfg(tmp_path)))
    code = main(["run", "my config.yaml", "--set", "seed=7"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, lines
    assert "backend.state_dir" in lines[0] and "Traceback" not in lines[0]
    assert "raysim run 'my config.yaml' --set seed=7 --resume" in lines[0], lines[0]


def test_a_driver_side_disk_full_chain_is_one_line(tmp_path, monkeypatch, capsys):
    """torch.save's RuntimeError-from-OSError while the driver writes a checkpoint: one line, exit 1 (a 42-line
    traceback before issue 50)."""
    import raysim.io.checkpoints as ck

    monkeypatch.setattr(ck, "atomic_save", torch_save_on_full_disk)
    monkeypatch.chdir(tmp_path)
    c = tiny_config(rounds=2)
    c["output"] = {"progress": False, "dir": "out", "checkpoint_every": 1}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    code = main(["run", "c.yaml"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and "No space left" in lines[0] and "output.dir" in lines[0], lines


def test_memory_error_in_a_client_step_stops_the_run(tiny, monkeypatch):
    from algorithms.fedproto import FedProto

    def oom(self, *a, **k):
        raise MemoryError()

    monkeypatch.setattr(FedProto, "client_update", oom)
    with pytest.raises(MachineFault, match=r"^memory: MemoryError.*backend.state_memory_mb"):
        run_experiment(tiny(rounds=1), write=False)


def test_skipped_failures_are_counted_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    c = tiny_config(rounds=3, algorithm={"name": "failing_fedavg", "params": {"fail_clients": [2], "fail_round": 1}})
    c["output"] = {"progress": False, "dir": "out"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    assert main(["run", "c.yaml"]) == 0
    err = capsys.readouterr().err
    assert "raysim: note: 2 client step(s) failed and were skipped" in err and "client 2: RuntimeError" in err
    from raysim.io.tables import load, load_metadata

    run_dir = next((tmp_path / "out").iterdir())
    meta = load_metadata(run_dir)
    assert meta["client_failures"]["count"] == 2 and meta["client_failures"]["clients"] == [2]
    t = load(run_dir)
    assert t[(t.metric == "failures") & (t.scope == "total")]["value"].tolist() == [0, 1, 1]


def test_more_than_max_failed_share_stops_the_run(tiny):
    cfg = tiny(rounds=3, max_failed_share=0.3,
               algorithm={"name": "failing_fedavg", "params": {"fail_clients": [1, 2], "fail_round": 1}})
    with pytest.raises(SimulationError, match=r"round 1, step 'update': 2 of 6 clients failed, more than "
                                              r"max_failed_share=0.3"):
        run_experiment(cfg, write=False)
    cfg = tiny(rounds=3, algorithm={"name": "failing_fedavg", "params": {"fail_clients": [1, 2], "fail_round": 1}})
    run_experiment(cfg, write=False)  # 2 of 6 within the default 0.5


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_max_failed_share_is_validated(tiny, bad):
    with pytest.raises(ConfigError) as e:
        tiny(max_failed_share=bad)
    assert e.value.field == "max_failed_share"


def test_max_failed_share_is_not_part_of_the_identity(tiny):
    assert tiny(max_failed_share=0.9).run_id() == tiny().run_id()


def _mount_tmpfs(where, size: str) -> bool:
    where.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs")
def test_a_real_full_disk_under_the_store(tmp_path, capsys):
    """The real fault: backend.state_dir on a 64 KiB tmpfs filled to the last byte (skipped where mounting is not
    allowed)."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(disk / "fill", "wb", buffering=0) as f:  # to the last byte
            for size in (4096, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass
        c = tiny_config(rounds=2)
        c["backend"].update({"state_dir": str(disk / "states"), "state_memory_mb": 0})
        c["output"] = {"progress": False, "dir": str(tmp_path / "out")}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
        code = main(["run", str(tmp_path / "c.yaml")])
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert code == 1 and len(lines) == 1, lines
        assert "disk (the client-state store): No space left on device" in lines[0]
        assert "backend.state_dir" in lines[0]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)




def test_an_interruption_inside_torch_save_is_the_interruption(tmp_path, monkeypatch):
    """A SIGTERM (raised as KeyboardInterrupt) that lands inside torch.save's zip writer surfaces as the writer's
    RuntimeError on closing; atomic_save raises the interruption itself and leaves no temporary file."""
    import torch

    from raysim.io import files

    class Interrupted(KeyboardInterrupt):
        pass

    real = torch.save

    def save(obj, f):
        try:
            raise Interrupted()
        except Interrupted:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(Interrupted):
        files.atomic_save({"w": torch.zeros(3)}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", real)
    files.atomic_save({"w": torch.zeros(3)}, tmp_path / "x.pt")
    assert (tmp_path / "x.pt").exists()
