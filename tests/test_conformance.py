"""Conformance suite: every shipped method passes the checks of ``raysim.testing`` (the module a user runs on a
method of their own): it runs end to end on tiny data with finite metrics and picklable state, gives an identical
table for the same seed, with every client state spilled to disk (state_memory_mb: 0), after a resume from a
checkpoint, and (Ray tests) on the Ray backend with 2 actors and spilled states; and survives an aggregation round
with no uploads. Message accounting runs per method in tests/test_privacy.py (with the leak check). The checks
themselves are shown to fail on a method that breaks them (below)."""
import pandas as pd

from tests.conftest import method_overrides
import pytest

from raysim import testing
from raysim.config.registry import ALGORITHMS

NAMES = sorted(n for n, target in ALGORITHMS.items() if target.startswith("algorithms."))  # the shipped methods

_SEQUENTIAL: dict = {}  # method -> its sequential table (the conformance test's run, reused by the Ray test)


def cfg_for(tiny, name, **over):
    from tests.conftest import method_overrides

    # two rounds: a resume after the first, the second from carried state (methods whose state starts in round 1: FedGen
    # generator, FedProto prototypes) -- the checks need no third
    return tiny(rounds=2, clients_per_round=4, algorithm={"name": name, "params": {}}, **{**method_overrides(name), **over})


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_conformance(tiny, name, tmp_path):
    cfg = cfg_for(tiny, name)
    table = testing.check_determinism(cfg)
    testing.check_measures(cfg, table)  # every accuracy metric says which model it evaluates (issue 52)
    _SEQUENTIAL[name] = table
    testing.check_spill(cfg, table, state_dir=tmp_path / "states")
    testing.check_resume(cfg, table, workdir=tmp_path)
    testing.check_empty_round(cfg)


@pytest.mark.ray
@pytest.mark.parametrize("name", NAMES)
def test_sequential_equals_ray_for_every_method(ray_session, tiny, name):
    """One Ray run per method: 2 actors, states spilled (1 actor: tests/test_ray_backend.py)."""
    cfg = cfg_for(tiny, name)
    testing.check_sequential_equals_ray(cfg, _SEQUENTIAL.get(name), num_actors=2, spill=True)


# -- the checks can fail ---------------------------------------------------------------------------------------------

def test_the_checks_fail_on_a_method_that_breaks_them(tiny, monkeypatch, tmp_path):
    """A method whose server draws from an unseeded stream is caught by the determinism check; a client that sends an
    undeclared kind by the accounting check; a table with a NaN by check_runs; a changed value is named."""
    from tests.conftest import register_for_test

    register_for_test(monkeypatch, nondet_avg="tests.failing_algo:NondeterministicAvg",
                      undeclared_avg="tests.failing_algo:UndeclaredUploadAvg")
    with pytest.raises(AssertionError, match="determinism"):
        testing.check_determinism(tiny(rounds=2, algorithm={"name": "nondet_avg", "params": {}}))
    with pytest.raises(AssertionError, match="undeclared message kinds.*'extra_kind'"):
        testing.check_message_accounting(tiny(rounds=1, algorithm={"name": "undeclared_avg", "params": {}}))
    cfg = tiny(rounds=2, algorithm={"name": "fedavg", "params": {}})
    t = testing.check_runs(cfg)
    with pytest.raises(AssertionError, match="non-finite"):
        testing.check_runs(cfg, table=t.assign(value=t["value"].where(t.index != 3, float("nan"))))
    changed = t.copy()
    row = changed.index[changed["metric"] == "test_acc"][0]
    changed.loc[row, "value"] += 0.5
    with pytest.raises(AssertionError, match="spilled.*tables differ") as e:
        testing.check_spill(cfg, changed, state_dir=tmp_path / "states")
    assert "test_acc" in str(e.value)  # the differing row is shown
    with pytest.raises(AssertionError, match="resumed"):
        testing.check_resume(cfg, changed, workdir=tmp_path)
    with pytest.raises(testing.ConfigError) as e:
        testing.check_resume(tiny(rounds=1), workdir=tmp_path / "one")
    assert e.value.field == "rounds"


def test_assert_same_table_ignores_wall_time_rows(tiny):
    t = testing.check_runs(tiny(rounds=1, algorithm={"name": "fedavg", "params": {}}))
    timed = t["metric"].isin(["round_s"]) | t["metric"].str.startswith("step_s@")
    assert timed.any()
    other = t.copy()
    other.loc[timed, "value"] = other.loc[timed, "value"] + 1.0
    testing.assert_same_table(t, other, "timing only")  # no error
    with pytest.raises(AssertionError, match="^x: the tables differ"):
        testing.assert_same_table(t, pd.concat([t, t[~timed].tail(1)]), "x")  # one row more


def test_slaugfl_runs_its_small_generator_in_the_suites(tiny):
    """The generic suites run SlaugFL with a small generator (its production default trains 300 steps of a
    128-channel one: 5 s per tiny run) and with its server-held validation set."""
    from tests.conftest import SLAUGFL_SMALL

    cfg = cfg_for(tiny, "slaugfl")
    assert cfg.data.server_val == 100
    assert all(cfg.algorithm.params[k] == v for k, v in SLAUGFL_SMALL.items()), cfg.algorithm.params


@pytest.mark.parametrize("name", NAMES)
def test_no_stray_host_tensor_on_the_device_path(tiny, name):
    """issue "GPU-first execution": every method's client and server steps, evaluation and the vectorised executor
    keep tensors where the run's device is (raysim.testing.DeviceGuard): a CPU tensor that would meet a CUDA one on
    a GPU fails here, on a CPU."""
    cfg = tiny(rounds=2, clients_per_round=4, algorithm={"name": name, "params": {}}, **method_overrides(name))
    testing.check_device_residence(cfg)


def test_device_guard_finds_what_cuda_refuses():
    """The guard's rules on a hand-made case: a mask made without device= meets parameters moved to the device (the
    vectorised optimiser's old CUDA crash), .cpu() on both sides, a factory given device=, a scalar."""
    import os

    import torch

    here = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    dev = torch.device("cpu")
    with testing.DeviceGuard(roots=here) as g:
        p = torch.ones(3, 4).to(dev)
        torch.where(torch.zeros(3, 1, dtype=torch.bool), p, p)  # recorded: host mask, device tensors
    assert len(g.findings) == 1 and "where" in next(iter(g.findings))
    with testing.DeviceGuard(roots=here) as g:
        p = torch.ones(3, 4).to(dev)
        torch.where(torch.zeros(3, 1, dtype=torch.bool, device=dev), p, p)  # placed: fine
        p.cpu() + torch.ones(3, 4)  # both on the host: fine
        p * torch.tensor(2.0)  # a 0-dim host scalar: fine
        q = torch.zeros(3, 4)
        q.copy_(p)  # a copy across devices: fine
    assert not g.findings, g.findings
