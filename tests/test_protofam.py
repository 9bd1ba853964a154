"""The prototype family and baselines: server steps on hand examples, FedTGP's generator, FedProto-UH's head, FedPU's
split inside the client, the heterogeneous zoo, config errors, and whole tiny runs (determinism, sequential == Ray)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms.fedtgp import PrototypeGenerator, ServerTraining, train_generator
from algorithms.prototype_maths import UNLABELLED, pairwise_distances, tgp_margin
from raysim import rng as rngmod
from raysim.algorithm import Context, ServerContext
from raysim.config import make_config
from raysim.data.federated import ClientData
from raysim.errors import ConfigError
from raysim.messages import Message, state_message
from raysim.models import ZOO_28, build_model, client_archs, num_parameters
from raysim.runner.runners import make_algorithm
from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.io.checkpoints import load_checkpoint

NEW = ["fedtgp", "fedproto_uh", "fedprox", "fedper", "lgfedavg", "fesem", "feddistill"]


def min_pairwise_distance(protos: torch.Tensor) -> float:
    """The smallest distance between two different prototypes (how far apart the generator pushed them)."""
    d = pairwise_distances(protos, protos)
    d = d + torch.diag(torch.full((protos.shape[0],), float("inf"), dtype=d.dtype))
    return float(d.min())


def make_algo(tiny, name, params=None, **over):
    from tests.conftest import method_overrides

    cfg = tiny(algorithm={"name": name, "params": params or {}}, **{**method_overrides(name), **over})
    prep = prepare(cfg)
    return make_algorithm(prep.spec), prep


def sctx(task, round_idx=0):
    return ServerContext(round_idx, rngmod.SERVER, task.seed, torch.device("cpu"), task)


# ---------------------------------------------------------------------------------------------------------------
# server steps on hand examples


def _n(n):
    return Message("num_samples", {"n": torch.tensor([n])})


def test_fedper_averages_bodies_and_keeps_heads(tiny):
    algo, prep = make_algo(tiny, "fedper", {"shared": "body"})
    ups = {0: {"shared": Message("body_weights", {"body.w": torch.tensor([1.0, 2.0])}), "num_samples": _n(1)},
           1: {"shared": Message("body_weights", {"body.w": torch.tensor([3.0, 6.0])}), "num_samples": _n(3)}}
    state, _ = algo.aggregate({}, ups, sctx(prep.task))
    assert torch.allclose(state["shared"]["body.w"], torch.tensor([2.5, 5.0]))  # (1*[1,2] + 3*[3,6]) / 4
    # a client loads the global body but keeps its own head
    model = prep.task.build_model(0)
    own = {k: v + 1.0 for k, v in model.state_dict().items()}
    glob = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if k.startswith("body.")}
    algo.load(model, {"shared": state_message("body_weights", glob)}, {"model": own})
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.zeros_like(v) if k.startswith("body.") else own[k])


def test_lgfedavg_averages_heads_and_rejects_mismatched_heads(tiny):
    algo, prep = make_algo(tiny, "lgfedavg")
    ups = {0: {"shared": Message("head_weights", {"head.b": torch.tensor([0.0])}), "num_samples": _n(2)},
           3: {"shared": Message("head_weights", {"head.b": torch.tensor([6.0])}), "num_samples": _n(1)}}
    state, _ = algo.aggregate({}, ups, sctx(prep.task))
    assert torch.allclose(state["shared"]["head.b"], torch.tensor([2.0]))
    with pytest.raises(ConfigError) as e:  # mlp's head is a bare Linear, the zoo's is Dropout -> Linear
        make_algo(tiny, "lgfedavg", model={"assign": "cycle", "per_client": [
            {"arch": "mlp", "params": {"embed_dim": 16}}, {"arch": "cnn_small", "params": {"embed_dim": 32}}]})
    assert e.value.field == "model.per_client"


def test_feddistill_server_mean_per_class(tiny):
    algo, prep = make_algo(tiny, "feddistill")
    c = prep.task.num_classes
    state = algo.init_server_state(sctx(prep.task))
    la = torch.arange(2 * c, dtype=torch.float32).reshape(2, c)
    ups = {0: {"logits": Message("class_logits", {"logits": la, "classes": torch.tensor([0, 1])})},
           1: {"logits": Message("class_logits", {"logits": torch.full((1, c), 10.0), "classes": torch.tensor([1])})}}
    state, _ = algo.aggregate(state, ups, sctx(prep.task))
    assert torch.allclose(state["logits"][0], la[0])  # only client 0 holds class 0
    assert torch.allclose(state["logits"][1], (la[1] + 10.0) / 2)  # plain mean over holders
    assert state["mask"].tolist()[:3] == [True, True, False]
    # the next round: client 1 uploads class 2 only; class 0 and 1 keep their values
    ups2 = {1: {"logits": Message("class_logits", {"logits": torch.ones(1, c), "classes": torch.tensor([2])})}}
    state2, _ = algo.aggregate(state, ups2, sctx(prep.task, 1))
    assert torch.allclose(state2["logits"][:2], state["logits"][:2]) and bool(state2["mask"][2])


def test_fesem_downlink_is_only_the_assigned_centre(tiny):
    algo, prep = make_algo(tiny, "fesem", {"num_clusters": 2})
    state = algo.init_server_state(sctx(prep.task))
    assert state["assign"].tolist() == algo.init_server_state(sctx(prep.task))["assign"].tolist()  # seeded
    payload = algo.broadcast(state, sctx(prep.task))
    for cid in range(prep.task.num_clients):
        down = algo.downlink(payload, cid)
        k = int(state["assign"][cid])
        assert down["model"] is payload[f"centre_{k}"]
        assert sum(m.num_floats for m in down.values()) == num_parameters(prep.task.build_model(0))
    # two centres start from different initialisations
    c0, c1 = state["centres"]
    assert not torch.equal(c0["head.weight"], c1["head.weight"])


def test_fedprox_loss_adds_the_proximal_term(tiny):
    algo, prep = make_algo(tiny, "fedprox", {"mu": 0.5})
    model = prep.task.build_model(0)
    glob = {k: v + 0.1 for k, v in model.state_dict().items()}  # every weight 0.1 away
    from raysim.algorithm import LocalStart

    loss_fn = algo.objective(LocalStart(aux={"view": None, "global": state_message("weights", glob).tensors}))
    x = torch.randn(4, *prep.task.input_shape)
    y = torch.tensor([0, 1, 0, 1])
    loss, parts = loss_fn(model, x, y, 0)
    n = num_parameters(model)
    assert float(parts["prox"]) == pytest.approx(0.5 / 2 * n * 0.01, rel=1e-4)
    assert float((loss - parts["prox"]).detach()) == pytest.approx(float(torch.nn.functional.cross_entropy(model(x), y).detach()), rel=1e-5)


def test_fedprox_server_is_sample_weighted_average(tiny):
    algo, prep = make_algo(tiny, "fedprox", {"mu": 0.1})
    ups = {2: {"model": Message("weights", {"w": torch.tensor([4.0])}), "num_samples": _n(1)},
           5: {"model": Message("weights", {"w": torch.tensor([0.0])}), "num_samples": _n(3)}}
    state, _ = algo.aggregate({}, ups, sctx(prep.task))
    assert torch.allclose(state["model"]["w"], torch.tensor([1.0]))  # (1*4 + 3*0) / 4


def test_fesem_aggregate_reassigns_participants_only(tiny):
    algo, prep = make_algo(tiny, "fesem", {"num_clusters": 2})
    state = {"centres": [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([10.0, 10.0])}],
             "assign": torch.tensor([1, 1, 0, 0, 1, 0])}
    ups = {0: {"model": Message("weights", {"w": torch.tensor([1.0, 1.0])})},
           3: {"model": Message("weights", {"w": torch.tensor([3.0, 1.0])})},
           4: {"model": Message("weights", {"w": torch.tensor([8.0, 9.0])})}}
    new, m = algo.aggregate(state, ups, sctx(prep.task))
    # client 0 moves 1 -> 0; clients 3, 4 stay; 1, 2, 5 did not take part and keep their clusters
    assert new["assign"].tolist() == [0, 1, 0, 0, 1, 0]
    assert torch.allclose(new["centres"][0]["w"], torch.tensor([2.0, 1.0]))  # mean of (1,1), (3,1)
    assert torch.allclose(new["centres"][1]["w"], torch.tensor([8.0, 9.0]))
    assert m["fesem_moved"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# FedTGP


def _toy_uploads(num_classes, dim, clients=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 0.2 * torch.randn(num_classes, dim, generator=g)  # classes close together
    ups = {}
    for i in range(clients):
        p = centres + 0.02 * torch.randn(num_classes, dim, generator=g)
        ups[i] = {"protos": Message("prototypes", {"protos": p, "classes": torch.arange(num_classes),
                                                   "counts": torch.full((num_classes,), 5)})}
    return ups


def test_tgp_generator_spreads_global_prototypes():
    torch.manual_seed(0)
    c, d = 4, 8
    ups = _toy_uploads(c, d)
    f = torch.cat([u["protos"]["protos"] for u in ups.values()])
    lab = torch.cat([u["protos"]["classes"] for u in ups.values()])
    q = torch.stack([f[lab == k].mean(0) for k in range(c)])  # what FedProto would broadcast
    gen = PrototypeGenerator(c, d, d)
    with torch.no_grad():
        before = gen(torch.arange(c))
    delta = tgp_margin(q, torch.ones(c, dtype=torch.bool), 100.0)
    hist = train_generator(gen, f, lab, delta, ServerTraining(epochs=20, batch_size=4, lr=0.05),
                           torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = gen(torch.arange(c))
    assert hist[-1] < hist[0]
    assert min_pairwise_distance(after) > 1.3 * min_pairwise_distance(q)
    assert min_pairwise_distance(after) > 1.3 * min_pairwise_distance(before)


def test_fedtgp_aggregate_persists_generator_and_resumes(tiny):
    params = {"server_epochs": 3, "margin_threshold": 0.5}
    algo, prep = make_algo(tiny, "fedtgp", params)
    task = prep.task
    c, d = task.num_classes, task.build_model(0).embed_dim
    ups = _toy_uploads(c, d)
    s0 = algo.init_server_state(sctx(task, rngmod.NO_ROUND))
    assert algo.broadcast(s0, sctx(task)) == {}  # round 0: nothing to regularise with
    s1, m1 = algo.aggregate(s0, ups, sctx(task, 0))
    assert m1["tgp_margin"] == pytest.approx(0.5)  # capped by tau
    assert not torch.equal(s1["generator"]["embedding.weight"], s0["generator"]["embedding.weight"])
    msg = algo.broadcast(s1, sctx(task, 1))["global_protos"]
    assert msg["protos"].shape == (c, d) and msg.num_floats == c * d
    # resume: a fresh instance continuing from the saved state equals the uninterrupted one
    s2, _ = algo.aggregate(s1, ups, sctx(task, 1))
    other, _ = make_algo(tiny, "fedtgp", params)
    saved = {k: (v if not isinstance(v, dict) else {kk: vv.clone() for kk, vv in v.items()}) for k, v in s1.items()}
    s2b, _ = other.aggregate(saved, ups, sctx(task, 1))
    assert torch.equal(s2["protos"], s2b["protos"])
    # a different round draws a different batch order -> (almost surely) different prototypes
    s2c, _ = other.aggregate(saved, ups, sctx(task, 5))
    assert not torch.equal(s2["protos"], s2c["protos"])


def test_fedtgp_margin_flag_and_config_errors(tiny):
    algo, prep = make_algo(tiny, "fedtgp", {"server_epochs": 0, "margin": "paper"})
    ups = _toy_uploads(prep.task.num_classes, 16)
    _, m = algo.aggregate(algo.init_server_state(sctx(prep.task)), ups, sctx(prep.task))
    f = torch.cat([u["protos"]["protos"] for u in ups.values()]).reshape(3, -1, 16).mean(0)
    d = torch.cdist(f.double(), f.double())
    assert m["tgp_margin"] == pytest.approx(float(d.max()), rel=1e-5)
    for bad, field in [({"margin": "both"}, "margin"), ({"server_epochs": -1}, "server_epochs"),
                       ({"proto_collect": "during_train"}, "proto_collect")]:
        with pytest.raises(ConfigError) as e:
            make_algo(tiny, "fedtgp", bad)
        assert e.value.field == f"algorithm.params.{field}"


def test_fedtgp_checkpoint_carries_generator(tiny, tmp_path):
    cfg = tiny(rounds=2, algorithm={"name": "fedtgp", "params": {"server_epochs": 2}})
    res = run_experiment(cfg, out_dir=tmp_path / "run")
    ck = load_checkpoint(res.out_dir / "checkpoints" / "final")
    gen = ck["server_state"]["generator"]
    assert set(gen) == {"embedding.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    assert bool(ck["server_state"]["trained"])
    t = res.table
    assert (t[t.metric == "tgp_margin"]["value"] > 0).all()


# ---------------------------------------------------------------------------------------------------------------
# FedProto-UH and FedPU inside clients


def test_fedproto_uh_head_is_fixed_shared_and_orthogonal(tiny):
    algo, prep = make_algo(tiny, "fedproto_uh", {"head": "cosine"})
    task = prep.task
    from raysim.algorithm import ModelCache

    cache = ModelCache(task, torch.device("cpu"))
    states = {}
    for cid in (0, 1):
        ctx = Context(rngmod.NO_ROUND, cid, task.seed, torch.device("cpu"), task, cache)
        states[cid] = algo.init_client_state(ctx)
    w0 = states[0]["model"]["head.weight"]
    assert torch.equal(w0, states[1]["model"]["head.weight"])  # same fixed head everywhere, from the seed
    assert torch.allclose(w0 @ w0.t(), torch.eye(task.num_classes), atol=1e-5)
    data = prep.fed_data.clients[0]
    ctx = Context(0, 0, task.seed, torch.device("cpu"), task, cache)
    up = algo.client_update({}, states[0], data, ctx)
    assert torch.equal(up.state["model"]["head.weight"], w0)  # never trained
    assert float(up.state["model"]["head.scale"]) != 1.0  # the scale is learnt
    protos = up.upload["protos"]["protos"]
    assert bool((protos.norm(dim=1) <= 1 + 1e-5).all())  # means of unit-norm embeddings (the normalised z)
    assert bool((protos.norm(dim=1) > 0.5).all())


def test_fedpu_client_trains_without_hidden_labels(tiny):
    """Prototypes come from labelled samples only, and the result does not depend on the hidden labels' values."""
    params = {"positive_rate": 0.5, "pu_weight": 1.0, "pu_min_class": 1}  # the tiny clients hold 10 per class
    algo, prep = make_algo(tiny, "fedproto", params)
    task = prep.task
    data = prep.fed_data.clients[0]
    from algorithms import fedpu
    from raysim.algorithm import ModelCache

    view = fedpu.make_view(data, task.num_classes, task.seed, fedpu.PUParams(positive_rate=0.5, pu_min_class=1))
    assert (view.y_obs == UNLABELLED).sum() > 0 and (view.y_obs >= 0).sum() > 0
    assert torch.equal(view.y_obs, fedpu.make_view(data, task.num_classes, task.seed, fedpu.PUParams(positive_rate=0.5, pu_min_class=1)).y_obs)

    def run(d):
        cache = ModelCache(task, torch.device("cpu"))
        ctx0 = Context(rngmod.NO_ROUND, 0, task.seed, torch.device("cpu"), task, cache)
        rngmod.seed_torch_global(task.seed, 0, 0, "update")
        state = algo.init_client_state(ctx0)
        return algo.client_update({}, state, d, Context(0, 0, task.seed, torch.device("cpu"), task, cache))

    # monkeypatch the view so the hidden rows' true labels are scrambled: training must not notice
    a = run(data)
    orig = fedpu.make_view
    try:
        scrambled_y = data.y_train.clone()
        hidden = view.y_obs == UNLABELLED
        scrambled_y[hidden] = (scrambled_y[hidden] + 1) % task.num_classes
        scrambled = ClientData(0, data.x_train, scrambled_y, data.x_test, data.y_test, data.classes, data.num_classes)
        fedpu.make_view = lambda *args, **kw: view  # same split as for the real labels
        b = run(scrambled)
    finally:
        fedpu.make_view = orig
    for k in a.state["model"]:
        assert torch.equal(a.state["model"][k], b.state["model"][k])
    assert torch.equal(a.upload["protos"]["protos"], b.upload["protos"]["protos"])
    counts = a.upload["protos"]["counts"]
    assert int(counts.sum()) == int((view.y_obs >= 0).sum())  # prototypes over labelled samples only


def test_fedpu_config_errors(tiny):
    for name in ("fedproto", "fedavg"):
        with pytest.raises(ConfigError) as e:
            make_algo(tiny, name, {"positive_rate": 0.0})
        assert e.value.field == "algorithm.params.positive_rate"
        with pytest.raises(ConfigError) as e:
            make_algo(tiny, name, {"pu_weight": -1})
        assert e.value.field == "algorithm.params.pu_weight"


# ---------------------------------------------------------------------------------------------------------------
# heterogeneous zoo


def test_zoo_builds_four_distinct_architectures_with_one_embedding():
    mods = {}
    for arch in ZOO_28:
        from raysim.config import ArchSpec

        m = build_model(ArchSpec(arch, {}), (1, 28, 28), 10)
        logits, z = m(torch.randn(3, 1, 28, 28), return_embedding=True)
        assert logits.shape == (3, 10) and z.shape == (3, 50)
        assert list(m.head.state_dict()) == ["1.weight", "1.bias"]
        mods[arch] = {type(x).__name__ for x in m.body.modules()}
    assert "BasicBlock" in mods["resnet_small"] and "InvertedResidual" in mods["mobilenet_small"]
    assert "BatchNorm2d" not in mods["cnn4"] and "Dropout" in mods["cnn_mnist"]


def test_tier_assignment_and_errors():
    cfg = make_config({"model": {"assign": "tier", "tiers": [2, 0, 1], "per_client": [
        {"arch": "cnn_mnist"}, {"arch": "cnn4"}, {"arch": "resnet_small"}]}})
    assert [a.arch for a in client_archs(cfg.model, 5)] == ["resnet_small", "cnn_mnist", "cnn4", "resnet_small", "cnn_mnist"]
    with pytest.raises(ConfigError) as e:
        make_config({"model": {"assign": "tier", "tiers": [3], "per_client": [{"arch": "cnn4"}]}})
    assert e.value.field == "model.tiers"
    # without model.tiers the tiers must come from an env section's devices; with neither, prepare() says so
    from raysim.engine.prepare import prepare
    from tests.conftest import tiny_config

    with pytest.raises(ConfigError) as e:
        prepare(make_config(tiny_config(model={"assign": "tier", "per_client": [{"arch": "mlp"}]})))
    assert e.value.field == "model.tiers"


def test_homogeneous_baselines_reject_mixed_models(tiny):
    mixed = {"assign": "cycle", "per_client": [{"arch": "mlp", "params": {"embed_dim": 16}},
                                               {"arch": "mlp", "params": {"embed_dim": 16, "hidden": 8}}]}
    for name in ("fedprox", "fedper", "fesem"):
        with pytest.raises(ConfigError) as e:
            make_algo(tiny, name, model=mixed)
        assert e.value.field == "model.per_client"
    for name in ("fedtgp", "fedproto_uh", "lgfedavg", "feddistill"):
        make_algo(tiny, name, model={**mixed, "per_client": [{"arch": "mlp", "params": {"embed_dim": 16}},
                                                             {"arch": "cnn_small", "params": {"embed_dim": 16}}]})


# ---------------------------------------------------------------------------------------------------------------
# whole tiny runs


def _final(table, metric="test_acc"):
    d = table[(table.scope == "mean") & (table.metric == metric)]
    return d[d["round"] == d["round"].max()]["value"].item()


def _clients_mean(table, metric="test_acc"):
    """The mean over clients (each client counts once, as the seeds report) of the client rows at the last evaluated
    round, computed here from the rows."""
    d = table[(table.scope == "client") & (table.metric == metric)]
    return float(d[d["round"] == d["round"].max()]["value"].mean())


@pytest.mark.parametrize("name", NEW)
def test_tiny_run_is_finite_and_deterministic(tiny, name):
    params = {"server_epochs": 3} if name == "fedtgp" else {}
    from tests.conftest import method_overrides

    cfg = tiny(rounds=2, algorithm={"name": name, "params": params}, **method_overrides(name))
    a = run_experiment(cfg, write=False).table
    b = run_experiment(cfg, write=False).table
    assert without_timing(a).equals(without_timing(b))
    assert _final(a) == pytest.approx(_clients_mean(a))  # every client evaluated, the mean row is their mean
    assert set(a[(a.scope == "client") & (a.metric == "test_acc")]["client_id"]) == set(range(cfg.data.num_clients))
    up = a[(a.scope == "total") & (a.metric == "up_floats")]["value"]
    assert (up > 0).all()  # every method communicates something every round


@pytest.mark.parametrize("name", ["fedavg", "fesem", "fedper"])
def test_uploads_of_one_runner_are_not_aliased(tiny, name):
    """Weights uploaded by clients of one runner must be copies, not views of the live module that the next client
    is loaded into (regression: state_message did not copy on CPU, so FedAvg averaged the last client only)."""
    from raysim.runner.runners import ClientRunner, ServerRunner

    from tests.conftest import method_overrides

    prep = prepare(tiny(algorithm={"name": name, "params": {}}, **method_overrides(name)))
    srv, runner = ServerRunner(prep.spec), ClientRunner(prep.spec, prep.fed_data.clients)
    from raysim.steps import CLASSIC_ROUND

    ups, _ = runner.run_client_step(CLASSIC_ROUND[0], srv.initial_payload(0), 0, 0, [0, 1, 2])
    key = "model" if "model" in ups[0] else "shared"
    w = [ups[i][key].tensors for i in range(3)]
    name0 = sorted(k for k in w[0] if w[0][k].is_floating_point())[0]
    assert not torch.equal(w[0][name0], w[2][name0])


@pytest.mark.parametrize("name", NEW)
def test_empty_round_keeps_server_state(tiny, name):
    import pickle

    algo, prep = make_algo(tiny, name)
    state = algo.init_server_state(sctx(prep.task, rngmod.NO_ROUND))
    new, metrics = algo.aggregate(state, {}, sctx(prep.task))
    assert new is state and metrics == {}
    pickle.dumps(new)


def test_pu_runs_for_fedavg_and_fedproto(tiny):
    for name in ("fedavg", "fedproto"):
        cfg = tiny(rounds=2, algorithm={"name": name, "params": {"positive_rate": 0.3, "pu_weight": 0.5,
                                                                 "pu_min_class": 1}})
        t = run_experiment(cfg, write=False).table
        pu = t[t.metric == "train_pu"]["value"]
        assert np.isfinite(pu).all() and (pu != 0).any()  # the PU term is active (rate 0.3 < 1)
        assert _final(t) == pytest.approx(_clients_mean(t))
