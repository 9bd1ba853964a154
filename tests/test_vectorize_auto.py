"""``backend.vectorize: auto`` (the default): the batched executor where the clients train on a GPU, the per-client
loop on a CPU (issue 49: batch-native execution, the default where it applies). Resolved from the config alone, so
these tests need no GPU: nothing here calls CUDA."""
from __future__ import annotations

import pytest
import torch

from raysim.config import make_config
from raysim.engine.prepare import _notice_dropped
from raysim.engine.settings import runner_settings
from raysim.errors import ConfigError
from tests.conftest import tiny_config


def _cfg(**backend):
    return make_config(tiny_config(backend={"name": "sequential", **backend}))


def test_auto_is_the_default_and_batches_only_on_a_gpu():
    assert _cfg().backend.vectorize == "auto"
    assert not _cfg(device="cpu").vectorizes() and not runner_settings(_cfg(device="cpu")).vectorize
    assert _cfg(device="cuda").vectorizes() and runner_settings(_cfg(device="cuda")).vectorize
    ray = dict(name="ray", num_actors=2, address="10.0.0.1:6379")  # a cluster: its actors' GPU shares decide
    assert _cfg(**ray, num_gpus=0.5).vectorizes() and not _cfg(**ray, num_gpus=0.0).vectorizes()
    if not torch.cuda.is_available():  # a local Ray with fake GPU shares trains on this machine's CPU
        assert not _cfg(name="ray", num_actors=2, num_gpus=0.5).vectorizes()
    assert not _cfg(device="cuda", vectorize=False).vectorizes() and _cfg(device="cpu", vectorize=True).vectorizes()
    steps = make_config(tiny_config(backend={"name": "sequential", "device": "cuda"},
                                    train={"local_steps": 3, "batch_size": 8, "lr": 0.05}))
    assert not steps.vectorizes()  # auto leaves whole-epoch batching to runs of whole epochs


def test_auto_is_named_as_what_it_runs():
    """A CPU run under auto keeps the identity it had before auto existed; a GPU run that batches is named as one
    that asked for the batched executor."""
    assert _cfg(device="cpu").run_id() == _cfg(device="cpu", vectorize=False).run_id()
    assert _cfg(device="cuda").run_id() == _cfg(device="cuda", vectorize=True).run_id()
    assert _cfg(device="cuda").run_id() != _cfg(device="cuda", vectorize=False).run_id()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_value_names_the_key(value):
    with pytest.raises(ConfigError, match=r"backend\.vectorize.*auto, true or false"):
        _cfg(vectorize=value)


def test_auto_on_a_gpu_says_once_that_a_method_it_cannot_batch_runs_the_loop():
    cfg = make_config(tiny_config(backend={"name": "sequential", "device": "cuda"},
                                  algorithm={"name": "fedfomo", "params": {}}, data__val_fraction=0.2))
    said = []
    _notice_dropped(cfg, said.append)
    assert [s for s in said if "vectorize" in s] == [
        "note: backend.vectorize: auto runs fedfomo in the per-client loop on this GPU (it is not a LocalTraining "
        "method and has no group form <fn>_group: its clients always train one after another)"]
    cpu = make_config(tiny_config(backend={"name": "sequential", "device": "cpu"},
                                  algorithm={"name": "fedfomo", "params": {}}, data__val_fraction=0.2))
    said = []
    _notice_dropped(cpu, said.append)
    assert not [s for s in said if "vectorize" in s]  # on a CPU auto is the loop: nothing to say


def _mafml(**backend):
    from tests.test_mutual import mutual_data

    return make_config(tiny_config(backend={"name": "sequential", **backend}, data=mutual_data(),
                                   train={"optimizer": "adam", "lr": 0.01, "batch_size": 8, "persist_optimizer": True},
                                   algorithm={"name": "mafml", "params": {"iterations": 3}}))


def test_auto_runs_mafmls_group_forms_on_a_cpu_too(monkeypatch, tmp_path):
    """Issue 48 item 4: a method whose group forms are its CPU default (Algorithm.vectorize_on_cpu: MAFML, whose
    per-node steps cost 1.8x a plain loop on a CPU under portable numerics, the group forms 0.85x) is batched by auto
    on a CPU as on a GPU, named as a run that asked for it, and said once; false keeps the per-node steps; where the
    fixed-order kernel cannot be built, one line naming backend.vectorize (auto never falls back by itself: the run's
    identity must not depend on the machine's compiler)."""
    from raysim import fixed_gemm
    from raysim.engine import prepare as prep

    assert _mafml(device="cpu").vectorizes() and runner_settings(_mafml(device="cpu")).vectorize
    assert not _mafml(device="cpu", vectorize=False).vectorizes()
    assert _mafml(device="cpu").run_id() == _mafml(device="cpu", vectorize=True).run_id()
    assert _mafml(device="cpu").run_id() != _mafml(device="cpu", vectorize=False).run_id()
    assert not _cfg(device="cpu").vectorizes()  # other methods: the per-client loop on a CPU, as before
    said = []
    _notice_dropped(_mafml(device="cpu"), said.append)
    assert [s for s in said if "vectorize" in s] == [
        "note: backend.vectorize: auto trains mafml's clients together on this CPU (its group forms, the faster path "
        "here); backend.vectorize: false runs them one after another"]
    said = []
    _notice_dropped(_mafml(device="cpu", vectorize=True), said.append)
    assert not [s for s in said if "vectorize" in s]  # asked for: nothing to say
    monkeypatch.setattr(fixed_gemm, "_lib", None)
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    prep.prepare(_mafml(device="cpu", vectorize=False))
    with pytest.raises(ConfigError, match=r"backend\.vectorize.: auto trains mafml's clients together on a CPU, "
                                          r"which needs the fixed-order GEMM: no C compiler found.*vectorize: false"):
        prep.prepare(_mafml(device="cpu"))



def test_mafmls_cpu_default_leaves_whole_epoch_rules_and_old_checkpoints_clear():
    """train.local_steps keeps auto off for a LocalTraining method only (its batched executor runs whole epochs), on
    every device; MAFML's group forms do not read it: on on a CPU and a GPU alike, one identity. A checkpoint made by
    the per-node steps (before auto picked the group forms, or with vectorize: false) is refused with how to resume
    it."""
    from raysim.config import to_dict
    from raysim.engine.loop import _loop_made_hint
    from raysim.engine.prepare import resume_hash

    d = to_dict(_mafml(device="cpu"))
    d["train"]["local_steps"] = 3
    assert make_config(d).vectorizes()
    gpu = dict(d, backend={**d["backend"], "device": "cuda"})
    assert make_config(gpu).vectorizes() and make_config(d).run_id() == make_config(gpu).run_id()
    for device in ("cpu", "cuda"):  # a LocalTraining method: the loop on both
        steps = make_config(tiny_config(backend={"name": "sequential", "device": device},
                                        train={"local_steps": 3, "batch_size": 8, "lr": 0.05}))
        assert not steps.vectorizes()
    auto, loop = _mafml(device="cpu"), _mafml(device="cpu", vectorize=False)
    assert resume_hash(auto) != resume_hash(loop)
    assert _loop_made_hint(auto, resume_hash(loop)).endswith("resume it with --set backend.vectorize=false")
    assert _loop_made_hint(auto, "0123456789") == "" and _loop_made_hint(loop, resume_hash(auto)) == ""
