"""The shared pieces the methods are built from (one stream-naming rule, one seeding helper, one model cache, one
optimiser builder, one PUParams, SlaugFL's GAN loops as functions) and the removed leftovers."""
import re
from pathlib import Path

import pytest
import torch

from raysim import rng as rngmod
from raysim.algorithm import Context
from raysim.steps import CLASSIC_ROUND, EVALUATION, ClientStep, ServerStep

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# stream names


def test_stream_names_of_the_classic_and_other_steps():
    # the names pin every stream of every run: changing one changes the numbers
    assert [rngmod.step_stream(s.method, s.name) for s in CLASSIC_ROUND + EVALUATION] == [
        "update", "aggregate", "evaluate", "evaluate"]
    assert rngmod.step_stream("local_step", "local", 2) == "local#2"
    assert rngmod.step_stream("client_update", "update", 1) == "update#1"
    assert rngmod.stream_name("batches", "update") == "batches"
    assert rngmod.stream_name("batches", "digest", 3) == "batches@digest#3"
    assert rngmod.stream_name("gen", "", 0) == "gen"


def test_context_streams_and_runner_streams_use_the_one_rule():
    from raysim.engine import runners

    ctx = Context(0, 1, 5, "cpu", task=None, step="digest", iteration=2)
    assert ctx._purpose("batches") == rngmod.stream_name("batches", "digest", 2)
    g = ctx.generator("batches")
    ref = rngmod.torch_generator(5, 0, 1, "batches@digest#2")
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))
    for step in (ClientStep("update", "client_update"), ServerStep("average", "average_due"), *EVALUATION):
        assert runners._purpose(step, 1) == rngmod.step_stream(step.method, step.name, 1)


# ---------------------------------------------------------------------------------------------------------------
# removed leftovers


def test_run_experiment_has_no_callback_keyword():
    import inspect

    from raysim.engine.loop import run_experiment

    assert "callback" not in inspect.signature(run_experiment).parameters
    with pytest.raises(TypeError):
        run_experiment(None, callback=lambda r, t: False)


def test_run_seeds_prepares_each_seed_once(tiny, monkeypatch, tmp_path):
    from raysim import sweep
    from raysim.engine import loop, prepare as prepare_mod

    calls = []
    real = prepare_mod.prepare

    def counting(cfg):
        calls.append(cfg.seed)
        return real(cfg)

    monkeypatch.setattr(prepare_mod, "prepare", counting)
    monkeypatch.setattr(loop, "prepare", counting)
    runs = sweep.run_seeds(tiny(rounds=1), [3, 4], out_dir=tmp_path, progress=False, log=lambda *a: None)
    assert calls == [3, 4] and [r.metadata["seed"] for r in runs] == [3, 4]


def test_no_legacy_run_directory_names():
    from raysim.io import rundir

    assert not hasattr(rundir, "LEGACY_TMP")
    assert not rundir.is_unfinished_name(Path(".tmp-run"))
    assert rundir.intended_path(Path("a/run.incomplete")) == Path("a/run")


# ---------------------------------------------------------------------------------------------------------------
# FedPU's options: one definition


PU_FIELDS = ("positive_rate", "pu_weight", "pu_split", "labelled_classes", "pu_min_class")


def test_pu_params_are_defined_once_and_shared():
    import dataclasses

    from algorithms import fedpu
    from raysim.registry import algorithm_class

    assert tuple(f.name for f in dataclasses.fields(fedpu.PUParams)) == PU_FIELDS
    for name in ("fedavg", "fedprox", "fedproto", "fedproto_uh", "fedtgp"):
        params = algorithm_class(name).Params
        assert issubclass(params, fedpu.PUParams), name
        assert {f.name: f.default for f in dataclasses.fields(params) if f.name in PU_FIELDS} == {
            f.name: f.default for f in dataclasses.fields(fedpu.PUParams)}
    defined = [f"{p.name}:{i}" for p in sorted((ROOT / "algorithms").glob("*.py")) if p.name != "fedpu.py"
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.match(r"\s+(positive_rate|pu_weight|pu_split|labelled_classes|pu_min_class)\s*:", line)]
    assert not defined, f"FedPU options defined outside algorithms/fedpu.py: {defined}"


@pytest.mark.parametrize("name", ["fedavg", "fedproto", "fedtgp"])
def test_pu_options_stay_flat_keys_and_are_checked(name):
    from raysim.config import ConfigError, from_dict
    from raysim.registry import algorithm_class

    cls = algorithm_class(name).Params
    p = from_dict(cls, {"positive_rate": 0.5, "pu_split": "held", "pu_min_class": 3}, "algorithm.params")
    assert (p.positive_rate, p.pu_split, p.pu_min_class, p.pu_weight) == (0.5, "held", 3, 1.0)
    for bad, field in (({"positive_rate": 0.0}, "positive_rate"), ({"pu_split": "x"}, "pu_split"),
                       ({"pu_weight": -1.0}, "pu_weight"), ({"labelled_classes": -1}, "labelled_classes"),
                       ({"pu_min_class": -2}, "pu_min_class")):
        with pytest.raises(ConfigError) as e:
            from_dict(cls, bad, "algorithm.params")
        assert e.value.field == f"algorithm.params.{field}"


def test_pu_options_keep_the_config_hash():
    from raysim.config import make_config

    base = {"name": "h", "algorithm": {"name": "fedproto", "params": {"positive_rate": 0.5, "pu_weight": 0.0}}}
    cfg = make_config(base)
    # default-valued keys do not count; the PU keys are flat algorithm.params keys of the identity
    assert cfg.identity_dict()["algorithm.params.positive_rate"] == 0.5
    assert "algorithm.params.pu_split" not in cfg.identity_dict()
    assert make_config({**base, "algorithm": {"name": "fedproto", "params": {
        "positive_rate": 0.5, "pu_weight": 0.0, "pu_split": "seed"}}}).config_hash() == cfg.config_hash()
