"""The contract's general hooks (no engine hook serves one method): the server's context apart from the client's,
setup schedules starting with an empty payload, the local epoch as an argument of the loss function (pure
objectives, vectorised included), declared server-held data validated before the run, cluster agreement only with
domains and a clustered method, each method's headline metrics on the progress bar."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from raysim import rng as rngmod
import torch.nn.functional as F

from raysim.algorithm import Algorithm, ClientUpdate, Context, LocalStart, LocalTraining, ServerContext
from raysim.engine import loop
from raysim.engine.loop import run_experiment
from raysim.engine.prepare import prepare
from raysim.errors import ConfigError
from raysim.config.registry import algorithm_class
from raysim.steps import ALL, ClientStep, ServerStep
from tests.conftest import register_for_test


# -- test methods ----------------------------------------------------------------------------------------------------

class SetupProbe(Algorithm):
    """A setup schedule whose first step is a client step: it reports what payload it was given."""

    name = "setup_probe"
    needs_embedding = False

    def setup_schedule(self):
        return (ClientStep("hello", clients=ALL), ServerStep("count"))

    def hello(self, payload, state, data, ctx):
        return ClientUpdate(state, {}, {"setup_payload_empty": float(isinstance(payload, dict) and payload == {})})

    def count(self, server_state, uploads, ctx):
        from raysim.algorithm import ServerUpdate

        return ServerUpdate(server_state, None, {"setup_ctx_is_server": float(isinstance(ctx, ServerContext))})

    def client_update(self, payload, state, data, ctx):
        return ClientUpdate(state, {}, {"client_ctx_is_server": float(isinstance(ctx, ServerContext))})


class NeedsServerVal(SetupProbe):
    name = "needs_server_val"
    server_data = ("server_val",)


class NeedsUnknown(SetupProbe):
    name = "needs_unknown"
    server_data = ("server_secret",)


class ClassWantsTest(SetupProbe):
    name = "class_wants_test"
    server_data = ("global_test",)  # only an instance's named option may add the test set


class InstanceAddsSecret(NeedsServerVal):
    name = "instance_adds_secret"

    def declared_server_data(self):
        return ("server_val", "server_secret")


class EpochScaled(LocalTraining):
    """CE scaled by (1 + epoch): the trained weights depend on every batch getting its own epoch."""

    name = "epoch_scaled"
    needs_embedding = False

    @dataclass(frozen=True)
    class Params:
        vectorizable: bool = True

    def init_client_state(self, ctx: Context):
        return {"model": {k: v.clone() for k, v in self.task.build_model(ctx.client_id).state_dict().items()}}

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        model.load_state_dict(state["model"])
        return LocalStart()

    def objective(self, start: LocalStart):
        def loss_fn(model, xb, yb, epoch):
            ce = F.cross_entropy(model(xb), yb)
            return (1.0 + epoch) * ce, {"ce": ce.detach(), "epoch": float(epoch)}

        return loss_fn

    def vectorizable(self, start: LocalStart) -> bool:
        return self.params.vectorizable

    def client_final(self, model, start, payload, state, data, ctx: Context):
        return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}, {}

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = self.live_model(ctx)
        model.load_state_dict(state["model"])
        return {"w_sum": sum(float(p.detach().double().sum()) for p in model.parameters())}


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, setup_probe="tests.test_hooks:SetupProbe",
                      needs_server_val="tests.test_hooks:NeedsServerVal", needs_unknown="tests.test_hooks:NeedsUnknown",
                      epoch_scaled="tests.test_hooks:EpochScaled", class_wants_test="tests.test_hooks:ClassWantsTest",
                      instance_adds_secret="tests.test_hooks:InstanceAddsSecret")


def rows(df, metric, scope="client"):
    return df[(df["scope"] == scope) & (df["metric"] == metric)]


# -- contexts and setup schedules --------------------------------------------------------------------------------------

def test_setup_schedule_starts_with_an_empty_payload_and_contexts_are_split(tiny):
    res = run_experiment(tiny(rounds=1, algorithm={"name": "setup_probe", "params": {}}), write=False)
    t = res.table
    first = rows(t, "setup_payload_empty").query("round == -1")
    assert len(first) == 6 and first["value"].eq(1.0).all()  # every client's first setup step saw {}
    assert rows(t, "setup_ctx_is_server", "server")["value"].tolist() == [1.0]
    assert rows(t, "client_ctx_is_server").query("round == 0")["value"].eq(0.0).all()
    assert res.metadata["setup_schedule"] == ["ClientStep:hello", "ServerStep:count"]
    assert not hasattr(Context(0, 0, 1, "cpu", None), "failures")  # the client's context has no server fields


def test_no_method_starts_its_setup_with_a_no_op_server_step():
    for name in ("slaugfl", "fedmd"):
        cls = algorithm_class(name)
        sched = cls.setup_schedule(object.__new__(cls))  # a constant schedule: no parameters needed
        assert isinstance(sched[0], ClientStep), (name, sched[0])


# -- server-held data ------------------------------------------------------------------------------------------------

def test_declared_server_data_missing_is_one_config_error_before_any_data_loads(tiny, monkeypatch):
    from raysim.engine import prepare as prep_mod

    def no_data(*a, **k):
        raise AssertionError("data loaded before the server data was checked")

    monkeypatch.setattr(prep_mod, "build_federated_data", no_data)
    with pytest.raises(ConfigError, match="data.server_val") as e:
        prepare(tiny(algorithm={"name": "needs_server_val", "params": {}}))
    assert e.value.field == "data.server_val" and "needs_server_val" in str(e.value)
    with pytest.raises(ConfigError) as e:
        prepare(tiny(algorithm={"name": "slaugfl", "params": {}}))
    assert e.value.field == "data.server_val"
    with pytest.raises(TypeError, match="server_secret"):
        prepare(tiny(algorithm={"name": "needs_unknown", "params": {}}))
    with pytest.raises(TypeError, match="global_test"):  # a class never declares the test set
        prepare(tiny(algorithm={"name": "class_wants_test", "params": {}}))


def test_an_instance_adds_only_the_test_set_and_only_by_a_named_option(tiny):
    """Issue 34: SlaugFL's ``selection: test`` (the seed's protocol) hands the server the test set through
    ``declared_server_data``; the default does not; any other addition by an instance is refused."""
    from raysim.runner.runners import server_data

    with pytest.raises(TypeError, match="server_secret"):
        prepare(tiny(algorithm={"name": "instance_adds_secret", "params": {}}, data__server_val=20))
    slaug = {"gen_steps": 2, "gen_channels": 4, "prep_epochs": 1}
    default = prepare(tiny(algorithm={"name": "slaugfl", "params": slaug}, data__server_val=20))
    assert default.spec.server_data == ("server_val",)
    test_sel = prepare(tiny(algorithm={"name": "slaugfl", "params": {**slaug, "selection": "test"}}, data__server_val=20))
    assert test_sel.spec.server_data == ("server_val", "global_test")
    held = server_data(test_sel.spec, test_sel.fed_data)
    assert held["global_test"] is test_sel.fed_data.global_test


def test_only_declared_server_data_reaches_the_server(tiny):
    from raysim.runner.runners import ServerRunner, server_data

    prep = prepare(tiny(algorithm={"name": "needs_server_val", "params": {}}, data__server_val=20))
    held = server_data(prep.spec, prep.fed_data)
    assert list(held) == ["server_val"] and len(held["server_val"]) == 20
    assert ServerRunner(prep.spec, None, held)._ctx(0).server_data["server_val"] is held["server_val"]
    plain = prepare(tiny(algorithm={"name": "setup_probe", "params": {}}, data__server_val=20))
    assert plain.fed_data.server_val is not None and server_data(plain.spec, plain.fed_data) == {}


# -- the epoch as an argument of the loss function ---------------------------------------------------------------------

def test_objective_receives_the_epoch_in_the_loop_and_vectorised(tiny):
    """Two local epochs: the per-batch ``epoch`` part averages to 0.5 (every batch of epoch 0 and of epoch 1); the
    vectorised executor, which groups clients by batch size and epoch, trains the same weights as the loop."""
    over = dict(rounds=2, train={"local_epochs": 2, "batch_size": 4, "lr": 0.05, "momentum": 0.0},
                data={"dataset": "synthetic", "num_clients": 4, "partition": "dirichlet",
                      "partition_params": {"alpha": 0.5, "samples_per_client": 14, "min_samples": 5}})
    lp = run_experiment(tiny(algorithm={"name": "epoch_scaled", "params": {"vectorizable": False}}, **over),
                        write=False).table
    ep = rows(lp, "train_epoch")
    assert len(ep) > 0
    assert ep["value"].eq(0.5).all()  # the mean epoch over the batches: as many batches in epoch 0 as in epoch 1
    vec = run_experiment(tiny(algorithm={"name": "epoch_scaled", "params": {}}, backend={"name": "sequential",
                                                                                         "vectorize": True}, **over),
                         write=False).table
    a, b = rows(lp, "w_sum").sort_values(["round", "client_id"]), rows(vec, "w_sum").sort_values(["round", "client_id"])
    assert len(a) == len(b) > 0
    for x, y in zip(a["value"], b["value"]):
        assert x == pytest.approx(y, rel=1e-4, abs=1e-4)


def test_vmap_groups_clients_at_different_epochs_apart():
    """Clients of 8 and 12 samples (batch 4): at step 2 both have a batch of 4, one in epoch 1, the other in epoch 0;
    an epoch-dependent loss gives each the loop's weights."""
    from raysim.config import TrainConfig
    from raysim.runner.vectorized import vmap_local_sgd
    from tests.members import zip_members
    from raysim.training import TrainOptions, local_sgd

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.1, momentum=0.0)

    def loss_fn(m, xb, yb, epoch):
        return (1.0 + 3.0 * epoch) * F.cross_entropy(m(xb), yb), {}

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs = [torch.randn(8, 3), torch.randn(12, 3)]
    ys = [torch.randint(0, 2, (8,)), torch.randint(0, 2, (12,))]
    trained, _, _ = vmap_local_sgd(model, loss_fn, zip_members([start, start], xs, ys,
                                                               [rngmod.Counter(i) for i in range(2)],
                                                               [rngmod.Counter(9) for _ in range(2)]), cfg)
    for i in range(2):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        local_sgd(model, loss_fn, xs[i], ys[i], TrainOptions(cfg, rngmod.Counter(i)))
        for n, p in model.named_parameters():
            torch.testing.assert_close(trained[i][n], p.detach(), rtol=1e-5, atol=1e-6)


# -- cluster agreement ---------------------------------------------------------------------------------------------------

def test_cluster_agreement_only_with_domains_and_a_clustered_method(tiny, monkeypatch):
    made = []

    class Spy(loop.ClusterAgreement):
        def __init__(self):
            made.append(self)

    monkeypatch.setattr(loop, "ClusterAgreement", Spy)
    rotated = {"data": {"dataset": "synthetic", "num_clients": 4, "partition": "domain_dirichlet",
                        "partition_params": {"alpha": 100, "samples_per_client": 12}, "rotations": [0, 90]}}
    run_experiment(tiny(rounds=1, algorithm={"name": "fesem", "params": {}}), write=False)  # no domains
    assert made == []
    run_experiment(tiny(rounds=1, algorithm={"name": "fedavg", "params": {}}, **rotated), write=False)  # no clusters
    assert made == []
    t = run_experiment(tiny(rounds=1, algorithm={"name": "fesem", "params": {"num_clusters": 2}}, **rotated),
                       write=False).table
    assert len(made) == 1 and len(rows(t, "ari", "server")) == 1
    assert {n for n in ("ifca", "fesem", "pnicfl", "pnicfl_plus") if algorithm_class(n).reports_clusters} == {
        "ifca", "fesem", "pnicfl", "pnicfl_plus"}


# -- the progress bar ----------------------------------------------------------------------------------------------------

def test_progress_bar_shows_the_methods_headline_metrics(tiny, monkeypatch):
    shown = []

    from raysim.engine import callbacks

    class Spy(callbacks.ProgressBar):
        def on_round_end(self, run, round_idx, evaluated):
            out = super().on_round_end(run, round_idx, evaluated)
            shown.append(str(self.bar.postfix))
            return out

    monkeypatch.setattr(callbacks, "ProgressBar", Spy)
    run_experiment(tiny(rounds=1), write=False, progress="bar")  # fedproto
    assert "acc_proto=" in str(shown[-1]) and "acc=" in str(shown[-1])
    shown.clear()
    run_experiment(tiny(rounds=1, algorithm={"name": "fedavg", "params": {}}), write=False, progress="bar")
    assert "acc=" in str(shown[-1]) and "acc_proto" not in str(shown[-1])
    assert algorithm_class("mafml").headline == ("test_acc", "test_acc_all")
    assert algorithm_class("fedtgp").headline == ("test_acc", "test_acc_proto")


def test_progress_bar_reads_only_the_given_metrics():
    from types import SimpleNamespace

    from raysim.engine.callbacks import ProgressBar
    from raysim.io.results import ResultTable

    table = ResultTable("r")
    table.add(0, -1, "mean", "test_acc", 0.5, 6)
    table.add(0, -1, "mean", "test_acc_all", 0.25, 6)
    posted = []
    bar = ProgressBar(("test_acc_all",))
    bar.bar = SimpleNamespace(set_postfix=lambda post, refresh: posted.append(post), update=lambda n: None)
    bar.on_round_end(SimpleNamespace(table=table, env=None), 0, True)
    assert posted == [{"acc_all": "0.2500"}]
