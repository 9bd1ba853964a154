"""The mutual-learning family (MAFML, seed 003; IND, AGG, FedMD, FML, FedKD): the four-way local split, the seed's
BWT/FWT/ACC metrics, the projection (eq. 7) and the accuracy-weighted KL (eq. 3) by hand, MAFML's message sizes per
iteration, and sequential == Ray with one actor per node."""
import math

import pandas as pd
import pytest
import torch
import torch.nn as nn

from algorithms.mutual_maths import domain_metrics, project_conflicting, weighted_kl
from raysim.config import DataConfig
from raysim.data.federated import ClientData, build_federated_data, local_split_sizes
from raysim.engine.prepare import prepare
from raysim.engine.loop import run_experiment
from raysim.errors import ConfigError
from raysim.io.results import without_timing

SPLIT = {"public": 0.1, "val": 0.1, "test": 0.15}


def mutual_data(**over):
    return {"dataset": "synthetic", "num_clients": 4, "partition": "shared_base", "partition_params": {"per_class": 20},
            "rotations": [0, 90, 180, 270], "local_split": dict(SPLIT), **over}


def mutual_cfg(tiny, name, params=None, **over):
    base = {"rounds": 2, "clients_per_round": 4, "data": mutual_data(),
            "train": {"optimizer": "adam", "lr": 0.01, "weight_decay": 1e-4, "batch_size": 8,
                      "persist_optimizer": True, "local_steps": 3},
            "algorithm": {"name": name, "params": params if params is not None else {"iterations": 3}}}
    base.update(over)
    return tiny(**base)


def rows(df, metric, scope="client"):
    return df[(df["scope"] == scope) & (df["metric"] == metric)]


# -- data: the four-way split ------------------------------------------------------------------------------------

def test_local_split_sizes_follow_the_seed():
    assert local_split_sizes(1000, SPLIT) == (650, 100, 100, 150)
    assert local_split_sizes(1000, {"public": 0.05, "val": 0.1, "test": 0.15}) == (700, 50, 100, 150)
    with pytest.raises(Exception, match="local_split"):
        local_split_sizes(3, {"public": 0.3, "val": 0.3, "test": 0.3})


def test_local_split_data_is_disjoint_and_public_shares_are_indexed():
    cfg = DataConfig(**mutual_data())
    fed = build_federated_data(cfg, 3)
    assert fed.summary()["train_sizes"] == [150] * 4  # 200 samples: 130 private + 20 public
    assert fed.summary()["val_sizes"] == [20] * 4 and fed.summary()["test_sizes"] == [30] * 4
    assert fed.summary()["public_sizes"] == [20] * 4
    pub = fed.public
    assert pub.provenance == "public" and pub.owner.tolist() == sum([[i] * 20 for i in range(4)], [])
    base = DataConfig(**mutual_data(rotations=None))
    fb = build_federated_data(base, 3)
    for c, cb in zip(fed.clients, fb.clients):
        # the rotation is applied to every split of the client (90-degree multiples are exact)
        k = c.client_id
        assert torch.equal(c.x_train, torch.rot90(cb.x_train, k=-k, dims=(-2, -1)))
        rows_ = lambda x: {tuple(r.flatten().tolist()) for r in x}  # noqa: E731
        tr, va, te = rows_(cb.x_train), rows_(cb.x_val), rows_(cb.x_test)
        own_pub = rows_(fb.public.x[fb.public.owner == k])
        assert not (tr & va) and not (tr & te) and not (va & te)
        assert own_pub <= tr  # the client trains on private + its own public share
        assert len(tr | va | te) == 200  # together: the client's 200 base samples
        # every client holds all clients' test splits with their owners (for FWT / ACC)
        x, y, owner = c.cross_test
        assert torch.equal(x[owner == k], c.x_test) and torch.equal(y[owner == k], c.y_test)
        assert len(y) == 4 * 30
    # the base set is shared: the same 200 samples for every client (different splits per client)
    assert all(set(map(tuple, fb.clients[0].x_train.flatten(1).tolist())) | set(
        map(tuple, fb.clients[0].x_val.flatten(1).tolist())) | set(map(tuple, fb.clients[0].x_test.flatten(1).tolist()))
               == set(map(tuple, c.x_train.flatten(1).tolist())) | set(map(tuple, c.x_val.flatten(1).tolist()))
               | set(map(tuple, c.x_test.flatten(1).tolist())) for c in fb.clients)


@pytest.mark.parametrize("bad, field", [({"public": 0.1, "bogus": 0.1}, "data.local_split.bogus"),
                                        ({"public": 1.5}, "data.local_split.public"),
                                        ({"public": 0.5, "val": 0.3, "test": 0.3}, "data.local_split")])
def test_bad_local_split_names_the_field(tiny, bad, field):
    with pytest.raises(ConfigError) as e:
        mutual_cfg(tiny, "mafml", data=mutual_data(local_split=bad))
    assert e.value.field == field


def test_local_split_excludes_val_fraction(tiny):
    with pytest.raises(ConfigError) as e:
        mutual_cfg(tiny, "mafml", data=mutual_data(val_fraction=0.1))
    assert e.value.field == "data.val_fraction"


def test_mafml_without_public_shares_is_refused(tiny):
    cfg = tiny(rounds=1, algorithm={"name": "mafml", "params": {}}, train={"optimizer": "adam"})
    with pytest.raises(ConfigError) as e:
        prepare(cfg)
    assert e.value.field == "data.local_split"


# -- metrics on a hand fixture -----------------------------------------------------------------------------------

class Identity(nn.Module):
    """logits = the input itself (2 classes): the prediction of a sample is argmax of its two numbers."""

    def forward(self, x, return_embedding=False):
        return (x, x) if return_embedding else x


def test_bwt_fwt_acc_by_hand():
    # 3 domains, 2 test samples each; client 1's model (identity) is right on: d0 1/2, d1 2/2, d2 0/2
    x = torch.tensor([[1., 0], [0, 1], [1, 0], [0, 1], [1, 0], [1, 0]])
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    c = ClientData(1, x[:0], y[:0], x[2:4], y[2:4], [0, 1], num_classes=2, cross_test=(x, y, owner))
    m = domain_metrics(Identity(), c)
    assert m["test_bwt"] == (1.0, 2.0) and m["test_acc"] == (1.0, 2.0)
    assert m["test_fwt"] == (0.25, 4.0)  # 1 of 4 right on domains 0 and 2
    assert m["test_acc_all"] == (0.5, 6.0)  # 3 of 6
    # the validation view swaps in the validation splits for the same metrics
    v = ClientData(1, x[:0], y[:0], x[:1], y[:1], [0, 1], num_classes=2, x_val=x[2:4], y_val=y[2:4],
                   cross_test=(x[:1], y[:1], owner[:1]), cross_val=(x, y, owner)).validation_view()
    assert domain_metrics(Identity(), v)["test_acc_all"] == (0.5, 6.0)


# -- MAFML's maths by hand ---------------------------------------------------------------------------------------

def test_projection_on_hand_vectors():
    g_loc = torch.tensor([1.0, 0.0, 0.0])
    # conflicting: cos < 0 -> the component along g_loc is removed: (-2, 3, 1) - (-2/1)(1, 0, 0) = (0, 3, 1)
    g, fired = project_conflicting(torch.tensor([-2.0, 3.0, 1.0]), g_loc)
    assert fired and torch.equal(g, torch.tensor([0.0, 3.0, 1.0]))
    # a non-axis example: g_loc = (1, 1), g_pub = (-3, 1): dot -2, |g_loc|^2 2 -> (-3, 1) + (1, 1) = (-2, 2)
    g, fired = project_conflicting(torch.tensor([-3.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert fired and torch.allclose(g, torch.tensor([-2.0, 2.0]))
    assert abs(float(torch.dot(g, torch.tensor([1.0, 1.0])))) < 1e-6  # now orthogonal to g_loc
    # not conflicting (cos > 0, and cos = 0): unchanged
    for pub in (torch.tensor([2.0, 3.0, 1.0]), torch.tensor([0.0, 3.0, 1.0])):
        g, fired = project_conflicting(pub, g_loc)
        assert not fired and torch.equal(g, pub)


def test_weighted_kl_on_a_hand_example():
    # teacher 1: p = (0.5, 0.5), A = 0.8; student logits (0, ln 3) -> q = (0.25, 0.75)
    #   KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3)
    # teacher 2: p = (1, 0), A = 0.5; student logits (0, 0) -> q = (0.5, 0.5): KL = ln 2
    s1 = torch.tensor([[0.0, math.log(3.0)]])
    s2 = torch.tensor([[0.0, 0.0]])
    p1 = torch.tensor([[0.5, 0.5]])
    p2 = torch.tensor([[1.0, 0.0]])
    kl1 = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    want = (0.8 * kl1 + 0.5 * math.log(2)) / 2  # (1 / (N - 1)) sum_j A_j KL_j with N - 1 = 2
    got = weighted_kl([s1, s2], [p1, p2], [0.8, 0.5])
    assert abs(float(got) - want) < 1e-6
    # batchmean: a batch of two identical rows gives the same value
    got2 = weighted_kl([s1.repeat(2, 1), s2.repeat(2, 1)], [p1.repeat(2, 1), p2.repeat(2, 1)], [0.8, 0.5])
    assert abs(float(got2) - want) < 1e-6


# -- MAFML end to end --------------------------------------------------------------------------------------------

def test_mafml_accounting_per_iteration(tiny):
    df = run_experiment(mutual_cfg(tiny, "mafml"), write=False).table
    # B = 8 soft labels of C = 10 classes + A_i: 81 floats and 8 int64 indices up per iteration; 3 iterations/round
    per_up_f, per_up_b = 8 * 10 + 1, (8 * 10 + 1) * 4 + 8 * 8
    for metric, value in [("up_floats", 3 * per_up_f), ("up_bytes", 3 * per_up_b),
                          ("down_floats", 3 * 3 * per_up_f), ("down_bytes", 3 * 3 * per_up_b),
                          ("up_floats@local", 3 * per_up_f), ("up_floats@global", 0),
                          ("down_floats@global", 3 * 3 * per_up_f), ("up_floats:soft_labels", 3 * per_up_f)]:
        r = rows(df, metric)
        assert len(r) == 2 * 4 and r["value"].eq(value).all(), (metric, r)
    tot = rows(df, "up_floats", "total")
    assert tot["value"].eq(4 * 3 * per_up_f).all()
    for m in ("test_bwt", "test_fwt", "test_acc_all", "val_acc_all", "val_bwt", "val_fwt"):
        assert len(rows(df, m)) == 2 * 4, m
    proj = rows(df, "projected")["value"]
    assert len(proj) == 8 and proj.between(0, 1).all()
    # nothing but soft labels (and their indices and A_i) ever goes up
    assert not any(m.startswith("up_floats:") and m != "up_floats:soft_labels" for m in df["metric"].unique())


def test_mafml_projection_and_per_teacher_change_the_run(tiny):
    base = run_experiment(mutual_cfg(tiny, "mafml"), write=False).table
    noproj = run_experiment(mutual_cfg(tiny, "mafml", {"iterations": 3, "project": False}), write=False).table
    per = run_experiment(mutual_cfg(tiny, "mafml", {"iterations": 3, "per_teacher": True}), write=False).table
    fired = rows(base, "projected")["value"].sum()
    assert fired > 0  # (fixed seed) the projection fires at least once, so the weights and losses must differ
    assert not rows(base, "train_kl")["value"].reset_index(drop=True).equals(
        rows(noproj, "train_kl")["value"].reset_index(drop=True))
    assert rows(noproj, "projected")["value"].eq(0).all()
    assert not rows(base, "train_kl")["value"].reset_index(drop=True).equals(
        rows(per, "train_kl")["value"].reset_index(drop=True))
    # per iteration a share of 3 teachers, averaged over 3 iterations: multiples of 1/9
    assert (rows(per, "projected")["value"] * 9).round(6).apply(float.is_integer).all()


# -- MAFML's global step by hand: Algorithm 1's per-teacher form (one Adam step per teacher) and the summed form ------

def _np_softmax(z):
    import numpy as np

    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _global_step_by_hand(per_teacher: bool):
    """Node 0 of 3 as student, a linear model W (3 classes x 2 features, no bias): teachers 1 and 2 with their public
    batches, soft labels p_j and accuracies A_j, and a stored g_loc = e_1. The gradient of A_j KL(p_j || softmax(z))
    + CE(z, y) (batch means) w.r.t. the logits is (A_j (q - p_j) + (q - onehot(y))) / B, so g = dz^T x; the
    projection is eq. 7; Adam (beta 0.9 / 0.999, eps 1e-8, no weight decay) by its formula. Per-teacher: for j = 1, 2
    in turn, g_j at the current W, projected against g_loc if it conflicts, one Adam step (Algorithm 1 lines 9-18).
    Summed: one step on the mean of the two teachers' losses (eq. 3-6)."""
    import numpy as np

    W0 = np.array([[0.2, -0.1], [0.0, 0.3], [-0.2, 0.1]])
    W = W0.ravel()
    X = {1: np.array([[1., 0.], [0., 1.]]), 2: np.array([[1., 1.]])}
    Y = {1: np.array([0, 2]), 2: np.array([1])}
    P = {1: np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]), 2: np.array([[0.1, 0.8, 0.1]])}
    A = {1: 0.5, 2: 1.0}
    g_loc = np.eye(6)[0]
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8

    def grad(W, j):
        q = _np_softmax(X[j] @ W.reshape(3, 2).T)
        dz = (A[j] * (q - P[j]) + (q - np.eye(3)[Y[j]])) / len(X[j])
        return (dz.T @ X[j]).ravel()

    m = v = np.zeros(6)
    fired = []
    groups = [[1], [2]] if per_teacher else [[1, 2]]
    for t, group in enumerate(groups, 1):
        g = sum(grad(W, j) for j in group) / len(group)
        dot = g @ g_loc
        fired.append(dot < 0)
        if dot < 0:
            g = g - dot / (g_loc @ g_loc) * g_loc
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        W = W - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    pub = {"x": np.concatenate([np.zeros((2, 2)), X[1], X[2]]), "y": np.concatenate([[0, 0], Y[1], Y[2]]),
           "owner": [0, 0, 1, 1, 2]}
    return W.reshape(3, 2), fired, (W0, X, Y, P, A, g_loc, lr, pub)


@pytest.mark.parametrize("per_teacher", [True, False])
def test_mafml_global_step_by_hand(per_teacher):
    from types import SimpleNamespace

    import numpy as np

    from algorithms.mafml import GLOBAL, MAFML, Teachers
    from raysim.algorithm import Context
    from raysim.messages import Message

    want, fired, (W0, X, Y, P, A, g_loc, lr, pub) = _global_step_by_hand(per_teacher)
    task = SimpleNamespace(
        num_clients=3, build_model=lambda cid: nn.Linear(2, 3, bias=False),
        train=SimpleNamespace(lr=lr, weight_decay=0.0, batch_size=2, optimizer="adam"),
        public=SimpleNamespace(x=torch.tensor(pub["x"], dtype=torch.float64), y=torch.tensor(pub["y"]),
                               owner=torch.tensor(pub["owner"])))
    algo = MAFML(MAFML.Params(per_teacher=per_teacher), task)
    torch.set_default_dtype(torch.float64)
    try:
        ctx = Context(round_idx=0, client_id=0, seed=0, device="cpu", task=task, step=GLOBAL.name)
        msgs = {j: Message("soft_labels", {"idx": torch.tensor(ix), "p": torch.tensor(P[j]),
                                           "acc": torch.tensor([A[j]])}) for j, ix in ((1, [2, 3]), (2, [4]))}
        state = {"model": {"weight": torch.tensor(W0)}, "opt": {}, "g_loc": torch.tensor(g_loc)}
        out = algo.step_global({"teachers": Teachers(teachers=msgs)}, state, None, ctx)
    finally:
        torch.set_default_dtype(torch.float32)
    np.testing.assert_allclose(out.state["model"]["weight"].numpy(), want, rtol=0, atol=1e-12)
    assert out.metrics["projected"] == pytest.approx(sum(fired) / len(fired))
    if per_teacher:
        assert fired == [True, False]  # the projection fired for teacher 1 only: each teacher is checked on its own
        assert int(out.state["opt"]["weight"]["step"]) == 2  # N - 1 = 2 Adam steps
    else:
        assert int(out.state["opt"]["weight"]["step"]) == 1


def test_mafml_heterogeneous_archs(tiny):
    cfg = mutual_cfg(tiny, "mafml", model={"per_client": [{"arch": "mlp", "params": {"hidden": 32}},
                                                          {"arch": "cnn_small", "params": {"channels": 4}}]})
    df = run_experiment(cfg, write=False).table
    assert rows(df, "test_acc_all")["value"].notna().all() and len(rows(df, "test_acc_all")) == 8
    # what travels (soft labels of public batches) does not depend on the architectures: the same floats per client
    # and round as homogeneous MAFML on the same data
    homo = run_experiment(mutual_cfg(tiny, "mafml"), write=False).table
    for m in ("up_floats", "down_floats"):
        assert rows(df, m)["value"].tolist() == rows(homo, m)["value"].tolist() and rows(df, m)["value"].gt(0).all()


# -- MAFML's group forms (backend.vectorize: the nodes' models as one grouped network) ----------------------------

VEC = {"name": "sequential", "vectorize": True}
LOOP = {"name": "sequential", "vectorize": False}  # the per-node steps (auto: the group forms, on a CPU too)


def _table(cfg):
    return without_timing(run_experiment(cfg, write=False).table.drop(columns=["run_id"]))


def _group_calls(monkeypatch):
    """Count the group-form calls that took their group (returned updates, not None)."""
    from algorithms.mafml import MAFML

    taken = []
    for name in ("local", "step_global"):
        real = getattr(MAFML, f"{name}_group")

        def counted(*a, _real=real, _name=name):
            out = _real(*a)
            taken.append((_name, out is not None))
            return out

        monkeypatch.setattr(MAFML, f"{name}_group", counted)
    return taken


@pytest.mark.parametrize("model", [None, {"arch": "cnn_small", "params": {"channels": 4}}])
def test_mafml_group_forms_equal_the_per_node_steps(tiny, monkeypatch, model):
    over = {} if model is None else {"model": model}
    loop = _table(mutual_cfg(tiny, "mafml", backend=LOOP, **over))
    taken = _group_calls(monkeypatch)
    vec = _table(mutual_cfg(tiny, "mafml", backend=VEC, **over))
    assert {k for k, ok in taken if ok} == {"local", "step_global"}  # both steps ran as groups
    m = loop.merge(vec, on=["round", "client_id", "scope", "metric"], how="outer", suffixes=("_l", "_v"),
                   indicator=True)
    assert (m["_merge"] == "both").all()
    assert ((m["value_l"] - m["value_v"]).abs() <= 1e-4 * m["value_l"].abs().clip(lower=1.0)).all()
    assert rows(vec, "projected")["value"].sum() == rows(loop, "projected")["value"].sum() > 0  # eq. 7 fired alike


@pytest.mark.parametrize("case", ["hetero", "raises"])
def test_mafml_group_forms_fall_back_to_the_per_node_steps(tiny, monkeypatch, case):
    # mixed architectures, or a group form that fails: the runner runs the per-node steps, the very table of the loop
    over = {"model": {"per_client": [{"arch": "mlp", "params": {"hidden": 32}},
                                     {"arch": "cnn_small", "params": {"channels": 4}}]}} if case == "hetero" else {}
    loop = _table(mutual_cfg(tiny, "mafml", backend=LOOP, **over))
    if case == "raises":
        from algorithms.mafml import MAFML

        def broken(*a):
            raise RuntimeError("a group form that fails")

        monkeypatch.setattr(MAFML, "local_group", broken)
        monkeypatch.setattr(MAFML, "step_global_group", broken)
        with pytest.warns(RuntimeWarning, match="fails") as seen:
            res = run_experiment(mutual_cfg(tiny, "mafml", backend=VEC, **over), write=False)
        vec = without_timing(res.table.drop(columns=["run_id"]))
        # said once per step's group form, not at every call, on the console and in the metadata with the reason
        assert sorted(str(w.message).split(" ")[0] for w in seen if "_group" in str(w.message)) == [
            "MAFML.local_group", "MAFML.step_global_group"]
        assert sorted((f["what"], f["reason"]) for f in res.metadata["fallbacks"]) == [
            ("MAFML.local_group", "RuntimeError: a group form that fails"),
            ("MAFML.step_global_group", "RuntimeError: a group form that fails")]
    else:
        vec = _table(mutual_cfg(tiny, "mafml", backend=VEC, **over))
    pd.testing.assert_frame_equal(loop, vec, check_exact=True)


def test_a_group_form_with_a_result_per_client_missing_is_an_error(tiny, monkeypatch):
    from algorithms.mafml import MAFML

    real = MAFML.local_group
    monkeypatch.setattr(MAFML, "local_group", lambda *a: real(*a)[:-1])
    with pytest.raises(Exception, match="local_group must return None or one ClientUpdate per client"):
        run_experiment(mutual_cfg(tiny, "mafml", backend=VEC), write=False)


def test_mafml_per_teacher_runs_its_global_step_per_node(tiny, monkeypatch):
    # Algorithm 1's per-teacher updates have no group form: the global step runs per node, the local step grouped
    params = {"iterations": 3, "per_teacher": True}
    loop = _table(mutual_cfg(tiny, "mafml", params, backend=LOOP))
    taken = _group_calls(monkeypatch)
    vec = _table(mutual_cfg(tiny, "mafml", params, backend=VEC))
    assert {k for k, ok in taken if ok} == {"local"} and ("step_global", False) in taken
    m = loop.merge(vec, on=["round", "client_id", "scope", "metric"], suffixes=("_l", "_v"))
    assert len(m) == len(loop) and ((m["value_l"] - m["value_v"]).abs() <= 1e-4).all()


@pytest.mark.ray
def test_mafml_group_forms_on_ray_two_actors(ray_session, tiny, monkeypatch):
    # two nodes per actor, each actor's pair as one group: the sequential group-of-four's table within tolerance
    seq = _table(mutual_cfg(tiny, "mafml", backend=VEC))
    ray = _table(mutual_cfg(tiny, "mafml", backend={"name": "ray", "num_actors": 2, "vectorize": True}))
    m = seq.merge(ray, on=["round", "client_id", "scope", "metric"], how="outer", suffixes=("_s", "_r"), indicator=True)
    assert (m["_merge"] == "both").all()
    assert ((m["value_s"] - m["value_r"]).abs() <= 1e-4 * m["value_s"].abs().clip(lower=1.0)).all()
    # the actors really ran the group forms: their sums differ from the per-node steps' in the last bits
    assert not ray["value"].equals(_table(mutual_cfg(tiny, "mafml", backend=LOOP))["value"])


@pytest.mark.ray
def test_mafml_sequential_equals_ray_one_actor_per_node(ray_session, tiny):
    seq = run_experiment(mutual_cfg(tiny, "mafml", backend=LOOP), write=False).table
    ray = run_experiment(mutual_cfg(tiny, "mafml", backend={"name": "ray", "num_actors": 4, "num_cpus": 0.5,
                                                            "vectorize": False}), write=False).table
    pd.testing.assert_frame_equal(without_timing(seq), without_timing(ray), check_exact=True)


# -- engine: train.local_steps -----------------------------------------------------------------------------------

def test_local_steps_runs_exactly_that_many_steps():
    """Exactly local_steps batches; the loss function receives each batch's local epoch."""
    from raysim.config import TrainConfig
    from raysim.training import TrainOptions, train_epochs

    calls = []

    def loss_fn(m, xb, yb, epoch):
        calls.append((epoch, len(yb)))
        return m(xb).sum() * 0.0, {}

    model = nn.Linear(2, 2)
    x, y = torch.zeros(10, 2), torch.zeros(10, dtype=torch.long)
    for steps, want in ((3, [(0, 4), (0, 4), (0, 2)]), (7, [(0, 4), (0, 4), (0, 2), (1, 4), (1, 4), (1, 2), (2, 4)]),
                        (1, [(0, 4)])):
        calls.clear()
        train_epochs(model, x, y, TrainOptions(TrainConfig(batch_size=4, local_steps=steps),
                                               torch.Generator().manual_seed(0)), loss_fn)
        assert calls == want, (steps, calls)


# -- baselines: IND, AGG, FedAvg on the local split ----------------------------------------------------------------

def test_ind_is_local_training_on_private_plus_public(tiny):
    ind = run_experiment(mutual_cfg(tiny, "ind", {}), write=False).table.drop(columns="run_id")
    loc = run_experiment(mutual_cfg(tiny, "local", {}), write=False).table.drop(columns="run_id")
    pd.testing.assert_frame_equal(without_timing(ind), without_timing(loc), check_exact=True)
    assert rows(ind, "up_floats")["value"].eq(0).all()


def test_agg_trains_on_own_data_plus_the_other_nodes_public_shares(tiny, monkeypatch):
    import raysim.training as training

    seen = {}
    real = training.local_sgd

    def spy(model, objective, x, y, cfg, *a, **k):
        seen.setdefault(len(seen), (x.clone(), y.clone()))
        return real(model, objective, x, y, cfg, *a, **k)

    monkeypatch.setattr(training, "local_sgd", spy)
    cfg = mutual_cfg(tiny, "agg", {}, rounds=1)
    prep = prepare(cfg)
    run_experiment(cfg, write=False)
    pub = prep.fed_data.public
    for cid in range(4):  # clients run in id order
        x, y = seen[cid]
        c = prep.fed_data.clients[cid]
        others = pub.owner != cid
        assert torch.equal(x, torch.cat([c.x_train, pub.x[others]])) and torch.equal(y, torch.cat([c.y_train, pub.y[others]]))
        assert len(y) == 150 + 3 * 20


def test_fedavg_reports_domain_metrics_of_the_global_model(tiny):
    df = run_experiment(mutual_cfg(tiny, "fedavg", {}), write=False).table
    acc = rows(df, "test_acc_all").pivot_table(index="round", columns="client_id", values="value")
    assert acc.shape == (2, 4) and (acc.nunique(axis=1) == 1).all()  # one global model: the same ACC everywhere
    assert rows(df, "up_floats")["value"].gt(0).all()


# -- FedAvg at controlled communication (seed 003: "its communication kept about equal to MAFML's") -----------------

LENET_P = 61706  # LeNet-5's floats at 28x28, 10 classes (test_lenet_is_lenet5)
MLP_P = 64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10  # the tiny mlp (8x8 inputs, hidden 32, embedding 16): 2,778


def test_mafml_floats_per_iteration_and_fedavg_sync_period_by_hand():
    from algorithms.fedavg import budget_sync_period
    from algorithms.mafml import floats_per_iteration

    assert floats_per_iteration(4, 10, 32) == 4 * 321 + 4 * 3 * 321 == 5136  # 32 x 10 soft labels + A_i per node
    assert floats_per_iteration(4, 10, 8) == 16 * 81 == 1296
    # Rotated MNIST, LeNet: one average moves 2 x 4 x 61,706 = 493,648 floats = 96.1 x MAFML's 5,136 per iteration
    n, p, m = 4, LENET_P, 5136
    for t, k in ((10000, 97), (2000, 96), (500, 101)):
        assert budget_sync_period(n, p, m, t, 1.0) == k, t
        total = n * p + (t // k) * 2 * n * p
        assert total <= t * m < n * p + (t // (k - 1)) * 2 * n * p  # within the budget; k - 1 would exceed it
    assert n * p + 103 * 2 * n * p == 51_092_568 <= 51_360_000  # k = 97 over 10,000 iterations: 103 averages
    assert budget_sync_period(n, p, m, 10000, 100) == 1  # the seed's PACS cap (100x) allows every iteration here
    assert budget_sync_period(n, p, m, 10000, 0.5) == 2 * 97 - 1  # 51 averages: floor(10000/193) = 51
    with pytest.raises(ConfigError) as e:
        budget_sync_period(n, p, m, 50, 1.0)  # 256,800 floats do not pay for the start plus one average
    assert e.value.field == "algorithm.params.bandwidth_ratio"


def test_fedavg_every_k_iterations_accounted_exactly(tiny):
    from raysim.io.results import communication

    # 2 rounds of 3 iterations, an average every 2: after global iterations 1 (round 0), 3 and 5 (round 1)
    df = run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 2}), write=False).table
    tot = rows(df, "up_floats", "total").set_index("round")["value"]
    assert tot.to_dict() == {-1: 0, 0: 4 * MLP_P, 1: 2 * 4 * MLP_P}
    down = rows(df, "down_floats", "total").set_index("round")["value"]
    assert down.to_dict() == {-1: 4 * MLP_P, 0: 4 * MLP_P, 1: 2 * 4 * MLP_P}  # the start model, then the averages
    assert rows(df, "down_floats@local")["value"].eq(0).all() and rows(df, "up_floats@receive")["value"].eq(0).all()
    com = communication(df).set_index("metric")["total"]
    assert com["up_floats"] == 3 * 4 * MLP_P and com["down_floats"] == 4 * 4 * MLP_P
    assert rows(df, "sync_every", "server")["value"].eq(2).all()
    acc = rows(df, "test_acc_all").pivot_table(index="round", columns="client_id", values="value")
    assert acc.shape == (2, 4) and (acc.nunique(axis=1) == 1).all()  # the last average: one model everywhere
    loc = run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 2, "eval_model": "local"}), write=False).table
    pd.testing.assert_frame_equal(rows(loc, "train_loss").drop(columns="run_id").reset_index(drop=True),
                                  rows(df, "train_loss").drop(columns="run_id").reset_index(drop=True), check_exact=True)  # same training
    # every iteration: 6 averages
    every = run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 1}), write=False).table
    assert communication(every).set_index("metric")["total"]["up_floats"] == 6 * 4 * MLP_P


def test_fedavg_bandwidth_ratio_matches_the_measured_mafml_traffic(tiny):
    from raysim.io.results import communication

    maf = communication(run_experiment(mutual_cfg(tiny, "mafml"), write=False).table).set_index("metric")["total"]
    maf_total = maf["up_floats"] + maf["down_floats"]
    assert maf_total == 6 * 1296  # 2 rounds x 3 iterations x N^2 (B*C + 1)
    # ratio 5: budget 38,880 floats; the start (11,112) + one average (22,224) = 33,336 fit, two do not: k = 6//2 + 1
    df = run_experiment(mutual_cfg(tiny, "fedavg", {"bandwidth_ratio": 5}), write=False).table
    assert rows(df, "sync_every", "server")["value"].eq(4).all()
    com = communication(df).set_index("metric")["total"]
    total = com["up_floats"] + com["down_floats"]
    assert total == 4 * MLP_P + 2 * 4 * MLP_P == 33336 and total <= 5 * maf_total < total + 2 * 4 * MLP_P
    assert rows(df, "up_floats", "total").set_index("round")["value"].to_dict() == {-1: 0, 0: 0, 1: 4 * MLP_P}
    with pytest.raises(ConfigError) as e:  # ratio 1: 7,776 floats cannot even pay for the start
        prepare(mutual_cfg(tiny, "fedavg", {"bandwidth_ratio": 1}))
    assert e.value.field == "algorithm.params.bandwidth_ratio"


def test_fedavg_iteration_mode_resumes_exactly(tiny, tmp_path):
    out = {"progress": False, "checkpoint_every": 1}
    full = run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 2}, rounds=3, output=out), write=False).table
    run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 2}, rounds=2, output=out), out_dir=tmp_path / "run")
    resumed = run_experiment(mutual_cfg(tiny, "fedavg", {"sync_every": 2}, rounds=3, output=out),
                             resume=tmp_path / "run").table
    from raysim.io.results import without_timing  # wall-time rows differ run to run

    pd.testing.assert_frame_equal(without_timing(full).drop(columns="run_id").reset_index(drop=True),
                                  without_timing(resumed).drop(columns="run_id").reset_index(drop=True), check_exact=True)


@pytest.mark.parametrize("params,over,field", [
    ({"sync_every": 2, "bandwidth_ratio": 1.0}, {}, "algorithm.params.bandwidth_ratio"),
    ({"sync_every": -1}, {}, "algorithm.params.sync_every"),
    ({"bandwidth_ratio": -1.0}, {}, "algorithm.params.bandwidth_ratio"),
    ({"sync_every": 2, "eval_model": "best"}, {}, "algorithm.params.eval_model"),
    ({"sync_every": 2}, {"train": {"optimizer": "adam", "batch_size": 8}}, "train.local_steps"),
    ({"sync_every": 2, "positive_rate": 0.5}, {}, "algorithm.params.sync_every"),
])
def test_fedavg_iteration_mode_bad_input(tiny, params, over, field):
    with pytest.raises(ConfigError) as e:
        prepare(mutual_cfg(tiny, "fedavg", params, **over))
    assert e.value.field == field


def test_select_by_validation_picks_the_best_validation_round():
    from raysim.io.results import select_by_validation

    recs = []
    for r, (v, t) in enumerate([(0.5, 0.6), (0.9, 0.7), (0.9, 0.8), (0.7, 0.9)]):
        recs += [(r, 0, "client", "val_acc_all", v), (r, 0, "client", "test_acc_all", t),
                 (r, 0, "client", "test_bwt", t + 0.01), (r, 0, "client", "test_fwt", t - 0.01)]
    df = pd.DataFrame(recs, columns=["round", "client_id", "scope", "metric", "value"])
    sel = select_by_validation(df).iloc[0]
    assert sel["sel_round"] == 1 and sel["last_round"] == 3  # the first of the tied best rounds
    assert sel["sel_test_acc_all"] == 0.7 and sel["last_test_acc_all"] == 0.9
    assert abs(sel["sel_test_bwt"] - 0.71) < 1e-12


# -- FML and FedKD -----------------------------------------------------------------------------------------------

def test_fml_meme_is_the_equal_weight_mean_and_private_model_stays_local(tiny):
    from raysim.runner.runners import ClientRunner, ServerRunner

    cfg = mutual_cfg(tiny, "fml", {})
    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    from raysim.steps import CLASSIC_ROUND

    payload = server.initial_payload(0)
    uploads, reports = clients.run_client_step(CLASSIC_ROUND[0], payload, 0, 0, [0, 1, 2, 3])
    assert all(r.ok for r in reports)
    assert set(uploads[0]) == {"meme"} and uploads[0]["meme"].kind == "weights"
    new_payload, _ = server.run_server_step(CLASSIC_ROUND[1], 0, 0, [0, 1, 2, 3], uploads)
    for k, v in new_payload["meme"].tensors.items():
        want = sum(uploads[i]["meme"][k].double() for i in range(4)) / 4
        assert torch.allclose(v.double(), want, atol=1e-6), k


def test_fedkd_svd_compression_by_hand():
    from algorithms.fedkd import compress, decompress, svd_keep

    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14: 9/14 = 0.64, 13/14 = 0.93
    assert svd_keep(s, 0.5) == 1 and svd_keep(s, 0.9) == 2 and svd_keep(s, 0.95) == 3
    u = torch.linalg.qr(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))[0]
    v = torch.linalg.qr(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)))[0].T
    w = u @ torch.diag(s) @ v
    msg = compress({"w": w, "b": torch.ones(4)}, 0.9)
    assert msg["w|us"].shape == (4, 2) and msg["w|v"].shape == (2, 5) and torch.equal(msg["b"], torch.ones(4))
    assert msg.num_floats == 4 * 2 + 2 * 5 + 4
    rec = decompress(msg, {"w": w, "b": torch.ones(4)})["w"]
    want = u[:, :2] @ torch.diag(s[:2]) @ v[:2]
    assert torch.allclose(rec, want, atol=1e-5)
    full = decompress(compress({"w": w}, 1.0), {"w": w})["w"]
    assert torch.allclose(full, w, atol=1e-5)


def test_fedkd_uploads_only_the_compressed_mentee(tiny):
    df = run_experiment(mutual_cfg(tiny, "fedkd", {}), write=False).table
    kinds = {m.split(":")[1] for m in df["metric"].unique() if m.startswith("up_floats:")}
    assert kinds == {"compressed_weights", "num_samples"}
    assert rows(df, "test_acc_all")["value"].notna().all()


# -- FedMD -------------------------------------------------------------------------------------------------------

FEDMD = {"n_alignment": 30, "digest_batch": 16, "transfer_public_epochs": 1, "transfer_private_epochs": 1}


def test_fedmd_protocol_and_accounting(tiny):
    df = run_experiment(mutual_cfg(tiny, "fedmd", dict(FEDMD)), write=False).table
    # setup (round -1): transfer learning on every node, nothing sent
    setup = df[df["round"] == -1]
    assert rows(setup, "up_floats")["value"].eq(0).all() and len(rows(setup, "up_floats")) == 4
    # each round: 30 alignment indices down (int64, 0 floats); 30 x 10 logits up; the 30 x 10 consensus down
    for metric, value in [("up_floats", 300), ("up_floats:logits", 300), ("down_floats:consensus_logits", 300),
                          ("down_floats", 300), ("down_bytes:alignment_indices", 30 * 8),
                          ("up_bytes", 300 * 4 + 30 * 8)]:
        r = rows(df, metric)
        r = r[r["round"] >= 0]
        assert len(r) == 2 * 4 and r["value"].eq(value).all(), (metric, r)
    assert rows(df, "train_digest_mae")["value"].gt(0).all()


def test_fedmd_paper_transfer_schedule_stops_early_on_validation(tiny):
    """Issue 51: ``transfer_schedule: paper`` runs FedMD's own transfer learning (up to 25 epochs per phase, Keras's
    early stopping on the node's validation accuracy); the default (fixed epochs) is unchanged."""
    fixed = run_experiment(mutual_cfg(tiny, "fedmd", dict(FEDMD)), write=False).table
    assert not rows(fixed, "transfer_public_epochs_run").size
    params = {**FEDMD, "transfer_schedule": "paper", "transfer_max_epochs": 6, "transfer_patience": 1,
              "transfer_min_delta": 1.0}  # min_delta 1: no epoch beats the first, so each phase stops after 2
    df = run_experiment(mutual_cfg(tiny, "fedmd", params), write=False).table
    for phase in ("public", "private"):
        r = rows(df, f"transfer_{phase}_epochs_run")
        assert len(r) == 4 and r["value"].eq(2).all(), r
    params["transfer_min_delta"] = 0.0
    params["transfer_patience"] = 6  # never stops early: the full 6 epochs
    df = run_experiment(mutual_cfg(tiny, "fedmd", params), write=False).table
    assert rows(df, "transfer_private_epochs_run")["value"].eq(6).all()
    with pytest.raises(ConfigError, match="transfer_schedule"):
        run_experiment(mutual_cfg(tiny, "fedmd", {**FEDMD, "transfer_schedule": "keras"}), write=False)


def test_fedmd_consensus_is_the_mean_of_the_nodes_logits(tiny):
    from raysim.runner.runners import ClientRunner, ServerRunner

    prep = prepare(mutual_cfg(tiny, "fedmd", dict(FEDMD)))
    alg = prep.algorithm
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    payload = server.initial_payload(0)
    assert len(payload["align"]["idx"]) == 30 and len(set(payload["align"]["idx"].tolist())) == 30
    sched = alg.schedule()
    uploads, reports = clients.run_client_step(sched[0], payload, 0, 0, [0, 1, 2, 3])
    assert all(r.ok for r in reports)
    cons, _ = server.run_server_step(sched[1], 0, 0, [0, 1, 2, 3], uploads)
    want = sum(uploads[i]["logits"]["logits"].double() for i in range(4)) / 4
    assert torch.allclose(cons["consensus"]["logits"].double(), want, atol=1e-6)


# -- bad input: one ConfigError naming the field -------------------------------------------------------------------

@pytest.mark.parametrize("over, field", [
    ({"train": {"optimizer": "sgd", "batch_size": 8}}, "train.optimizer"),  # MAFML updates with Adam
    ({"train": {"optimizer": "adam", "local_steps": 0}}, "train.local_steps"),
    ({"train": {"optimizer": "adam", "local_steps": True}}, "train.local_steps"),
    ({"algorithm": {"name": "mafml", "params": {"iterations": 0}}}, "algorithm.params.iterations"),
    ({"data": mutual_data(local_split={"public": 0.0, "val": 0.1, "test": 0.15})}, "data.local_split.public"),
    ({"data": mutual_data(public={"dataset": "synthetic"})}, "data.public"),
])
def test_mafml_bad_input(tiny, over, field):
    with pytest.raises(ConfigError) as e:
        prepare(mutual_cfg(tiny, "mafml", **over))
    assert e.value.field == field


def test_local_steps_refused_with_vectorize(tiny):
    with pytest.raises(ConfigError) as e:
        prepare(mutual_cfg(tiny, "ind", {}, backend={"name": "sequential", "vectorize": True}))
    assert e.value.field == "train.local_steps"


def test_lenet_is_lenet5():
    from raysim.config import ArchSpec
    from raysim.models import build_model, num_parameters

    m = build_model(ArchSpec("lenet"), (1, 28, 28), 10)
    assert num_parameters(m) == 61706  # 156 + 2,416 + 48,120 + 10,164 + 850
    assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 10) and m.embed_dim == 84


def test_warm_snapshot_and_mode_equal_the_plain_copies():
    """WarmClients.snapshot is clone_state + optimizer_state (same keys and values, copies), mode(flag) is
    model.train(flag) for every module (BatchNorm and Dropout included), and a state loaded back reproduces the
    live pair's next step exactly."""
    from types import SimpleNamespace

    from algorithms.mutual_maths import WarmClients
    from raysim.training import clone_state, optimizer_state

    def build(_cid):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 3))

    task = SimpleNamespace(build_model=build, train=SimpleNamespace(weight_decay=1e-4))
    live = WarmClients(task)
    ctx = SimpleNamespace(client_id=2, device=torch.device("cpu"))
    state = {"model": clone_state(build(2)), "opt": {}}
    model, opt = live.get(state, ctx, lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def step(m, o):
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()

    torch.manual_seed(1)
    step(model, opt)
    weights, opt_state = live.snapshot(ctx)
    want_w, want_o = clone_state(model), optimizer_state(opt, model)
    assert list(weights) == list(want_w) and all(torch.equal(weights[k], want_w[k]) for k in want_w)
    assert set(opt_state) == set(want_o)
    for name, st in want_o.items():
        assert set(opt_state[name]) == set(st) and all(torch.equal(opt_state[name][k], v) for k, v in st.items())
    p = next(model.parameters())
    assert weights["0.weight"].data_ptr() != p.data_ptr()  # copies, not views of the live tensors
    for flag in (False, True):
        live.mode(ctx, flag)
        assert all(m.training is flag for m in model.modules())
    # the snapshot, loaded into a fresh pair, takes the same next step as the live pair
    live.done(ctx, {"model": weights, "opt": opt_state})
    fresh = WarmClients(task)
    m2, o2 = fresh.get({"model": weights, "opt": opt_state}, ctx, lr=0.01)
    torch.manual_seed(2)
    step(model, opt)
    torch.manual_seed(2)
    step(m2, o2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
