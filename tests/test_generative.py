"""Issue 15: SCAFFOLD, MOON, SlaugFL, FedGen, VHL — the maths against hand-computed numbers, message sizes, and
sequential == ray (the Ray part also runs for every method in tests/test_conformance.py)."""
import math

import pandas as pd
import pytest
import torch

from raysim.config import make_config
from raysim.engine.loop import run_experiment
from raysim.errors import ConfigError
from raysim.io.results import without_timing
from tests.conftest import tiny_config


def run(name, params=None, **over):
    if name == "slaugfl":
        over.setdefault("data__server_val", 100)
    return run_experiment(make_config(tiny_config(algorithm={"name": name, "params": params or {}}, **over)),
                          write=False).table


def total(table, metric, round_idx=None):
    t = table[(table["scope"] == "total") & (table["metric"] == metric)]
    if round_idx is not None:
        t = t[t["round"] == round_idx]
    return float(t["value"].sum())


def mlp_floats(in_dim=64, hidden=32, embed=16, classes=10):
    return in_dim * hidden + hidden + hidden * embed + embed + embed * classes + classes


# -- SCAFFOLD ---------------------------------------------------------------------------------------------------------
def test_scaffold_effective_steps_and_control_update_by_hand():
    from algorithms.scaffold import control_update, effective_steps, server_update

    assert effective_steps(3, 0.0) == 3.0
    assert effective_steps(2, 0.5) == pytest.approx(1.0 + 1.5)  # (1-.5)/.5 + (1-.25)/.5
    t = lambda v: {"w": torch.tensor([v])}
    # c_i+ = c_i - c + (x - y) / (K lr) = 0.1 - 0.3 + 0.6 / (3 * 0.1) = 1.8
    assert float(control_update(t(0.1), t(0.3), t(1.0), t(0.4), 3.0, 0.1)["w"]) == pytest.approx(1.8)
    # x + lr_g * mean(dy) = 1 + 0.5 * (0.2 + 0.4) / 2 = 1.15; c + sum(dc) / N = 0.3 + (0.1 + 0.5) / 4 = 0.45
    x, c = server_update(t(1.0), t(0.3), [t(0.2), t(0.4)], [t(0.1), t(0.5)], 4, 0.5)
    assert float(x["w"]) == pytest.approx(1.15) and float(c["w"]) == pytest.approx(0.45)


def test_scaffold_one_full_batch_step_gives_the_local_gradient():
    """With one plain-SGD step on the full batch, y = x - lr (g(x) + c - c_i), so option II gives c_i+ = g(x):
    the correction has the right sign and K_eff is right."""
    from algorithms.scaffold import Scaffold
    from raysim.engine.prepare import prepare
    from raysim.runner.runners import ClientRunner, ServerRunner
    from raysim.messages import state_message

    cfg = make_config(tiny_config(algorithm={"name": "scaffold", "params": {}},
                                  train={"local_epochs": 1, "batch_size": 1000, "lr": 0.1, "momentum": 0.0}))
    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    alg: Scaffold = clients.algorithm
    payload = server.initial_payload(0)
    g = torch.Generator().manual_seed(3)
    control = {n: 0.01 * torch.randn(v.shape, generator=g) for n, v in payload["control"].tensors.items()}
    payload = {**payload, "control": state_message("control_variate", control)}
    cid = clients.client_ids()[0]
    c_i = {n: 0.02 * torch.randn(v.shape, generator=g) for n, v in control.items()}
    state = {"control": c_i}
    data = clients._data(cid)
    ctx = clients._ctx(0, cid, "update")
    res = alg.client_update(payload, state, data, ctx)
    model = alg.task.build_model(cid)
    model.load_state_dict(payload["model"].tensors)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(data.x_train), data.y_train)  # the mlp has no dropout
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    for n, gr in grads.items():
        torch.testing.assert_close(res.state["control"][n], gr, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.upload["delta_c"][n], gr - c_i[n], rtol=1e-4, atol=1e-5)


def test_scaffold_accounting_doubles_fedavg():
    sc, fa = run("scaffold"), run("fedavg")
    w = mlp_floats()
    for t in (sc,):
        per_round = total(t, "participants", 0)
        assert total(t, "up_floats", 0) == 2 * w * per_round
        assert total(t, "down_floats", 0) == 2 * w * per_round
    assert total(fa, "down_floats", 0) == w * total(fa, "participants", 0)


def test_scaffold_bad_input():
    with pytest.raises(ConfigError, match="server_lr"):
        run("scaffold", {"server_lr": -1.0})


# -- MOON -------------------------------------------------------------------------------------------------------------
def test_moon_contrastive_by_hand():
    from algorithms.moon import moon_contrastive

    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    zg = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    zp = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    # sample 1: pos cos 1, neg cos 0 -> log(1 + e^{(0-1)/0.5}); sample 2: pos cos 1/sqrt2, neg cos 1
    l1 = math.log(1 + math.exp(-2.0))
    l2 = math.log(1 + math.exp((1.0 - 1 / math.sqrt(2)) / 0.5))
    assert float(moon_contrastive(z, zg, zp, 0.5)) == pytest.approx((l1 + l2) / 2, rel=1e-6)
    # identical references: log 2 whatever z is
    assert float(moon_contrastive(z, zg, zg, 0.7)) == pytest.approx(math.log(2), rel=1e-6)


def test_moon_keeps_the_previous_model_in_client_state_and_sends_fedavg_traffic():
    t = run("moon", {"mu": 1.0, "tau": 0.5})
    fa = run("fedavg")
    for m in ("up_floats", "down_floats"):
        assert total(t, m) == total(fa, m)
    con = t[(t["metric"] == "train_con") & (t["scope"] == "client")]
    first = con[con["round"] == 0]["value"]
    assert (first - math.log(2)).abs().max() < 1e-6  # first round: previous model = global model
    assert (con[con["round"] == 2]["value"] - math.log(2)).abs().max() > 1e-4  # later: a real previous model
    with pytest.raises(ConfigError, match="tau"):
        run("moon", {"tau": 0.0})


# -- SlaugFL ----------------------------------------------------------------------------------------------------------
SLAUG = {"gen_steps": 20, "gen_channels": 8, "gen_noise": 8, "gan_channels": 8, "gan_noise": 8, "disc_channels": 4}


# per-class accuracies of devices 4, 7, 9 on 4 classes, and whether each holds class-c validation data
TOY_ACC = torch.tensor([[0.9, 0.2, 0.5, 0.1],
                        [0.9, 0.8, 0.7, 0.1],
                        [0.1, 0.95, 0.6, 0.1]], dtype=torch.float64)
TOY_ELIGIBLE = torch.tensor([[True, True, True, False],
                             [True, True, False, False],
                             [False, True, True, False]])


def test_representative_selection_on_a_toy_problem():
    from algorithms.generative_maths import per_class_accuracy, select_representatives

    # per-class accuracy: y = [0,0,1,1,2], pred = [0,1,1,1,0] -> class 0: 1/2, class 1: 2/2, class 2: 0/1, class 3: nan
    acc = per_class_accuracy(torch.tensor([0, 1, 1, 1, 0]), torch.tensor([0, 0, 1, 1, 2]), 4)
    assert acc[:3].tolist() == [0.5, 1.0, 0.0] and math.isnan(float(acc[3]))
    a, eligible = TOY_ACC, TOY_ELIGIBLE
    # class 0: tie 0.9 between clients 4 and 7 -> lowest id 4; class 1: client 9 (0.95); class 2: client 7 has 0.7 but
    # no class-2 validation data -> client 9 (0.6); class 3: nobody eligible -> -1
    assert select_representatives(a, eligible, [4, 7, 9]).tolist() == [4, 9, 9, -1]


def test_s_selected_prototypes_by_hand():
    """Seed 004 §V-C3: S < C keeps S random classes' representatives; S > C adds the second-best eligible device for
    S - C random classes; several prototypes of one class are averaged."""
    import numpy as np

    from algorithms.generative_maths import mean_class_prototypes, select_prototype_sources

    a, eligible = TOY_ACC, TOY_ELIGIBLE
    for s in (0, 4):  # the default: one per class
        first, second = select_prototype_sources(a, eligible, [4, 7, 9], s, np.random.default_rng(0))
        assert first.tolist() == [4, 9, 9, -1] and second.tolist() == [-1] * 4
    # S = 2: two of the classes that have a representative (class 3 has none), the same two for the same stream
    first, second = select_prototype_sources(a, eligible, [4, 7, 9], 2, np.random.default_rng(3))
    kept = [c for c in range(4) if first[c] >= 0]
    assert len(kept) == 2 and set(kept) <= {0, 1, 2} and all(first[c] == [4, 9, 9][c] for c in kept)
    assert second.tolist() == [-1] * 4
    assert torch.equal(first, select_prototype_sources(a, eligible, [4, 7, 9], 2, np.random.default_rng(3))[0])
    first, _ = select_prototype_sources(a, eligible, [4, 7, 9], 3, np.random.default_rng(3))
    assert first.tolist() == [4, 9, 9, -1]  # every class that has one
    # S = 7 = C + 3: every class with a runner-up also asks it: class 0 -> 7 (tie with 4, the best), class 1 -> 7
    # (0.8), class 2 -> 4 (0.5; 7 is not eligible), class 3 -> nobody
    first, second = select_prototype_sources(a, eligible, [4, 7, 9], 7, np.random.default_rng(0))
    assert first.tolist() == [4, 9, 9, -1] and second.tolist() == [7, 7, 4, -1]
    assert torch.equal(second, select_prototype_sources(a, eligible, [4, 7, 9], 8, np.random.default_rng(0))[1])
    _, second = select_prototype_sources(a, eligible, [4, 7, 9], 5, np.random.default_rng(5))
    extra = [c for c in range(4) if second[c] >= 0]
    assert len(extra) == 1 and second[extra[0]] == [7, 7, 4, -1][extra[0]]
    protos, mask = mean_class_prototypes([(torch.tensor([0, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])),
                                          (torch.tensor([2]), torch.tensor([[5.0, 8.0]]))], 4, 2)
    assert mask.tolist() == [True, False, True, False]
    assert protos.tolist() == [[1.0, 2.0], [0.0, 0.0], [4.0, 6.0], [0.0, 0.0]]


@pytest.mark.parametrize("s", [3, 15])
def test_slaugfl_uploads_exactly_the_s_selected_prototypes(s):
    t = run("slaugfl", {**SLAUG, "num_prototypes": s, "syn_per_class": 2}, rounds=1)
    setup = t[t["round"] == -1]
    picked = float(setup[setup["metric"] == "prototypes_selected"]["value"].iloc[0])
    covered = float(setup[setup["metric"] == "classes_covered"]["value"].iloc[0])
    assert total(setup, "up_floats@prep_prototypes") == picked * 16  # d = 16 floats each
    if s < 10:
        assert picked == covered == s
        syn = setup[(setup["metric"] == "syn_samples") & (setup["scope"] == "client")]["value"]
        assert len(syn) == 6 and set(syn) == {2.0 * s}  # synthetic data of the S learned classes only
    else:
        assert covered < picked <= s


def test_slaugfl_s_above_twice_the_classes_is_refused():
    with pytest.raises(ConfigError, match="num_prototypes"):
        run("slaugfl", {**SLAUG, "num_prototypes": 21}, rounds=1)


def test_candidate_filter_by_cosine_distance():
    from algorithms.generative_maths import cosine_distance, filter_candidates

    proto = torch.tensor([1.0, 0.0])
    feats = torch.tensor([[0.0, 1.0], [2.0, 0.0], [1.0, 1.0], [-1.0, 0.0], [1.0, 1.0]])
    d = cosine_distance(feats, proto)
    s = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(d, torch.tensor([1.0, 0.0, s, 2.0, s]))
    assert filter_candidates(feats, proto, 3).tolist() == [1, 2, 4]  # tie between 2 and 4: lower index first
    assert filter_candidates(feats, proto, 10, delta=0.5).tolist() == [1, 2, 4]
    assert filter_candidates(feats, proto, 10, delta=1.0).tolist() == [1, 2, 4, 0]
    assert filter_candidates(feats, proto, 1).tolist() == [1]


def test_dual_calibration_loss_against_its_formula():
    from algorithms.generative_maths import DualCalibration, dual_calibration_loss

    c = 2
    logits = torch.tensor([[2.0, 0.0, 0.5, 0.1], [0.0, 1.0, 0.0, 0.3], [0.2, 0.1, 1.5, 0.0]])
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    y = torch.tensor([0, 1, 2])  # real 0, real 1, synthetic of class 0
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([True, True])

    def ce(row, t):
        return -math.log(math.exp(row[t]) / sum(math.exp(v) for v in row))

    ce_real = (ce(logits[0].tolist(), 0) + ce(logits[1].tolist(), 1)) / 2
    ce_syn = ce(logits[2].tolist(), 2)
    l_cla = ce_real + 0.5 * ce_syn
    # class 0: mean of z[0], z[2] = (1, 0.5); class 1: (0, 2)
    f0, f1 = torch.tensor([1.0, 0.5]), torch.tensor([0.0, 2.0])
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))
    beta = 0.5
    r0 = [cos(f0, protos[0]) / beta, cos(f0, protos[1]) / beta]
    r1 = [cos(f1, protos[0]) / beta, cos(f1, protos[1]) / beta]
    l_sep = (ce(r0, 0) + ce(r1, 1)) / 2
    loss, parts = dual_calibration_loss(logits, z, y, DualCalibration(c, protos, mask, 0.5, 2.0, beta))
    assert float(parts["cla"]) == pytest.approx(l_cla, rel=1e-6)
    assert float(parts["sep"]) == pytest.approx(l_sep, rel=1e-6)
    assert float(loss) == pytest.approx(l_cla + 2.0 * l_sep, rel=1e-6)
    # no global prototypes yet: L_cla only; a class without a prototype is left out of L_sep
    loss0, parts0 = dual_calibration_loss(logits, z, y, DualCalibration(c, None, None, 0.5, 2.0, beta))
    assert float(loss0) == pytest.approx(l_cla, rel=1e-6) and float(parts0["sep"]) == 0.0
    _, parts1 = dual_calibration_loss(logits, z, y, DualCalibration(c, protos, torch.tensor([True, False]), 0.5, 1.0, beta))
    assert float(parts1["sep"]) == pytest.approx(0.0, abs=1e-7)  # one column: CE of a single logit is 0


def test_mode_seeking_diversity_by_hand():
    from algorithms.generative_maths import diversity_loss, mode_seeking_ratio

    g = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    z = torch.tensor([[1.0], [0.0], [0.0], [2.0]])
    # halves: g[:2] - g[2:] = [[1, 1], [0, 0]] -> mean 0.5; z: [[1], [-2]] -> mean 1.5; l_z = 1/3
    assert float(mode_seeking_ratio(g[:2], g[2:], z[:2], z[2:])) == pytest.approx(1 / 3)
    assert float(diversity_loss(g, z, 10.0)) == pytest.approx(10.0 / (1 / 3 + 1e-5))


def _generator_floats(params):
    from algorithms.slaugfl import SlaugFL
    from raysim.engine.prepare import prepare

    prep = prepare(make_config(tiny_config(algorithm={"name": "slaugfl", "params": params}, data__server_val=100)))
    gen = prep.algorithm.make_generator() if hasattr(prep, "algorithm") else SlaugFL(prep.spec.params, prep.spec.task).make_generator()
    return sum(v.numel() for v in gen.state_dict().values() if v.is_floating_point())


class _Tripwire:
    """Wraps a dataset; records the server step (round, name, mode) during which its samples were read."""

    def __init__(self, ds, log, phase):
        self._ds, self._log, self._phase = ds, log, phase

    def __len__(self):
        return len(self._ds)

    def _read(self, v):
        self._log.append(self._phase[-1] if self._phase else ("outside a server step",))
        return v

    @property
    def x(self):
        return self._read(self._ds.x)

    @property
    def y(self):
        return self._read(self._ds.y)

    def __getattr__(self, k):  # metadata (norm, num_classes): not a read of the samples
        return getattr(self._ds, k)


@pytest.mark.parametrize("scenario,selection", [(1, "validation"), (2, "validation"), (2, "test")])
def test_slaugfl_never_reads_the_test_set_before_the_final_evaluation(monkeypatch, tmp_path, scenario, selection):
    """Issue 21: the representatives are chosen on the server-held validation set; the reported test set is read only
    by the final evaluation (every sample access to it is logged with the server step that made it)."""
    import raysim.engine.prepare as driver
    from raysim.engine.loop import run_experiment
    from raysim.io import results
    from raysim.runner.runners import ServerRunner

    test_reads, val_reads, phase = [], [], []
    build = driver.build_federated_data

    def wrapped(cfg, seed):
        fed = build(cfg, seed)
        fed.global_test = _Tripwire(fed.global_test, test_reads, phase)
        fed.server_val = _Tripwire(fed.server_val, val_reads, phase)
        return fed

    orig = ServerRunner.run_server_step

    def traced(self, step, round_idx, iteration, *a, **k):
        phase.append((round_idx, step.name, step.mode))
        try:
            return orig(self, step, round_idx, iteration, *a, **k)
        finally:
            phase.pop()

    monkeypatch.setattr(driver, "build_federated_data", wrapped)
    monkeypatch.setattr(ServerRunner, "run_server_step", traced)
    over = {"data__public": {"dataset": "synthetic", "size": 300}} if scenario == 1 else {}
    cfg = make_config(tiny_config(algorithm={"name": "slaugfl", "params": {**SLAUG, "scenario": scenario,
                                                                          "selection": selection}}, rounds=3,
                                  eval={"every": 100}, data__server_val=60, **over))
    run_experiment(cfg, out_dir=tmp_path / "run")
    if selection == "test":  # issue 34: the seed's protocol as a named option: the selection reads the test set
        assert set(test_reads) == {(2, "evaluate_server", "evaluate"), (-1, "prep_select", "train")}
        assert (-1, "prep_select", "train") not in val_reads
    else:
        assert test_reads and set(test_reads) == {(2, "evaluate_server", "evaluate")}  # the final evaluation only
        assert (-1, "prep_select", "train") in val_reads  # the selection read the validation set
    meta = results.load_metadata(tmp_path / "run")
    assert meta["data"]["server_val"]["size"] == 60 and meta["data"]["server_val"]["per_class"] == [6] * 10


def test_server_val_is_carved_from_the_pool_disjoint_and_required_by_slaugfl():
    from raysim.data.federated import build_federated_data

    base = make_config(tiny_config()).data
    cfg = make_config(tiny_config(data__server_val=25)).data
    fed0, fed = build_federated_data(base, 7), build_federated_data(cfg, 7)
    assert fed0.server_val is None and len(fed.server_val) == 25
    assert torch.bincount(fed.server_val.y, minlength=10).tolist() == [3] * 5 + [2] * 5  # class-stratified
    assert fed.server_val.provenance == "server_val"
    flat = lambda x: x.reshape(len(x), -1).float()
    val = flat(fed.server_val.x)
    for other in [c.x_train for c in fed.clients] + [c.x_test for c in fed.clients] + [fed.global_test.x]:
        # every synthetic sample is a distinct point: no validation sample is held by a client or the test set
        assert torch.cdist(val, flat(other.to(torch.float32) if other.dtype != torch.uint8 else other)).min() > 0
    torch.testing.assert_close(fed.global_test.x, fed0.global_test.x)  # the reported test set is unchanged
    again = build_federated_data(cfg, 7)
    assert torch.equal(again.server_val.x, fed.server_val.x)  # seeded
    with pytest.raises(ConfigError, match="data.server_val"):
        run_experiment(make_config(tiny_config(algorithm={"name": "slaugfl", "params": SLAUG})), write=False)
    with pytest.raises(ConfigError, match="data.server_val"):
        make_config(tiny_config(data__server_val=-1))
    with pytest.raises(Exception, match="data.server_val"):
        build_federated_data(make_config(tiny_config(data__server_val=5000)).data, 7)


def test_slaugfl_generator_downloaded_once_and_the_cost_formula():
    """Seed §IV-F: prep up N|w_C| + C d, generator down N|G| (once, in the setup only), each round K(|w| + Cd) up and
    K|w| (+ K C d once global p-f prototypes exist) down, where the p-f prototypes up are of the classes the generator
    learned (the covered ones); floats measured in the table."""
    t = run("slaugfl", SLAUG, rounds=3)
    n, c, d = 6, 10, 16
    w_c = mlp_floats()
    w_2c = mlp_floats(classes=2 * c)
    g = _generator_floats(SLAUG)
    setup = t[t["round"] == -1]
    covered = float(setup[setup["metric"] == "classes_covered"]["value"].iloc[0])
    assert total(setup, "up_floats@prep_train") == n * w_c
    assert total(setup, "up_floats@prep_prototypes") == covered * d
    assert total(setup, "down_floats@prep_augment") == n * g  # every device once
    assert total(setup, "down_floats") == n * g and total(setup, "up_floats") == n * w_c + covered * d
    gen_rows = t[(t["scope"] == "total") & (t["metric"] == "down_floats@prep_augment")]
    assert set(gen_rows["round"]) == {-1}  # never again
    for r in range(3):  # p-f prototypes up: of the synthetic classes, i.e. the covered ones; the global ones down
        k = total(t, "participants", r)
        assert total(t, "up_floats", r) == k * (w_2c + covered * d)
        assert total(t, "down_floats", r) == k * (w_2c + (c * d if r > 0 else 0))
    formula = n * (w_c + g) + covered * d + sum(total(t, "participants", r) * (2 * w_2c + covered * d + c * d)
                                                for r in range(3)) \
        - total(t, "participants", 0) * c * d  # round 0 has no global p-f prototypes to download yet
    assert total(t, "up_floats") + total(t, "down_floats") == formula


def test_slaugfl_pf_prototypes_come_from_synthetic_data_only():
    from raysim.engine.prepare import prepare
    from raysim.shared_maths import class_prototypes
    from raysim.runner.runners import ClientRunner, ServerRunner, server_data
    from raysim.steps import flatten

    cfg = make_config(tiny_config(algorithm={"name": "slaugfl", "params": SLAUG}, data__server_val=100))
    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test, server_data(prep.spec, prep.fed_data))
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    ids = clients.client_ids()
    payload, uploads = {}, {}  # a setup schedule starts with an empty payload
    for step, it in flatten(server.algorithm.setup_schedule()):
        if hasattr(step, "clients"):
            uploads, reports = clients.run_client_step(step, payload, -1, it, ids)
            assert all(r.ok for r in reports), [r.error for r in reports]
            clients.commit()
        else:
            out, _ = server.run_server_step(step, -1, it, [], uploads)
            payload = out if out is not None else payload
    alg = clients.algorithm
    cid = ids[0]
    state = clients.state(cid)
    data = clients._data(cid)
    learned = payload["classes"]["classes"].tolist() if "classes" in payload else list(range(10))
    assert sorted(set(state["syn_y"].tolist())) == learned  # only the classes the generator learned (a prototype)
    assert state["syn_x"].shape[0] == len(learned) * max(1, data.num_train // 10)  # class-balanced, floor(|D|/C) each
    assert set(state) == {"syn_x", "syn_y"}  # the preparation model is gone
    res = alg.client_update(server.initial_payload(0), state, data, clients._ctx(0, cid, "update"))
    model = alg.live_model(clients._ctx(0, cid))
    model.load_state_dict(res.upload["model"].tensors)
    model.eval()
    with torch.no_grad():
        _, z = model(state["syn_x"], return_embedding=True)
    classes, protos, counts = class_prototypes(z, state["syn_y"], 10)
    torch.testing.assert_close(res.upload["pf_protos"]["protos"], protos)
    assert res.upload["pf_protos"]["counts"].tolist() == counts.tolist()
    # the synthetic set never leaves the client: no upload holds as many rows as it
    assert all(v.shape[0] != state["syn_x"].shape[0] for m in res.upload.values() for v in m.tensors.values()
               if v.dim() > 1)


def test_slaugfl_scenario1_filters_candidates_from_the_public_set():
    params = {**SLAUG, "scenario": 1, "candidate_top_k": 7}
    t = run("slaugfl", params, data__public={"dataset": "synthetic", "size": 300})
    setup = t[(t["round"] == -1) & (t["scope"] == "server")].set_index("metric")["value"]
    assert setup["candidates_kept"] == 7 * setup["classes_covered"]  # 7 per covered class (each has >= 7 candidates)
    assert math.isfinite(setup["gan_d_loss"]) and math.isfinite(setup["gan_g_loss"])
    with pytest.raises(ConfigError, match="candidate_dir"):
        run("slaugfl", {"scenario": 1})
    with pytest.raises(ConfigError, match="scenario"):
        run("slaugfl", {"scenario": 3})
    with pytest.raises(ConfigError, match="prep_val_fraction"):
        run("slaugfl", {"prep_val_fraction": 1.0})


def test_slaugfl_candidate_folder(tmp_path):
    from PIL import Image
    import numpy as np

    from raysim.data.class_folders import load_class_folders as load_image_folder

    for c in (0, 2):
        (tmp_path / str(c)).mkdir()
        for j in range(2):
            Image.fromarray(np.full((5, 5), 51 * (c + j), dtype=np.uint8)).save(tmp_path / str(c) / f"{j}.png")
    (tmp_path / "notes").mkdir()
    x, y = load_image_folder(str(tmp_path), (1, 8, 8), 10)
    assert x.shape == (4, 1, 8, 8) and y.tolist() == [0, 0, 2, 2]
    assert float(x[3].mean()) == pytest.approx(153 / 255, abs=1e-6)


@pytest.mark.ray
def test_slaugfl_scenario1_sequential_equals_ray(ray_session):
    """Scenario 1 (ACGAN on filtered public candidates); scenario 2, the default, runs on Ray in
    tests/test_conformance.py."""
    params = {**SLAUG, "scenario": 1}
    over = {"data__public": {"dataset": "synthetic", "size": 300}}
    seq = run("slaugfl", params, **over)
    ray_t = run("slaugfl", params, backend={"name": "ray", "num_actors": 2, "num_cpus": 1}, **over)
    pd.testing.assert_frame_equal(without_timing(seq), without_timing(ray_t), check_exact=True)


# -- FedGen -----------------------------------------------------------------------------------------------------------
def test_fedgen_losses_by_hand():
    from algorithms.fedgen import ensemble_loss, fedgen_diversity

    eps = torch.tensor([[0.0], [1.0]])
    z = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    # pairs (a, b) over the 2 x 2 grid: noise distances [[0,1],[1,0]], layer distances [[0,2],[2,0]] -> mean 1
    assert float(fedgen_diversity(eps, z)) == pytest.approx(math.exp(-1.0))
    y = torch.tensor([0, 1])
    l1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    l2 = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    w = torch.tensor([[0.25, 1.0], [0.75, 0.0]])  # class 0: 1/4 client 1, 3/4 client 2; class 1: client 1 only
    ce = lambda row, t: -math.log(math.exp(row[t]) / sum(math.exp(v) for v in row))
    want = (0.25 * ce([1, 0], 0) + 0.75 * ce([0, 0], 0) + 1.0 * ce([0, 0], 1)) / 2
    assert float(ensemble_loss([l1, l2], w, y)) == pytest.approx(want, rel=1e-6)


def test_fedgen_generator_downloaded_every_round_after_the_first():
    from algorithms.fedgen import FedGen
    from raysim.engine.prepare import prepare

    t = run("fedgen")
    prep = prepare(make_config(tiny_config(algorithm={"name": "fedgen", "params": {}})))
    alg = FedGen(prep.spec.params, prep.spec.task)
    g = sum(v.numel() for v in alg.make_generator().state_dict().values() if v.is_floating_point())
    w = mlp_floats()
    for r in range(3):
        k = total(t, "participants", r)
        assert total(t, "up_floats", r) == k * w
        assert total(t, "down_floats", r) == k * (w + (g if r > 0 else 0))
    teacher = t[(t["metric"] == "train_teacher") & (t["scope"] == "client")]
    assert set(teacher["round"]) == {1, 2}  # the generator regularises from the second round
    with pytest.raises(ConfigError, match="decay"):
        run("fedgen", {"decay": 0.0})


def test_fedgen_ht_ensemble_by_hand():
    from algorithms.fedgen_ht import ensemble_logits

    h1, h2 = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        h1.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        h2.weight.copy_(torch.tensor([[0.0, 2.0], [4.0, 0.0]]))
    z = torch.tensor([[1.0, 2.0]])
    # 0.25 * [1, 2] + 0.75 * [4, 4] = [3.25, 3.5]
    assert ensemble_logits([h1, h2], [0.25, 0.75], z).tolist() == [[3.25, 3.5]]


def test_fedgen_ht_shares_heads_and_the_generator_only():
    from algorithms.fedgen_ht import FedGenHt
    from raysim.engine.prepare import prepare

    t = run("fedgen_ht", {"gen_steps": 3})
    prep = prepare(make_config(tiny_config(algorithm={"name": "fedgen_ht", "params": {}})))
    alg = FedGenHt(prep.spec.params, prep.spec.task)
    g = sum(v.numel() for v in alg.make_generator().state_dict().values() if v.is_floating_point())
    head = 16 * 10 + 10  # mlp head: embed 16 -> 10 classes; the body never leaves the client
    for r in range(3):  # the generator goes down every round, from the first (HtFLlib); label counts are ints
        k = total(t, "participants", r)
        assert total(t, "up_floats", r) == k * head
        assert total(t, "down_floats", r) == k * (head + g)
    teacher = t[(t["metric"] == "train_teacher") & (t["scope"] == "client")]
    assert set(teacher["round"]) == {0, 1, 2} and (teacher["value"] > 0).all()
    with pytest.raises(ConfigError, match="gen_lr"):
        run("fedgen_ht", {"gen_lr": 0.0})
    with pytest.raises(ConfigError, match="gen_batch"):  # BatchNorm over one generated sample
        run("fedgen_ht", {"gen_batch": 1})


# -- VHL --------------------------------------------------------------------------------------------------------------
def test_supcon_by_hand():
    from algorithms.vhl import supcon

    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    t = 0.5
    # anchor 0: positive 1 (sim 1), others {1: 1, 2: 0} -> -log(e^2 / (e^2 + e^0)); anchor 1 the same; anchor 2 none
    want = -math.log(math.exp(2) / (math.exp(2) + 1))
    assert float(supcon(z, y, t)) == pytest.approx(want, rel=1e-6)
    assert float(supcon(z, y, t, anchors=1)) == pytest.approx(want, rel=1e-6)
    assert float(supcon(z, torch.tensor([0, 1, 2]), t)) == 0.0


def test_vhl_generator_once_and_the_same_virtual_data_everywhere():
    from raysim.engine.prepare import prepare
    from raysim.runner.runners import ClientRunner, ServerRunner
    from raysim.steps import flatten

    t = run("vhl", {"virtual_per_class": 3})
    prep = prepare(make_config(tiny_config(algorithm={"name": "vhl", "params": {"virtual_per_class": 3}})))
    server = ServerRunner(prep.spec, prep.fed_data.global_test)
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    g = sum(v.numel() for v in server.algorithm.make_generator().state_dict().values() if v.is_floating_point())
    assert total(t, "down_floats", -1) == 6 * g and total(t, "up_floats", -1) == 0
    w = mlp_floats(classes=20)
    for r in range(3):
        k = total(t, "participants", r)
        assert total(t, "up_floats", r) == k * w and total(t, "down_floats", r) == k * w
    payload = {}
    for step, it in flatten(server.algorithm.setup_schedule()):
        if hasattr(step, "clients"):
            clients.run_client_step(step, payload, -1, it, clients.client_ids())
            clients.commit()
        else:
            payload, _ = server.run_server_step(step, -1, it, [], {})
    a, b = clients.state(0), clients.state(3)
    assert a["vx"].shape == (30, 1, 8, 8) and torch.equal(a["vx"], b["vx"]) and a["vy"].tolist() == b["vy"].tolist()
    assert float(a["vx"].std()) > 0.0
    with pytest.raises(ConfigError, match="temperature"):
        run("vhl", {"temperature": 0.0})
