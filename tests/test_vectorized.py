"""The vectorised executor (backend.vectorize): the same table as the per-client loop within the stated tolerance for
every method that opts in (dropout off and on: each client's masks are its own counter-based draws, the loop's bits), Adam and SGD
momentum with persisted optimiser state, unequal data sizes and batch counts, the fallback to the loop, BatchNorm
(per-client running statistics; what cannot be batched refused before the run), the identity hash, and Ray ==
sequential."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from raysim import rng as rngmod

from raysim.config import make_config
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare
from raysim.errors import ConfigError
from raysim.io.results import without_timing
from raysim.runner.grouped import StackedOptimizer as _Optimizer
from raysim.config import TrainConfig

KEYS = ["round", "client_id", "scope", "metric"]
METHODS = ["local", "fedavg", "fedprox", "fedper", "lgfedavg", "fedproto", "fedtgp", "fedproto_uh"]


def cfg(algo="fedavg", vectorize=True, dropout=0.0, train=None, params=None, backend=None, **over):
    d = {"name": "vec", "seed": 3, "rounds": 2,
         # Dirichlet: unequal client sizes, so unequal batch counts and last-batch sizes
         "data": {"dataset": "mnist5k", "num_clients": 5, "partition": "dirichlet",
                  "partition_params": {"alpha": 0.5, "samples_per_client": 18, "min_samples": 5, "test_ratio": 0.3}},
         "model": {"arch": "cnn_mnist", "params": {"out_channels": 8, "embed_dim": 16, "dropout": dropout,
                                                   "conv_dropout": dropout}},
         "train": {"local_epochs": 1, "batch_size": 4, "lr": 0.05, "momentum": 0.5, **(train or {})},
         "algorithm": {"name": algo, "params": dict(params or {})},
         "eval": {"every": 2},
         "backend": {"name": "sequential", "vectorize": vectorize, **(backend or {})},
         "output": {"progress": False}}
    d.update(over)
    return make_config(d)


def table(c):
    return without_timing(run_experiment(c, write=False, progress=False).table.drop(columns=["run_id"]))


def close(a: pd.DataFrame, b: pd.DataFrame, rel=1e-4):
    """Same rows; every value within rel * max(1, |value|) (the equality policy's stated tolerance)."""
    m = a.merge(b, on=KEYS, how="outer", suffixes=("_l", "_v"), indicator=True)
    assert (m["_merge"] == "both").all(), m[m["_merge"] != "both"].head()
    diff = (m["value_l"] - m["value_v"]).abs()
    scale = m["value_l"].abs().clip(lower=1.0)
    bad = m[diff > rel * scale]
    assert bad.empty, bad[KEYS + ["value_l", "value_v"]].head()
    return float(diff.max())


@pytest.mark.parametrize("algo", METHODS)
def test_vectorised_equals_loop_within_tolerance(algo):
    loop, vec = table(cfg(algo, vectorize=False)), table(cfg(algo))
    close(loop, vec)
    assert loop[loop.metric == "train_loss"].shape[0] > 0


def test_slaugfl_vectorised_equals_loop_with_its_synthetic_data_and_prototypes(monkeypatch):
    """SlaugFL: each client's own data plus its synthetic augmentation (``LocalStart.x/y``, unequal sizes) and the
    dual calibration against the broadcast p-f prototypes (written without data-dependent control flow), trained as
    one group from the second round on; the table within the stated tolerance of the loop's."""
    from raysim.runner import executors

    sizes, original = [], executors.Vectorized._train

    def spy(run, g, model, cids):
        sizes.append(len(cids))
        return original(run, g, model, cids)

    monkeypatch.setattr(executors.Vectorized, "_train", staticmethod(spy))
    over = dict(params={"gen_steps": 4, "gen_channels": 8, "prep_epochs": 1}, rounds=3)
    data = {"dataset": "mnist5k", "num_clients": 4, "partition": "dirichlet", "server_val": 100,
            "partition_params": {"alpha": 0.5, "samples_per_client": 18, "min_samples": 5, "test_ratio": 0.3}}
    vec = table(cfg("slaugfl", data=data, **over))
    assert sizes and max(sizes) >= 2
    loop = table(cfg("slaugfl", vectorize=False, data=data, **over))
    close(loop, vec)
    assert {"train_sep", "train_cla"} <= set(vec.metric) and vec[vec.metric == "train_sep"].value.max() > 0  # L_sep acts


def test_agg_vectorised_trains_on_its_declared_data_as_the_loop_does(monkeypatch):
    """AGG (seed 003's baseline): each node trains on its own private and public data plus the other nodes' public
    shares (``LocalStart.x/y``, larger than its ``x_train``), as one group; the table within tolerance of the loop's."""
    from raysim.runner import executors

    sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
    import make_golden

    calls, original = [], executors.Vectorized._train

    def spy(run, g, model, cids):
        calls.append(len(cids))
        return original(run, g, model, cids)

    monkeypatch.setattr(executors.Vectorized, "_train", staticmethod(spy))
    d = make_golden.golden_config("agg")
    d["train"].pop("local_steps")
    d["rounds"] = 2
    loop = table(make_config({**d, "backend": {"name": "sequential", "vectorize": False}}))
    vec = table(make_config({**d, "backend": {"name": "sequential", "vectorize": True}}))
    assert calls and max(calls) >= 2
    close(loop, vec)


@pytest.mark.parametrize("algo", ["fedavg", "local", "fedproto", "fedtgp", "fedper", "lgfedavg"])
def test_batch_native_final_equals_loop_within_tolerance(algo, monkeypatch):
    """Clients of one data size: the group's final step runs in its batch form (``client_final_group``: uploads and
    states as rows of the trained stacks, FedProto's prototypes from one grouped forward) and its evaluation in
    groups (``evaluate_group``: one grouped forward under each client's own weights, FedProto's prototype classifier
    as one batched distance; FedAvg's under the global model), both checked by spies, and the table is the loop's
    within the stated tolerance."""
    from algorithms import fedavg, fedper, fedproto, local

    data = {"dataset": "mnist5k", "num_clients": 5, "partition": "iid",
            "partition_params": {"samples_per_client": 12, "test_per_client": 6}}
    owner = {"fedavg": fedavg.FedAvg, "local": local.Local, "fedproto": fedproto.FedProto,
             "fedtgp": fedproto.FedProto, "fedper": fedper.SharedPartAverage,
             "lgfedavg": fedper.SharedPartAverage}[algo]
    batch_form, calls = owner.client_final_group, []
    eval_form, evals = owner.evaluate_group, []

    def spy(self, group):
        out = batch_form(self, group)
        calls.append(out is not None)
        return out

    def eval_spy(self, payloads, states, datas, ctxs):
        out = eval_form(self, payloads, states, datas, ctxs)
        evals.append(out is not None)
        return out

    monkeypatch.setattr(owner, "client_final_group", spy)
    monkeypatch.setattr(owner, "evaluate_group", eval_spy)  # evaluation in groups too (each client's own weights)
    vec = table(cfg(algo, data=data))
    assert calls and all(calls), calls
    assert evals and all(evals), evals
    close(table(cfg(algo, vectorize=False, data=data)), vec)
    assert {"test_acc"} | ({"test_acc_proto"} if algo in ("fedproto", "fedtgp") else set()) <= set(vec.metric)


def test_batched_evaluation_equals_the_loops(monkeypatch):
    """FedAvg's evaluation in its group form (one forward of every client's test set, and of their validation
    splits, under the global model) gives the loop's accuracies: checked by a spy, on a run with validation
    splits."""
    from algorithms import fedavg

    batch_form, calls = fedavg.FedAvg.evaluate_group, []

    def spy(self, payloads, states, datas, ctxs):
        out = batch_form(self, payloads, states, datas, ctxs)
        calls.append(len(datas) if out is not None else 0)
        return out

    monkeypatch.setattr(fedavg.FedAvg, "evaluate_group", spy)
    data = {"dataset": "mnist5k", "num_clients": 5, "partition": "dirichlet", "val_fraction": 0.3,
            "partition_params": {"alpha": 0.5, "samples_per_client": 18, "min_samples": 5, "test_ratio": 0.3}}
    vec = table(cfg("fedavg", data=data))
    assert calls and all(c >= 2 for c in calls), calls
    loop = table(cfg("fedavg", vectorize=False, data=data))
    assert {"test_acc", "val_acc"} <= set(vec.metric)
    close(loop, vec)
    accs = lambda t: t[t.metric.isin(["test_acc", "val_acc"])].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(accs(loop), accs(vec))  # the same predictions here: equal accuracies


def test_dropout_on_masks_are_the_loops():
    # cnn_mnist's head dropout and Dropout2d at 0.5: each client's masks are its own counter-based draws (the bits the
    # loop draws), so even with dropout the numbers agree within tolerance, and a vectorised run is deterministic
    loop = table(cfg("fedproto", vectorize=False, dropout=0.5))
    vec = table(cfg("fedproto", dropout=0.5))
    close(loop, vec)
    pd.testing.assert_frame_equal(vec, table(cfg("fedproto", dropout=0.5)), check_exact=True)
    # and dropout really acts: the run without it differs
    assert not table(cfg("fedproto", dropout=0.0))["value"].equals(vec["value"])


@pytest.mark.parametrize("train", [
    {"optimizer": "adam", "lr": 0.002, "persist_optimizer": True, "local_epochs": 2},
    {"momentum": 0.9, "weight_decay": 0.01, "persist_optimizer": True, "batch_size": 3},
])
def test_optimiser_state_and_unequal_batches(train):
    close(table(cfg("fedprox", vectorize=False, train=train, rounds=3)), table(cfg("fedprox", train=train, rounds=3)))


def test_optimizer_matches_torch_on_hand_tensors():
    torch.manual_seed(0)
    for tc in (TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
               TrainConfig(optimizer="adam", lr=0.01, weight_decay=0.001)):
        ps = [torch.randn(3, 2) for _ in range(2)]
        gs = [[torch.randn(3, 2) for _ in range(2)] for _ in range(3)]  # 3 steps x 2 clients
        stacked = {"w": torch.stack(ps).clone()}
        opt = _Optimizer(tc, stacked, [None, None], tc.lr)
        for step in gs:
            opt.step(stacked, {"w": torch.stack(step)}, torch.tensor([0, 1]))
        for i in range(2):
            p = ps[i].clone().requires_grad_(True)
            ref = (torch.optim.Adam([p], lr=tc.lr, weight_decay=tc.weight_decay) if tc.optimizer == "adam" else
                   torch.optim.SGD([p], lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay))
            for step in gs:
                p.grad = step[i].clone()
                ref.step()
            assert torch.allclose(stacked["w"][i], p.detach(), atol=1e-6)
            mine = opt.state_of(i, ["w"])["w"]
            theirs = ref.state[p]
            for key in mine:
                assert torch.allclose(torch.as_tensor(mine[key], dtype=torch.float32),
                                      torch.as_tensor(theirs[key], dtype=torch.float32), atol=1e-6)


def test_clients_that_do_not_opt_in_run_the_loop_bit_identically():
    # FedPU's view is per client: FedProto with hidden labels falls back to the per-client loop
    p = {"positive_rate": 0.5}
    pd.testing.assert_frame_equal(table(cfg("fedproto", vectorize=False, params=p)), table(cfg("fedproto", params=p)), check_exact=True)


BN_MODEL = {"arch": "resnet_small", "params": {"width": 4}}  # the zoo's smallest residual net: BatchNorm2d


@pytest.mark.parametrize("algo", ["fedavg", "local"])
def test_batchnorm_equals_loop_within_tolerance(algo, monkeypatch):
    """A residual net with BatchNorm trained vectorised (the grouped network: each client normalised by its own
    batch, its own running statistics updated) gives the loop's table within the stated tolerance, and the same
    running statistics: Local's client states and FedAvg's average of them, as the evaluation sees them."""
    from algorithms import fedavg, local
    from raysim.runner import grouped as gmod

    owner = {"fedavg": fedavg.FedAvg, "local": local.Local}[algo]
    real_eval, seen = owner.evaluate_client, {}

    def spy(self, payload, state, data, ctx):  # the weights each client is evaluated with (eval mode: running stats)
        w = state["model"] if algo == "local" else payload["model"].tensors
        seen.setdefault(ctx.client_id, {k: v.clone() for k, v in w.items()})
        return real_eval(self, payload, state, data, ctx)

    monkeypatch.setattr(owner, "evaluate_client", spy)
    monkeypatch.setattr(owner, "evaluate_group", lambda *a: None)  # per client, so the spy sees each client's weights
    loop = table(cfg(algo, vectorize=False, model=BN_MODEL))
    loop_states, seen = seen, {}
    real_forward, calls = gmod.grouped_forward, []
    monkeypatch.setattr(gmod, "grouped_forward", lambda *a, **kw: (calls.append(1), real_forward(*a, **kw))[1])
    vec = table(cfg(algo, model=BN_MODEL))
    assert calls, "the grouped path was not taken"
    close(loop, vec)
    assert loop_states.keys() == seen.keys() and loop_states
    stats = [k for k in next(iter(loop_states.values())) if "running" in k or "num_batches" in k]
    assert len(stats) == 3 * 9  # nine BatchNorm2d layers
    for cid, ref in loop_states.items():
        for k, v in ref.items():
            assert seen[cid][k].dtype == v.dtype, k
            assert torch.allclose(seen[cid][k].double(), v.double(), rtol=1e-4, atol=1e-5), (cid, k)
        assert not torch.equal(ref["body.1.running_var"], torch.ones_like(ref["body.1.running_var"]))  # it moved
    if algo == "local":  # clients of different data: different statistics
        a, b = list(loop_states.values())[:2]
        assert not torch.equal(a["body.1.running_mean"], b["body.1.running_mean"])
        assert {int(s["body.1.num_batches_tracked"]) for s in loop_states.values()} != {0}


def test_batchnorm_models_evaluate_in_groups_with_their_own_running_statistics(monkeypatch):
    """Batched evaluation of a BatchNorm model (eval mode: each client's own running statistics, stacked with its
    weights) gives the loop's accuracies."""
    from raysim.runner import executors

    used, original = [], executors.GroupEvaluation.run

    def spy(self, run):
        used.append(original(self, run))
        return used[-1]

    monkeypatch.setattr(executors.GroupEvaluation, "run", spy)
    data = {"dataset": "mnist5k", "num_clients": 4, "partition": "iid",
            "partition_params": {"samples_per_client": 12, "test_per_client": 6}}
    vec = table(cfg("local", data=data, model=BN_MODEL))
    assert used and all(used), used
    close(table(cfg("local", vectorize=False, data=data, model=BN_MODEL)), vec)


def test_batchnorm_that_cannot_be_batched_is_refused():
    from torch import nn

    from raysim.runner.vectorized import check_model

    check_model(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))  # a momentum: batched
    for bn in (nn.BatchNorm2d(2, momentum=None), nn.SyncBatchNorm(2)):
        with pytest.raises(ConfigError) as e:
            check_model(nn.Sequential(nn.Conv2d(1, 2, 3), bn), "mine")
        assert e.value.field == "backend.vectorize" and "mine" in str(e.value)


def test_grouped_batchnorm_is_each_clients_batchnorm():
    """Two clients, two channels, different data, weights and running statistics: the grouped BatchNorm2d (one
    F.batch_norm over K*C channels) gives each client nn.BatchNorm2d's output and running statistics after one
    training step, which are, by hand: (x - mean) / sqrt(biased var + eps) * w + b, and
    running = (1 - m) * running + m * (mean, unbiased var); then eval mode normalises by the running statistics."""
    from torch import nn

    from raysim.runner.grouped import grouped_forward

    m = 0.3
    x = torch.stack([torch.arange(24.0).reshape(3, 2, 2, 2), torch.arange(24.0).reshape(3, 2, 2, 2).flip(0) ** 2])
    w, b = torch.tensor([[1.0, 2.0], [0.5, -1.0]]), torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    rm, rv = torch.tensor([[0.0, 1.0], [2.0, -1.0]]), torch.tensor([[1.0, 2.0], [0.5, 4.0]])
    model = nn.Sequential(nn.BatchNorm2d(2, momentum=m))
    model.train()
    p = {"0.weight": w, "0.bias": b, "0.running_mean": rm.clone(), "0.running_var": rv.clone(),
         "0.num_batches_tracked": torch.zeros(2, dtype=torch.long)}
    out = grouped_forward(model, p, x, False, iter(()))
    for k in range(2):
        one = nn.BatchNorm2d(2, momentum=m)
        with torch.no_grad():
            one.weight.copy_(w[k]), one.bias.copy_(b[k]), one.running_mean.copy_(rm[k]), one.running_var.copy_(rv[k])
        ref = one(x[k])
        assert torch.allclose(out[k], ref, atol=1e-5)
        xc = x[k].transpose(0, 1).reshape(2, -1)  # [C, B*H*W]
        mean, var_b, var_u = xc.mean(1), xc.var(1, unbiased=False), xc.var(1, unbiased=True)
        by_hand = (x[k] - mean.view(1, 2, 1, 1)) / (var_b.view(1, 2, 1, 1) + 1e-5).sqrt() * w[k].view(1, 2, 1, 1) \
            + b[k].view(1, 2, 1, 1)
        assert torch.allclose(out[k], by_hand, atol=1e-4)
        for name, mine, theirs, hand in (("mean", p["0.running_mean"][k], one.running_mean, (1 - m) * rm[k] + m * mean),
                                         ("var", p["0.running_var"][k], one.running_var, (1 - m) * rv[k] + m * var_u)):
            assert torch.allclose(mine, theirs, rtol=1e-5), name
            assert torch.allclose(mine, hand, rtol=1e-5), name
        assert int(p["0.num_batches_tracked"][k]) == int(one.num_batches_tracked) == 1
        one.eval()
        model.eval()
        assert torch.allclose(grouped_forward(model, p, x, False, iter(()))[k], one(x[k]), atol=1e-5)
        model.train()
    assert not torch.allclose(p["0.running_mean"][0], p["0.running_mean"][1])  # each client its own statistics


def test_a_grouped_forward_that_fails_falls_back_to_vmap_and_says_so(monkeypatch):
    # the grouped forward raising (a model it mis-reads): the step runs under vmap, and the run says so once, in its
    # metadata and on the console, with the reason (it was silent)
    from raysim.runner import vectorized

    def broken(*a, **k):
        raise RuntimeError("a grouped forward that fails")

    monkeypatch.setattr(vectorized._GroupTraining, "_grouped_grad", broken)
    with pytest.warns(RuntimeWarning, match="its steps run with vmap") as seen:
        res = run_experiment(cfg("fedavg", rounds=1), write=False, progress=False)
    assert res.metadata["fallbacks"] == [{"what": "the grouped forward (raysim.runner.grouped)",
                                          "to": "its steps run with vmap",
                                          "reason": "RuntimeError: a grouped forward that fails"}]
    assert sum("grouped forward" in str(w.message) for w in seen) == 1


def test_vectorize_is_part_of_the_identity():
    assert cfg(vectorize=True).config_hash() != cfg(vectorize=False).config_hash()
    # the default leaves old configs' identities alone: backend keys other than vectorize never enter it
    assert cfg(vectorize=False).config_hash() == cfg(vectorize=False, backend={"num_actors": 3}).config_hash()
    assert "backend.vectorize" in cfg(vectorize=True).identity_dict()


@pytest.mark.ray
def test_ray_two_actors_equals_sequential(ray_session):
    seq = table(cfg("fedproto", dropout=0.5, rounds=1))
    ray = table(cfg("fedproto", dropout=0.5, rounds=1, backend={"name": "ray", "num_actors": 2}))
    close(seq, ray)


# -- grouped execution (raysim.engine.grouped): the vectorised executor's fast path for standard-layer models --------

def _train_group(arch, loss_fn, grouped, params=None, k=3, n=(10, 10, 7), calls=None):
    from raysim import models as zoo
    from raysim.runner import grouped as gmod
    from raysim.runner.vectorized import vmap_local_sgd
    from tests.members import zip_members

    torch.manual_seed(0)
    model = getattr(zoo, arch)((1, 28, 28), 10, **(params or {}))
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    xs = [torch.rand(m, 1, 28, 28) for m in n]
    xs[0][:, :, :4] = 0.0  # zero rows: ties inside max-pooling windows
    ys = [torch.randint(0, 10, (m,)) for m in n]
    tc = TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, batch_size=4, local_epochs=2)
    gens = lambda base: [rngmod.Counter(base + i) for i in range(k)]  # noqa: E731
    real = gmod.grouped_forward

    def counted(*a, **kw):
        if calls is not None:
            calls.append(1)
        return real(*a, **kw)

    gmod.grouped_forward = counted
    try:
        return vmap_local_sgd(model, loss_fn, zip_members([start] * k, xs, ys, gens(0), gens(100)), tc,
                              grouped=grouped)
    finally:
        gmod.grouped_forward = real


def _ce(model, xb, yb, epoch):
    return torch.nn.functional.cross_entropy(model(xb), yb), {}


def _proto_like(model, xb, yb, epoch):  # two outputs, a parameter term (FedProx's form), a part
    logits, z = model(xb, return_embedding=True)
    prox = sum((p ** 2).sum() for _, p in model.named_parameters())
    return torch.nn.functional.cross_entropy(logits, yb) + 1e-3 * prox + 0.01 * z.pow(2).mean(), {"z": z.mean()}


@pytest.mark.parametrize("arch,params,loss", [
    ("cnn_mnist", {"dropout": 0.5, "conv_dropout": 0.5}, _ce),
    ("cnn_mnist", {"dropout": 0.5, "conv_dropout": 0.5}, _proto_like),
    ("lenet", {}, _proto_like), ("mlp", {}, _ce), ("cnn_small", {}, _ce), ("cnn4", {}, _ce),
])
def test_grouped_execution_equals_vmap(arch, params, loss):
    # same batches, same dropout masks, same optimiser: the grouped forward + autograd gives every client the
    # gradients vmap gives (sums ordered differently: within 1e-4), with unequal data sizes (a smaller last batch)
    seen = []
    g_params, g_metrics, g_states = _train_group(arch, loss, True, params, calls=seen)
    v_params, v_metrics, v_states = _train_group(arch, loss, False, params)
    assert seen, "the grouped path was not taken"
    for gp, vp in zip(g_params, v_params):
        for name in vp:
            assert torch.allclose(gp[name], vp[name], atol=1e-4, rtol=1e-4), name
    for gm, vm in zip(g_metrics, v_metrics):
        assert gm.keys() == vm.keys()
        for key in vm:
            assert abs(gm[key] - vm[key]) < 1e-4, key
    for gs, vs in zip(g_states, v_states):
        for name in vs:
            assert torch.allclose(gs[name]["momentum_buffer"], vs[name]["momentum_buffer"], atol=1e-4), name
    # and the clients trained: every client's parameters moved from the common start
    for gp in g_params:
        assert any(not torch.equal(gp[name], t) for name, t in _start(arch, params).items())


def _start(arch, params):
    from raysim import models as zoo

    torch.manual_seed(0)
    return dict(getattr(zoo, arch)((1, 28, 28), 10, **(params or {})).state_dict())


def _other_input(model, xb, yb, epoch):  # a call on something else than the batch: outside the grouped form
    return torch.nn.functional.cross_entropy(model(xb[:2]), yb[:2]), {}


def _submodule(model, xb, yb, epoch):  # reaches into a submodule: outside the grouped form
    return torch.nn.functional.cross_entropy(model.head(model.body(xb)), yb), {}


@pytest.mark.parametrize("loss", [_other_input, _submodule])
def test_objectives_outside_the_grouped_form_run_with_vmap(loss):
    seen = []
    g = _train_group("cnn_mnist", loss, True, calls=seen)
    v = _train_group("cnn_mnist", loss, False)
    assert not seen
    for gp, vp in zip(g[0], v[0]):
        for name in vp:
            assert torch.equal(gp[name], vp[name])


def test_grouped_form_covers_the_standard_zoo_only():
    from raysim import models as zoo
    from raysim.runner.grouped import supported

    for arch in ("cnn_mnist", "lenet", "mlp", "cnn_small", "cnn4", "fedavg_cnn", "protonet"):
        assert supported(getattr(zoo, arch)((1, 28, 28), 10)), arch
    # residual blocks and batch norm (per-client running statistics): torchvision's BasicBlock and InvertedResidual,
    # raysim's ResNet body
    for arch in ("resnet_small", "mobilenet_small", "resnet18"):
        assert supported(getattr(zoo, arch)((3, 32, 32), 10, width=4)), arch
    bn = lambda **kw: zoo.SplitModel(torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2, **kw), torch.nn.Flatten(), torch.nn.Linear(2 * 26 * 26, 5)),
        torch.nn.Linear(5, 2), 5)
    assert supported(bn()) and supported(bn(track_running_stats=False))
    assert not supported(bn(momentum=None))  # a cumulative average: no grouped form
    other = bn()
    other.register_buffer("scale", torch.ones(1))  # a buffer other than batch-norm statistics
    assert not supported(other)
    odd = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10), torch.nn.Softmax(dim=1))
    assert not supported(odd)

    # a known module whose class overrides forward, or with a forward hook, computes something else: vmap
    class Doubled(torch.nn.ReLU):
        def forward(self, x):
            return 2 * super().forward(x)

    class Shifted(zoo.SplitModel):
        def forward(self, x, return_embedding=False):
            return super().forward(x + 1, return_embedding)

    flat = lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 5))  # noqa: E731
    assert supported(zoo.SplitModel(flat(), torch.nn.Linear(5, 2), 5))
    assert not supported(zoo.SplitModel(flat(), torch.nn.Sequential(Doubled(), torch.nn.Linear(5, 2)), 5))
    assert not supported(Shifted(flat(), torch.nn.Linear(5, 2), 5))
    hooked = zoo.cnn_mnist((1, 28, 28), 10)
    hooked.body.fc1.register_forward_hook(lambda module, args, out: out * 0)
    assert not supported(hooked)


def _no_grad_target(model, xb, yb, epoch):  # self-distillation: the target is a constant, as in the loop
    with torch.no_grad():
        target = model(xb)  # used outside the block: it must carry no gradient
    logits = model(xb)
    return torch.nn.functional.cross_entropy(logits, yb) + ((logits - target) ** 2).mean(), {}


def _in_place(model, xb, yb, epoch):  # normalises its batch in place before the call: outside the grouped form
    xb.sub_(0.5).mul_(2.0)
    return torch.nn.functional.cross_entropy(model(xb), yb), {}


def test_no_grad_calls_and_in_place_batches_keep_the_loops_numbers():
    seen = []
    g = _train_group("cnn_mnist", _no_grad_target, True, {"dropout": 0.5, "conv_dropout": 0.5}, calls=seen)
    v = _train_group("cnn_mnist", _no_grad_target, False, {"dropout": 0.5, "conv_dropout": 0.5})
    assert seen  # taken: two calls on the batch, the first one's output detached
    for gp, vp in zip(g[0], v[0]):
        for name in vp:
            assert torch.allclose(gp[name], vp[name], atol=1e-5), name
    seen.clear()
    g, v = _train_group("cnn_mnist", _in_place, True, calls=seen), _train_group("cnn_mnist", _in_place, False)
    assert not seen
    for gp, vp in zip(g[0], v[0]):
        for name in vp:
            assert torch.equal(gp[name], vp[name])


def test_models_the_grouped_form_would_misread_are_refused():
    from raysim.runner.grouped import supported
    from torch import nn

    act = nn.ReLU()
    reused = zoo_split(nn.Sequential(nn.Flatten(), nn.Linear(784, 5), act, nn.Linear(5, 5), act))
    lin = nn.Linear(5, 5)
    tied = zoo_split(nn.Sequential(nn.Flatten(), nn.Linear(784, 5), lin, nn.ReLU(), lin))

    class Standardised(nn.Conv2d):  # overrides a helper, not forward
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, (w - w.mean()) / (w.std() + 1e-5), b)

    conv = zoo_split(nn.Sequential(Standardised(1, 2, 3), nn.Flatten(), nn.Linear(2 * 26 * 26, 5)))
    extra = zoo_split(nn.Sequential(nn.Flatten(), nn.Linear(784, 5)))
    extra.unused = nn.Linear(3, 3)  # a SplitModel with a child its forward never runs
    plain = zoo_split(nn.Sequential(nn.Flatten(), nn.Linear(784, 5)))
    assert supported(plain)
    for m in (reused, tied, conv, extra):
        assert not supported(m)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert not supported(plain)  # a global hook runs in every module's forward
    finally:
        handle.remove()
    assert supported(plain)


def zoo_split(body):
    from raysim.layers import SplitModel

    return SplitModel(body, torch.nn.Linear(5, 10), 5)


def test_a_model_with_nothing_to_train_runs():
    from raysim import models as zoo
    from raysim.runner.vectorized import vmap_local_sgd
    from tests.members import zip_members

    model = zoo.mlp((1, 28, 28), 10)
    for p in model.parameters():
        p.requires_grad_(False)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    tc = TrainConfig(optimizer="sgd", lr=0.05, batch_size=4, local_epochs=1)
    gens = [rngmod.Counter(i) for i in range(2)]
    trained, metrics, _ = vmap_local_sgd(model, _ce, zip_members([start] * 2, [torch.rand(6, 1, 28, 28)] * 2,
                                                                 [torch.randint(0, 10, (6,))] * 2, gens, gens), tc)
    assert all(torch.equal(trained[0][n], start[n]) for n in start) and metrics[0]["train_loss"] > 0


def test_portable_vectorised_cpu_run_needs_the_fixed_order_gemm(capsys, monkeypatch, tmp_path):
    """Issue 48 item 4: a portable vectorised run on a CPU computes its grouped convolutions with raysim's
    fixed-order GEMM (no note about a tax any more); where the kernel cannot be built, one line naming
    backend.vectorize before anything runs; a per-client run never needs it."""
    from raysim import fixed_gemm
    from raysim.engine import prepare as prep
    from raysim.errors import ConfigError

    monkeypatch.setattr(prep, "_NOTICED", set())
    prepare(cfg("fedavg", backend={"device": "cpu"}))
    assert "portable numerics" not in capsys.readouterr().err
    monkeypatch.setattr(fixed_gemm, "_lib", None)
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    prepare(cfg("fedavg", vectorize=False, backend={"device": "cpu"}))
    with pytest.raises(ConfigError, match=r"backend\.vectorize.*no C compiler found.*backend\.numerics: native"):
        prepare(cfg("fedavg", backend={"device": "cpu"}))


def test_a_group_trained_in_chunks_gives_the_same_table(monkeypatch):
    """backend.max_group: a step's group trains in chunks of at most that many clients (what a GPU runner's memory
    allows by the footprint estimate, else), in order; on a CPU the numbers are the unchunked run's exactly (each
    client's computation is its own). A bad value names the key."""
    from raysim.runner import executors

    sizes, original = [], executors.Vectorized._train

    def spy(run, g, model, cids):
        sizes.append(len(cids))
        return original(run, g, model, cids)

    monkeypatch.setattr(executors.Vectorized, "_train", staticmethod(spy))
    whole = table(cfg("fedavg"))
    assert set(sizes) == {5}
    sizes.clear()
    chunked = table(cfg("fedavg", backend={"max_group": 2}))
    assert sizes and max(sizes) == 2 and sum(sizes) == 10  # 5 clients, 2 rounds
    pd.testing.assert_frame_equal(whole, chunked)
    with pytest.raises(ConfigError, match="backend.max_group"):
        cfg("fedavg", backend={"max_group": -1})


def test_a_heterogeneous_cohort_trains_and_evaluates_one_group_per_architecture(monkeypatch):
    """FedProto over two architectures (cycled): the vectorised executor trains one batched group per architecture
    and evaluates one per architecture; the table is the loop's within the stated tolerance."""
    from raysim.runner import executors

    sizes, original = [], executors.Vectorized._train

    def spy(run, g, model, cids):
        sizes.append((type(model).__name__, model.embed_dim, len(cids)))
        return original(run, g, model, cids)

    monkeypatch.setattr(executors.Vectorized, "_train", staticmethod(spy))
    data = {"dataset": "mnist5k", "num_clients": 6, "partition": "iid",
            "partition_params": {"samples_per_client": 12, "test_per_client": 6}}
    model = {"per_client": [{"arch": "cnn_mnist", "params": {"out_channels": 8, "embed_dim": 16}},
                            {"arch": "cnn_mnist", "params": {"out_channels": 4, "embed_dim": 16}}]}
    vec = table(cfg("fedproto", data=data, model=model))
    assert len(sizes) == 4 and all(n == 3 for _, _, n in sizes), sizes  # 2 rounds x 2 architectures x 3 clients
    close(table(cfg("fedproto", vectorize=False, data=data, model=model)), vec)


@pytest.mark.parametrize("algo,over", [
    ("moon", {}),  # Dirichlet sizes: unequal batch counts; every client in both rounds (rows of one stack)
    ("scaffold", {}),  # unequal sizes: unequal K_eff per client
    ("moon", {"clients_per_round": 3, "rounds": 3, "dropout": 0.5}),  # rows of several groups' stacks; dropout
    ("scaffold", {"clients_per_round": 3, "rounds": 3}),  # c_i: zeros, rows of one earlier group, of several
    ("moon", {"model": BN_MODEL, "rounds": 1}),  # frozen models with BatchNorm: eval-mode grouped forwards
    # FedGen from its second round: each step's noise and labels drawn per client (StepDraws), the generator's
    # outputs for the group at once. Its server trains the generator with Adam, whose first steps are ~gen_lr *
    # sign(g): a last-bit difference in a near-zero gradient becomes a gen_lr-sized one (~1e-3 relative in the next
    # round's losses at the default 3e-4), so the generator barely moves here and the client step is what is compared
    ("fedgen", {"params": {"gen_steps": 2, "gen_lr": 1e-9}}),
    ("fedgen", {"clients_per_round": 3, "dropout": 0.5, "params": {"gen_steps": 2, "gen_lr": 1e-9}}),
    # VHL: each step's virtual batch (counter-based draws, the group's at once); one round: its SupCon at T = 0.07
    # amplifies last-bit differences round over round (~1e-4 relative in the second round's losses)
    ("vhl", {"clients_per_round": 3, "rounds": 1, "params": {"virtual_per_class": 4, "gen_channels": 8}}),
])
def test_per_client_inputs_vectorised_equal_loop(algo, over, monkeypatch):
    """Methods whose objective has per-client inputs (``LocalStart.rows``: MOON's previous model, SCAFFOLD's control
    variate c_i; ``LocalStart.draws``: FedGen's noise and sampled labels, VHL's virtual batches) train as one group through
    ``row_objective`` and finish in their batch form (``client_final_group``: states and uploads as rows of the
    stacks), both checked by spies, and the table (train losses, MOON's contrastive term, SCAFFOLD's control norm,
    FedGen's teacher and latent terms, accuracies) is the loop's within the stated tolerance."""
    from algorithms import fedgen, moon, scaffold, vhl

    owner = {"moon": moon.Moon, "scaffold": scaffold.Scaffold, "fedgen": fedgen.FedGen, "vhl": vhl.VHL}[algo]
    batch_form, row_form, calls, rows = owner.client_final_group, owner.row_objective, [], []

    def spy(self, group):
        out = batch_form(self, group)
        calls.append(out is not None and len(group.states) >= 2)
        return out

    def row_spy(self, start):
        rows.append(1)
        return row_form(self, start)

    monkeypatch.setattr(owner, "client_final_group", spy)
    monkeypatch.setattr(owner, "row_objective", row_spy)
    over = dict(over)
    dropout = over.pop("dropout", 0.0)
    vec = table(cfg(algo, dropout=dropout, **over))
    assert calls and all(calls), calls
    assert rows
    loop = table(cfg(algo, vectorize=False, dropout=dropout, **over))
    close(loop, vec)
    metrics = set(vec.metric)
    assert {"train_loss", "test_acc"} <= metrics
    assert {"moon": {"train_con"}, "scaffold": {"control_norm"}, "fedgen": {"train_teacher"},
            "vhl": {"train_ce_virtual", "train_con_noise"}}[algo] <= metrics
