"""backend.numerics (raysim/numerics.py): portable runs give one table on every CPU, native runs the CPU's own
kernels; every process checks its kernels before it computes; bad input is one line naming the key.

Another machine is imitated by another kernel choice in a fresh process's environment (``ATEN_CPU_CAPABILITY=default``
is what torch runs on a CPU without AVX2; ``MKL_CBWR=AVX512`` an Intel AVX-512 branch of MKL): a portable run there
must give the golden table bit for bit, a native run another table. The two-node version (one node per kernel choice)
is benchmarks/two_node.py, run by tests/test_cluster.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from raysim import numerics
from raysim.config import make_config
from raysim.errors import ConfigError
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent
OTHER_MACHINE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "DEFAULT"}


def probe(tmp_path, name, env, *args):
    full = {k: v for k, v in os.environ.items() if k != numerics.MARK and k not in numerics.PORTABLE_ENV}
    full.update(env, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "numerics_probe.py"), str(tmp_path / name), *args],
                       env=full, capture_output=True, text=True, timeout=300)
    info = json.loads((tmp_path / f"{name}.json").read_text())
    table = pd.read_parquet(tmp_path / f"{name}.parquet") if p.returncode == 0 else None
    return p, info, table


def test_portable_on_another_kernel_choice_gives_the_golden_table_and_native_does_not(tmp_path):
    gold = pd.read_parquet(ROOT / "tests" / "golden" / "fedavg.parquet")
    p, info, table = probe(tmp_path, "portable", OTHER_MACHINE)
    assert p.returncode == 0, p.stderr[-3000:]
    assert info["mode"] == "portable" and info["cpu_capability"] == "AVX2" and info["mkldnn"] is False
    assert info["env"]["MKL_CBWR"] == "COMPATIBLE"
    assert info["dynamo_loaded"] is False  # a whole run (SGD, momentum) in a fresh process: no torch._dynamo import
    pd.testing.assert_frame_equal(table, gold, check_exact=True)
    p, info, table = probe(tmp_path, "native", dict(OTHER_MACHINE, RAYSIM_NUMERICS="native"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert info["mode"] == "native" and info["cpu_capability"] == "DEFAULT" and info["mkldnn"] is True
    assert info["env"]["ATEN_CPU_CAPABILITY"] == "default"  # the machine's own setting is left alone
    floats = ~table["metric"].str.contains("bytes|floats|participants|failures")
    assert not table[floats]["value"].equals(gold[floats]["value"])  # the kernels changed the last bits


def test_a_process_that_computed_before_the_pin_is_refused_in_one_line(tmp_path):
    p, info, _ = probe(tmp_path, "early", {}, "early")
    assert p.returncode == 2
    assert info["error"].startswith("config error at 'backend.numerics': portable: this process chose its CPU kernels")
    assert "import raysim before running any torch code" in info["error"] and "\n" not in info["error"]


def test_bad_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"backend\.numerics.*'fast' is not allowed; choose one of: portable, native"):
        make_config(tiny_config(backend={"name": "sequential", "numerics": "fast"}))


def test_portable_refuses_a_cpu_without_avx2(monkeypatch):
    monkeypatch.setattr(numerics, "cpu_flags", lambda: {"sse2", "sse4_2"})
    with pytest.raises(ConfigError) as e:
        numerics.enter("portable")
    msg = str(e.value)
    assert msg.startswith("config error at 'backend.numerics': portable needs a CPU with AVX2") and "node " in msg and "native" in msg


def test_a_process_keeps_one_mode(monkeypatch):
    monkeypatch.setattr(numerics, "_mode", "portable")
    with pytest.raises(ConfigError, match=r"'backend\.numerics': native requested, but this process already computed "
                                          r"in portable mode.*RAYSIM_NUMERICS=native"):
        numerics.enter("native")


def test_numerics_is_part_of_the_identity_and_recorded():
    from raysim.engine.loop import run_experiment

    base = make_config(tiny_config())
    assert base.backend.numerics == "portable"
    assert "backend.numerics" not in base.identity_dict()  # the default: old configs keep their hash
    native = make_config(tiny_config(backend={"name": "sequential", "numerics": "native"}))
    assert native.config_hash() != base.config_hash() and native.identity_dict()["backend.numerics"] == "native"
    meta = run_experiment(make_config(tiny_config(rounds=1)), write=False).metadata
    assert meta["numerics"]["mode"] == "portable" and meta["numerics"]["cpu_capability"] == "AVX2"
    assert meta["numerics"]["mkldnn"] is False and meta["numerics"]["env"]["MKL_CBWR"] == "COMPATIBLE"
    assert meta["numerics"]["device"] == "cpu"  # where the runner computed (the suite hides CUDA: tests/conftest.py)
    assert "up_bytes" in meta["count_metrics"] and "test_acc" not in meta["count_metrics"]


def test_pin_and_unpin_restore_the_users_own_settings(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv(numerics.MARK, raising=False)
    numerics.pin({"MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Haswell"})
    assert os.environ["MKL_CBWR"] == "COMPATIBLE" and json.loads(os.environ[numerics.MARK]) == {
        "MKL_CBWR": "AVX2", "OPENBLAS_CORETYPE": None}
    numerics.unpin()
    assert os.environ["MKL_CBWR"] == "AVX2" and "OPENBLAS_CORETYPE" not in os.environ
    assert numerics.MARK not in os.environ


def test_cuda_settings_of_portable_mode(monkeypatch):
    """What portable mode sets on a GPU (deterministic algorithms, no TF32, no cuDNN autotuning, cuBLAS workspace):
    set and undone here without calling CUDA."""
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        numerics.cuda_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32 and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic = before[1]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[2], before[3]
        numerics.unpin()
        numerics.pin(numerics.PORTABLE_ENV)


REF = ROOT / "tests" / "reference"


def test_portable_quick_start_equals_the_reference_table_bit_for_bit():
    """The quick start (10 rounds, sequential, CPU) in portable mode equals tests/reference's table on every machine;
    only other torch / numpy versions than the recorded ones are a reason to skip."""
    sys.path.insert(0, str(REF))
    from tests.reference.make_reference import NAME, run
    from raysim.engine.prepare import versions

    rec = json.loads((REF / f"{NAME}.json").read_text())
    v = versions()
    off = [f"{k} {rec[k]} there, {v[k]} here" for k in ("torch", "numpy") if rec[k] != v[k]]
    if off:
        pytest.skip(f"the reference table was made with other versions ({'; '.join(off)}): regenerate it with "
                    f"tests/reference/make_reference.py")
    table, res = run()
    assert res.metadata["numerics"]["mode"] == "portable"
    pd.testing.assert_frame_equal(table, pd.read_parquet(REF / f"{NAME}.parquet"), check_exact=True)


def test_a_cluster_node_without_avx2_is_refused_before_the_run_naming_it():
    """On a cluster (backend.address) every node reports its CPU before any actor starts (ray_preflight)."""
    from raysim.backends.ray_preflight import node_numerics_refusal

    nodes = [("head", "AMD EPYC 7B13", True), ("old-box", "Intel(R) Xeon(R) CPU E5-2670", False)]
    why = node_numerics_refusal("portable", nodes)
    assert "node old-box (Intel(R) Xeon(R) CPU E5-2670) has none" in why and "backend.numerics: native" in why
    assert node_numerics_refusal("native", nodes) is None
    assert node_numerics_refusal("portable", nodes[:1]) is None
