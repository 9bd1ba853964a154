"""Client actors that die mid-step (issue "Fault tolerance"): the actor is recreated, its clients' committed states
come back from the durable store and the step is retried, giving the identical table to an undisturbed run;
on_actor_failure: skip records the clients as failed and goes on; stop ends with one clear error."""
import pandas as pd
import pytest

from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing
from raysim.errors import SimulationError
from tests.conftest import register_for_test


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, dying_fedproto="tests.failing_algo:DyingFedProto")


pytestmark = pytest.mark.ray


def dying(tiny, marker_dir, how="exit", **over):
    return tiny(**{"rounds": 4, "clients_per_round": 5, "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.05,
                                                                  "momentum": 0.5, "persist_optimizer": True},
                   "algorithm": {"name": "dying_fedproto", "params": {"marker_dir": str(marker_dir), "die_client": 3,
                                                                      "die_round": 2, "how": how}},
                   "backend": {"name": "ray", "num_actors": 2, "num_cpus": 1, "balance": "static"}, **over})


def test_killed_actor_is_replaced_and_the_table_is_identical(ray_session, tiny, tmp_path):
    quiet = tmp_path / "undisturbed"
    quiet.mkdir()
    (quiet / "died").touch()  # the marker exists: nobody dies
    ref = run_experiment(dying(tiny, quiet, backend={"name": "sequential"}), write=False)
    killed = tmp_path / "killed"
    killed.mkdir()
    res = run_experiment(dying(tiny, killed), write=False)
    assert (killed / "died").exists()  # the actor really died
    # (run ids differ only because marker_dir is a parameter)
    pd.testing.assert_frame_equal(without_timing(ref.table.drop(columns="run_id")), without_timing(res.table.drop(columns="run_id")), check_exact=True)
    assert res.metadata["actor_failures"][0]["action"] == "retry"


def test_a_stopped_actor_is_taken_for_dead_after_the_step_timeout(ray_session, tiny, tmp_path):
    """A SIGSTOPped actor (alive, never answering) stalled the run with no message: with backend.step_timeout_s its
    call is given up, the actor killed and replaced, the step retried: the undisturbed table."""
    quiet = tmp_path / "undisturbed"
    quiet.mkdir()
    (quiet / "died").touch()
    ref = run_experiment(dying(tiny, quiet, backend={"name": "sequential"}), write=False)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    res = run_experiment(dying(tiny, stopped, how="stop", backend={
        "name": "ray", "num_actors": 2, "num_cpus": 1, "balance": "static", "step_timeout_s": 3}), write=False)
    assert (stopped / "died").exists()  # the actor really stopped itself
    pd.testing.assert_frame_equal(without_timing(ref.table.drop(columns="run_id")),
                                  without_timing(res.table.drop(columns="run_id")), check_exact=True)
    assert res.metadata["actor_failures"][0]["action"] == "retry"
    assert res.metadata["actor_failures"][0]["error"] == "StepTimeout"


def test_skip_policy_fails_the_dead_actors_clients(ray_session, tiny, tmp_path):
    res = run_experiment(dying(tiny, tmp_path, on_actor_failure="skip"), write=False)
    t = res.table
    failed = t[(t["metric"] == "failed") & (t["round"] == 2)]["client_id"].tolist()
    assert 3 in failed and all(c % 2 == 1 for c in failed)  # actor 1 hosts the odd client ids
    assert t["round"].max() == 3  # the run went on
    assert res.metadata["actor_failures"][0]["action"] == "skip"


def test_stop_policy_ends_with_one_clear_error(ray_session, tiny, tmp_path):
    with pytest.raises(SimulationError, match="client actor 1 died during round 2, step 'update'.*on_actor_failure: stop"):
        run_experiment(dying(tiny, tmp_path, on_actor_failure="stop"), write=False)
