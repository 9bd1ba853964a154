"""Cost-aware placement (backend.balance: cost): the plan and the cost model on hand examples; on Ray, clients move
between actors with their data and state and the table stays identical to the sequential one (with spilling, with
the durable store, and with an actor killed after moves)."""
import pandas as pd
import pytest

from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.engine.placement import CostModel, ideal, makespan, moves, plan
from tests.conftest import register_for_test


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, dying_fedproto="tests.failing_algo:DyingFedProto")



def test_plan_moves_few_clients_from_the_current_layout():
    costs = {0: 5.0, 1: 4.0, 2: 3.0, 3: 3.0, 4: 3.0}
    current = {c: 0 for c in costs}  # everything on actor 0: makespan 18
    new = plan(costs, current, 2)
    # gap 18: the client nearest 9 moves (c0, 5) -> 13 / 5; gap 8: nearest 4 (c1) -> 9 / 9. LPT would give 10 with
    # 3 moves (5 -> a0, 4 -> a1, 3 -> a1, 3 -> a0, 3 -> a1)
    assert new == {0: 1, 1: 1, 2: 0, 3: 0, 4: 0}
    assert makespan(costs, new, 2) == 9.0
    assert moves(current, new) == {0: (0, 1), 1: (0, 1)}
    assert ideal(costs, 2) == 9.0 and ideal({0: 10.0, 1: 1.0}, 2) == 10.0


def test_plan_reaches_the_balanced_layout_from_a_skewed_one():
    # actor 0: two 6s, actor 1: two 1s (makespan 12): a 6 moves (6 / 8), then a 1 moves back (7 / 7), as LPT's 7
    costs = {0: 6.0, 1: 6.0, 2: 1.0, 3: 1.0}
    current = {0: 0, 1: 0, 2: 1, 3: 1}
    new = plan(costs, current, 2)
    assert makespan(costs, new, 2) == 7.0


def test_plan_moves_few_of_many_equal_clients_measured_with_noise():
    # 48 equal clients measured with +-50 % noise, 24 per actor, loads 6 % apart: LPT alone re-deals 28 of them
    # (each move ships data and state); the plan moves 2 and lands within the slack of LPT's makespan
    import random

    r = random.Random(4)
    costs = {c: 3.0 * (1 + 0.5 * (2 * r.random() - 1)) for c in range(48)}
    current = {c: c % 2 for c in costs}
    new = plan(costs, current, 2)
    assert len(moves(current, new)) == 2
    lpt = {c: 0 for c in costs}
    loads = [0.0, 0.0]
    for c in sorted(costs, key=lambda c: (-costs[c], c)):
        k = 0 if loads[0] <= loads[1] else 1
        lpt[c] = k
        loads[k] += costs[c]
    assert makespan(costs, new, 2) <= 1.05 * makespan(costs, lpt, 2)
    assert len(moves(current, lpt)) > 20


def test_plan_keeps_a_layout_that_is_close_enough():
    costs = {0: 5.0, 1: 4.0, 2: 3.0, 3: 3.0, 4: 3.0}
    current = {0: 0, 1: 1, 2: 0, 3: 1, 4: 1}  # loads 8 / 10: the plan's makespan is 10 too
    assert plan(costs, current, 2) == current
    skewed = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}  # 12 / 6 > 1.05 x 10
    assert plan(costs, skewed, 2) != skewed
    assert plan(costs, skewed, 1) == skewed


def test_cost_model_prior_then_measured():
    m = CostModel(samples={0: 100, 1: 50, 2: 100}, arch={0: 0, 1: 0, 2: 1}, arch_params={0: 10, 1: 20})
    assert m.predict("update", 0) == 100 * 10 and m.predict("update", 2) == 100 * 20  # samples x parameters
    m.observe("update", 0, 2.0)
    assert m.predict("update", 0) == 2.0
    assert m.predict("update", 1) == pytest.approx(1.0)  # same architecture: 50 samples x 2 s / 100 samples
    assert m.predict("update", 2) == pytest.approx(4.0)  # unseen architecture: twice the parameters per sample
    m.observe("update", 0, 4.0)
    assert m.predict("update", 0) == pytest.approx(3.0)  # moving average, decay 0.5
    assert m.predict("evaluate", 0) == 100 * 10  # steps are costed separately


def _skewed(tiny, **over):
    return tiny(**{"rounds": 4, "data": {"dataset": "synthetic", "num_clients": 6, "partition": "dirichlet",
                                         "partition_params": {"alpha": 0.2, "min_samples": 5, "test_ratio": 0.2}},
                   "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5,
                             "persist_optimizer": True}, **over})


def _table(cfg):
    return without_timing(run_experiment(cfg, write=False).table)


@pytest.mark.ray
@pytest.mark.parametrize("extra", [{}, {"state_memory_mb": 0}, {"durable": True}])
def test_moves_keep_the_table_identical(ray_session, tiny, extra):
    extra = dict(extra)  # the parametrize dict is shared between reruns: never mutate it
    durable = extra.pop("durable", False)
    over = {"on_actor_failure": "retry"} if durable else {}
    ref = _table(_skewed(tiny, **over))
    res = run_experiment(_skewed(tiny, backend={"name": "ray", "num_actors": 2, "num_cpus": 1, "balance": "cost",
                                                **extra}, **over), write=False)
    assert sum(e["moves"] for e in res.timing["balance"]) > 0  # clients really changed actors
    pd.testing.assert_frame_equal(ref, without_timing(res.table), check_exact=True)


@pytest.mark.ray
def test_actor_killed_after_moves_is_replaced_with_its_current_clients(ray_session, tiny, tmp_path):
    quiet = tmp_path / "undisturbed"
    quiet.mkdir()
    (quiet / "died").touch()
    alg = lambda d: {"name": "dying_fedproto", "params": {"marker_dir": str(d), "die_client": 3, "die_round": 2}}
    ref = run_experiment(_skewed(tiny, algorithm=alg(quiet)), write=False)
    killed = tmp_path / "killed"
    killed.mkdir()
    res = run_experiment(_skewed(tiny, algorithm=alg(killed), backend={"name": "ray", "num_actors": 2, "num_cpus": 1,
                                                                     "balance": "cost"}), write=False)
    assert (killed / "died").exists()
    assert sum(e["moves"] for e in res.timing["balance"]) > 0
    pd.testing.assert_frame_equal(without_timing(ref.table.drop(columns="run_id")),
                                  without_timing(res.table.drop(columns="run_id")), check_exact=True)


def test_balance_is_checked(tiny):
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="backend.balance"):
        tiny(backend={"name": "ray", "balance": "fastest"})
