"""The shared pieces the methods are built from (one stream-naming rule, one seeding helper, one model cache, one
optimiser builder, one PUParams, SlaugFL's GAN loops as functions) and the removed leftovers."""
import copy
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
    from raysim.runner import runners

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


def test_run_experiment_takes_keywords_after_the_config():
    import inspect

    import raysim
    from raysim.engine.loop import run_experiment

    params = list(inspect.signature(run_experiment).parameters.values())
    assert params[0].name == "cfg" and all(p.kind is p.KEYWORD_ONLY for p in params[1:])
    with pytest.raises(TypeError):
        run_experiment(None, "out")
    with pytest.raises(TypeError):
        raysim.run_experiment(None, "out")


def test_run_seeds_prepares_each_seed_once(tiny, monkeypatch, tmp_path):
    from raysim.app import sweep
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
    from raysim.config.registry import algorithm_class

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
    from raysim.config import from_dict
    from raysim.errors import ConfigError
    from raysim.config.registry import algorithm_class

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
        "positive_rate": 0.5, "pu_weight": 0.0, "pu_split": "held"}}}).config_hash() == cfg.config_hash()


# ---------------------------------------------------------------------------------------------------------------
# one seeding helper, one model cache, one optimiser builder


def _grep(folder: str, pattern: str, skip=()) -> list[str]:
    rx = re.compile(pattern)
    return [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / folder).rglob("*.py")) if p.name not in skip
            for i, line in enumerate(p.read_text().splitlines(), 1) if rx.search(line)]


def test_methods_never_seed_or_fork_torchs_global_rng_by_hand():
    hits = _grep("algorithms", r"manual_seed|fork_rng|seed_torch_global")
    assert not hits, f"use rng.init_seed / rng.keep_global_rng instead: {hits}"


def test_methods_keep_no_module_cache_of_their_own_and_build_optimisers_in_one_place():
    assert not _grep("algorithms", r"cached_module|self\._(mods|m|models|frozen|cache|live)\s*=\s*\{"), \
        "keep live modules in ctx.models"
    assert not _grep("algorithms", r"torch\.optim\.[A-Z]"), "build optimisers with raysim.training.make_optimizer"
    assert not _grep("raysim", r"torch\.optim\.(SGD|Adam)\(", skip=("training.py",))


def test_init_seed_pins_the_stream_and_keeps_the_callers():
    torch.manual_seed(123)
    with rngmod.init_seed(5, "x"):
        a = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # the caller's stream did not move
    with rngmod.init_seed(5, "x"):
        assert torch.equal(torch.rand(3), a)
    with rngmod.init_seed(5, "y"):
        assert not torch.equal(torch.rand(3), a)
    torch.manual_seed(1)
    with rngmod.keep_global_rng():
        torch.rand(10)
    b = torch.rand(2)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(2), b)


def test_model_cache_builds_once_per_key_without_moving_the_stream():
    from raysim.algorithm import ModelCache

    cache, built = ModelCache(None, torch.device("cpu")), []

    def make():
        built.append(1)
        return torch.nn.Linear(3, 2)

    torch.manual_seed(0)
    m = cache.get("k", make)
    x = torch.rand(2)
    assert cache.get("k", make) is m and len(built) == 1 and isinstance(m, torch.nn.Linear)
    assert cache.get("other", make) is not m and len(built) == 2
    torch.manual_seed(0)
    assert torch.equal(torch.rand(2), x)
    data = cache.get("public", lambda: (torch.zeros(2), [1]))  # not a module: kept as made
    assert cache.get("public", lambda: None) is data
    assert Context(0, 0, 1, "cpu", task=None).models is not None  # a hand-built context gets a cache


def test_make_optimizer_is_the_one_builder():
    from raysim.config import TrainConfig
    from raysim.training import OptimizerSpec, make_optimizer, optimizer_state

    w = torch.nn.Linear(2, 1)
    cfg = TrainConfig(lr=0.1, momentum=0.9, weight_decay=0.01, optimizer="sgd")
    opt = make_optimizer(w.parameters(), cfg)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9 and opt.defaults["lr"] == 0.1
    gan = make_optimizer(w.parameters(), OptimizerSpec("adam", 2e-4, betas=(0.5, 0.999)))
    assert gan.defaults["betas"] == (0.5, 0.999) and gan.defaults["weight_decay"] == 0.0
    plain = make_optimizer(w.parameters(), OptimizerSpec("sgd", 0.5))
    assert plain.defaults["momentum"] == 0.0 and plain.defaults["weight_decay"] == 0.0
    w(torch.ones(1, 2)).sum().backward()
    opt.step()
    again = make_optimizer(w.parameters(), cfg, state=optimizer_state(opt, w), model=w)
    assert torch.equal(again.state[w.weight]["momentum_buffer"], opt.state[w.weight]["momentum_buffer"])
    with pytest.raises(TypeError):
        make_optimizer(w.parameters(), OptimizerSpec("rmsprop", 0.1))


def test_optimisers_without_the_dynamo_import_compute_as_torchs():
    """make_optimizer's SGD and Adam (raysim.training: torch's classes, minus the torch._dynamo import of their
    wrapped methods) give torch's parameters, state and state_dict bit for bit: momentum, weight decay, zero_grad,
    a state_dict round trip, a closure; they are torch's classes for isinstance, and their step hooks still run.
    (That they import no torch._dynamo: the fresh process below; a whole run: tests/test_numerics.py's probe.
    Under torch.compile they call torch's wrapped functions: checked by hand, torch.compile(backend="eager") over a
    zero_grad / backward / step function gives torch's classes' parameters and runs each step hook once.)"""
    from raysim import training

    assert training.SGD is not torch.optim.SGD and training.Adam is not torch.optim.Adam  # this torch: the eager ones
    for ours, theirs, kw in ((training.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                             (training.SGD, torch.optim.SGD, dict(lr=0.3)),
                             (training.Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=1e-4, betas=(0.5, 0.999)))):
        torch.manual_seed(0)
        a = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
        b = copy.deepcopy(a)
        oa, ob = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
        assert isinstance(oa, theirs)
        hooked = []
        oa.register_step_post_hook(lambda *_: hooked.append(1))
        x = torch.randn(8, 5)
        for k in range(4):
            for m, o in ((a, oa), (b, ob)):
                o.zero_grad(set_to_none=k % 2 == 0)
                if k == 3:
                    o.step(lambda m=m: m(x).pow(2).sum().backward())  # a closure
                else:
                    m(x).pow(2).sum().backward()
                    o.step()
            if k == 1:  # a state_dict round trip into fresh optimisers
                sa, sb = oa.state_dict(), ob.state_dict()
                oa, ob = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
                oa.load_state_dict(sa)
                ob.load_state_dict(sb)
                oa.register_step_post_hook(lambda *_: hooked.append(1))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
        for i, st in sa["state"].items():
            assert st.keys() == sb["state"][i].keys()
            assert all(torch.equal(v, sb["state"][i][k]) for k, v in st.items()), (i, st)
        assert len(hooked) == 4


@pytest.mark.xdist_group("fresh_process")
def test_optimisers_import_no_dynamo_in_a_fresh_process(fresh_process):
    """tests/fresh_process.py: make_optimizer's SGD (momentum, weight decay) and Adam, a step, zero_grad and a
    state_dict round trip, and torch._dynamo is still not loaded (torch's own classes would load it)."""
    assert fresh_process["dynamo_after_optimisers"] is False


# ---------------------------------------------------------------------------------------------------------------
# SlaugFL's GAN loops, called directly


def _slaug_params(**over):
    from algorithms.slaugfl import SlaugFL

    base = dict(gen_steps=3, gen_batch=4, gen_lr=1e-3, gen_channels=4, gen_noise=5, lam_div=1.0, gan_channels=4,
                gan_noise=6, disc_channels=4)
    return SlaugFL.Params(**{**base, **over})


def test_train_proto_generator_on_a_tiny_generator():
    from algorithms.generators import GeneratorRun, ProtoGenerator, train_proto_generator

    p = _slaug_params()
    torch.manual_seed(0)
    gen = ProtoGenerator(3, (1, 8, 8), p.gen_channels, p.gen_noise)
    before = {k: v.clone() for k, v in gen.state_dict().items()}
    protos = torch.randn(3, 4)
    mask = torch.tensor([True, False, True])
    proj = torch.nn.Linear(64, 4)
    seen = []

    outs = []

    def embed(x, y):
        seen.append(y)
        assert x.shape == (p.gen_batch, 1, 8, 8)
        e = proj(x.flatten(1))
        outs.append((e.detach().clone(), y))
        return e

    sd, metrics = train_proto_generator(gen, protos, mask, embed, GeneratorRun(p, torch.Generator().manual_seed(1)))
    assert set(torch.cat(seen).tolist()) <= {0, 2} and len(seen) == p.gen_steps
    # fewer steps than the last-10 window: the reported loss is the mean over all of them (not their sum / 10)
    losses = []
    for e, y in outs:
        labels = sorted(set(y.tolist()))
        means = torch.stack([e[y == c].mean(0) for c in labels])
        losses.append(float(((means - protos[labels]) ** 2).mean()))
    assert metrics["gen_proto_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert set(metrics) == {"gen_proto_loss", "gen_div_loss", "gen_steps"} and metrics["gen_steps"] == 3.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert any(not torch.equal(sd[k], before[k]) for k in sd)  # it trained
    gen2 = ProtoGenerator(3, (1, 8, 8), p.gen_channels, p.gen_noise)
    gen2.load_state_dict(before)
    sd2, m2 = train_proto_generator(gen2, protos, mask, embed, GeneratorRun(p, torch.Generator().manual_seed(1)))
    assert m2 == metrics and all(torch.equal(sd[k], sd2[k]) for k in sd)  # a function of its inputs


def test_train_acgan_on_a_tiny_gan():
    from algorithms.generators import ACGANDiscriminator, ACGANGenerator, GeneratorRun, train_acgan

    p = _slaug_params()
    torch.manual_seed(0)
    gen = ACGANGenerator(3, (1, 8, 8), p.gan_channels, p.gan_noise)
    disc = ACGANDiscriminator(3, (1, 8, 8), p.disc_channels)
    x, y = torch.rand(10, 1, 8, 8) * 2 - 1, torch.tensor([0, 1] * 5)
    sd, metrics = train_acgan(gen, disc, x, y, GeneratorRun(p, torch.Generator().manual_seed(2)))
    assert set(metrics) == {"gan_d_loss", "gan_g_loss", "gen_steps"} and metrics["gen_steps"] == 3.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert set(sd) == set(gen.state_dict())
    with torch.no_grad():
        out = gen.eval()(torch.randn(2, p.gan_noise), torch.tensor([0, 1]))
    assert out.shape == (2, 1, 8, 8) and float(out.abs().max()) <= 1.0


def test_class_folder_loader_names_the_field(tmp_path):
    from raysim.data.class_folders import load_class_folders
    from raysim.errors import DataError

    (tmp_path / "7").mkdir()  # a class index beyond the task's: skipped
    with pytest.raises(DataError) as e:
        load_class_folders(str(tmp_path), (1, 8, 8), 3)
    assert e.value.field == "algorithm.params.candidate_dir"
