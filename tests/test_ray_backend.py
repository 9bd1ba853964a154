"""Ray backend: identical result tables to the sequential backend (1 and 2 actors), GPU packing and fail-fast,
failures as values. One Ray session for the whole test session (2 CPUs, 2 declared fake GPUs, no CUDA calls)."""
import os

import pandas as pd
import pytest
import torch

from raysim.backends.ray_preflight import check_resources
from raysim.engine.settings import backend_settings
from raysim.engine.loop import run_experiment
from raysim.errors import ConfigError
from raysim.io.results import without_timing
from tests.conftest import register_for_test


@pytest.fixture(autouse=True)
def _test_algorithms(monkeypatch):
    register_for_test(monkeypatch, failing_fedavg="tests.failing_algo:FailingFedAvg", placement_probe="tests.failing_algo:PlacementProbe")


pytestmark = pytest.mark.ray


def table(cfg):
    return without_timing(run_experiment(cfg, write=False).table)


@pytest.mark.parametrize("algo", ["fedproto", "fedavg", "local"])
def test_sequential_equals_ray_one_and_two_actors(ray_session, tiny, algo):
    params = {"algorithm": {"name": algo, "params": {}}, "rounds": 3, "clients_per_round": 5}
    seq = table(tiny(**params))
    for actors in (1, 2):
        r = table(tiny(**params, backend={"name": "ray", "num_actors": actors, "num_cpus": 1}))
        pd.testing.assert_frame_equal(seq, r, check_exact=True)
    assert len(seq) > 100


def test_heterogeneous_models_identical_on_ray(ray_session, tiny):
    model = {"assign": "cycle", "per_client": [{"arch": "mlp", "params": {"hidden": 16, "embed_dim": 16}},
                                               {"arch": "cnn_small", "params": {"channels": 8, "embed_dim": 16}}]}
    seq = table(tiny(model=model))
    r = table(tiny(model=model, backend={"name": "ray", "num_actors": 2}))
    pd.testing.assert_frame_equal(seq, r, check_exact=True)


def test_failures_identical_on_ray(ray_session, tiny, tmp_path):
    """Also the Ray test of the trackers (tests/test_tracking.py): they are driver callbacks, so TensorBoard gets
    the same scalars from either backend."""
    params = {"algorithm": {"name": "failing_fedavg", "params": {"fail_clients": [1, 4]}}}
    seq = run_experiment(tiny(**params, output={"progress": False, "tensorboard": str(tmp_path / "seq")}), write=False)
    r = run_experiment(tiny(**params, backend={"name": "ray", "num_actors": 2},
                            output={"progress": False, "tensorboard": str(tmp_path / "ray")}), write=False)
    pd.testing.assert_frame_equal(without_timing(seq.table), without_timing(r.table), check_exact=True)
    assert [(f["round"], f["client_id"]) for f in r.metadata["failures"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    from tests.test_tracking import scalars

    a, b = scalars(tmp_path / "seq" / seq.run_id), scalars(tmp_path / "ray" / r.run_id)
    for tag in ("test_acc", "total/up_bytes"):
        assert [(e.step, e.value) for e in a.Scalars(tag)] == [(e.step, e.value) for e in b.Scalars(tag)] != []


def test_warm_actors_are_reused_only_when_their_resources_match(ray_session, tiny):
    """keep_actors_warm (on in the test session): a run reuses parked actor processes when its actors ask for the
    same resources (the same actors, reset), gives the table fresh actors give, leaves same-resource actors it does
    not need parked, and ends parked actors that do not fit it before starting its own."""
    from raysim.backends.ray_actors import WARM
    from raysim.engine.callbacks import Callback

    class Ids(Callback):
        def on_run_start(self, run):
            self.ids = sorted(a._actor_id.hex() for a in [*run.backend.actors, run.backend.server])

    def run(**backend):
        ids = Ids()
        t = run_experiment(tiny(rounds=2, backend={"name": "ray", **backend}), write=False, callbacks=[ids]).table
        return ids.ids, without_timing(t)

    seq = without_timing(run_experiment(tiny(rounds=2), write=False).table)
    first, t_first = run(num_actors=2, num_cpus=1)  # fresh or parked processes, whatever the session holds
    assert len(WARM["client"]) == 2 and len(WARM["server"]) == 1  # parked after the run
    again, t_again = run(num_actors=2, num_cpus=1)
    assert again == first  # the same actors served the second run
    one, t_one = run(num_actors=1, num_cpus=1)  # fewer actors of the same resources: nothing new started
    assert set(one) < set(first) and len(WARM["client"]) == 2
    other, t_other = run(num_actors=1, num_cpus=0.5)  # other resources: the parked client actors are ended
    assert len(set(other) & set(first)) == 1  # the server (same resources) was reused; the client actor is new
    for t in (t_first, t_again, t_one, t_other):
        pd.testing.assert_frame_equal(t, seq, check_exact=True)
    # the last run's actors stay parked for the next test's 0.5-CPU actors (release_warm_actors() is checked in
    # tests/test_byo.py, whose actors carry the user's code: no later run can use them)


def test_fractional_gpus_pack_onto_declared_gpus(ray_session, tiny):
    # 2 actors x 0.5 GPU + server 0.5 GPU fit on the 2 fake GPUs; nothing calls CUDA (device stays cpu)
    cfg = tiny(rounds=1, algorithm={"name": "placement_probe", "params": {}},
               backend={"name": "ray", "num_actors": 2, "num_cpus": 0.5, "num_gpus": 0.5, "server_num_gpus": 0.5})
    res = run_experiment(cfg, write=False)
    t, meta = without_timing(res.table), res.metadata
    probe = {m: t[(t.scope == "client") & (t.metric == m)]["value"] for m in
             ("probe_pid", "probe_gpus_visible", "probe_gpu_id", "probe_on_cpu", "probe_cuda_hidden")}
    assert len(probe["probe_pid"]) == 6 and probe["probe_pid"].nunique() == 2  # every client evaluated, on 2 actors
    assert probe["probe_gpus_visible"].eq(1).all()  # Ray gave each actor (a share of) one of the fake GPUs
    assert probe["probe_gpu_id"].isin([0, 1]).all()
    if not torch.cuda.is_available():
        assert probe["probe_on_cpu"].eq(1).all()  # no CUDA here: the device stayed the CPU
    if os.environ.get("RAYSIM_TEST_CUDA") != "1":  # the suite hides a real GPU from the actors too (tests/conftest.py)
        assert probe["probe_cuda_hidden"].eq(1).all()
        # and the run metadata says where each process computed
        assert {p["role"]: p["device"] for p in meta["numerics_processes"]} == {"clients": "cpu", "server": "cpu"}


def test_too_many_gpus_fail_fast(ray_session, tiny, monkeypatch):
    """Refused before any actor is defined or started (not timed: an event)."""
    import ray

    made = []
    monkeypatch.setattr(ray, "remote", lambda *a, **k: made.append(a) or pytest.fail("an actor was defined"))
    cfg = tiny(rounds=1, backend={"name": "ray", "num_actors": 3, "num_cpus": 0.5, "num_gpus": 1})
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg, write=False)
    assert e.value.field == "backend.num_gpus" and "do not fit" in str(e.value)
    assert made == []


def test_too_many_cpus_fail_fast(ray_session, tiny):
    cfg = tiny(rounds=1, backend={"name": "ray", "num_actors": 4, "num_cpus": 1})
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg, write=False)
    assert e.value.field == "backend.num_actors"


def test_resource_arithmetic(tiny):
    cfg = tiny(backend={"name": "ray", "num_actors": 4, "num_cpus": 0.5, "num_gpus": 0.25})
    check_resources(backend_settings(cfg), cpus=2, gpus=1, where="x")  # four actors per GPU
    with pytest.raises(ConfigError, match="has none"):
        check_resources(backend_settings(cfg), cpus=2, gpus=0, where="x")
    cfg = tiny(backend={"name": "ray", "num_actors": 3, "num_cpus": 0.5, "num_gpus": 0.4})
    with pytest.raises(ConfigError, match="do not fit"):  # 0.4 packs 2 per GPU: 3 actors need 2 GPUs
        check_resources(backend_settings(cfg), cpus=2, gpus=1.0, where="x")
    check_resources(backend_settings(cfg), cpus=2, gpus=2.0, where="x")


TWO_ARCHS = {"assign": "cycle", "per_client": [{"arch": "mlp", "params": {"hidden": 16, "embed_dim": 16}},
                                               {"arch": "cnn_small", "params": {"channels": 8, "embed_dim": 16}}]}


def test_model_resources_give_each_architecture_its_own_actors(ray_session, tiny, monkeypatch):
    """backend.model_resources: the cnn_small clients (1, 3, 5) run on two actors of 0.5 GPU each, the mlp clients
    (0, 2, 4) on the one default actor of 0.25 GPU (fake GPUs; nothing calls CUDA); the table is the sequential one."""
    register_for_test(monkeypatch, pool_probe="tests.failing_algo:PoolProbe")
    over = dict(rounds=1, model=TWO_ARCHS, algorithm={"name": "pool_probe", "params": {}})
    t = table(tiny(**over, backend={"name": "ray", "num_actors": 1, "num_cpus": 0.5, "num_gpus": 0.25,
                                    "model_resources": [{"arch": "cnn_small", "num_actors": 2, "num_cpus": 0.5,
                                                         "num_gpus": 0.5}]}))
    probe = t[(t.scope == "client") & t.metric.str.startswith("probe_")].pivot_table(
        index="client_id", columns="metric", values="value")
    assert probe.loc[[0, 2, 4], "probe_gpu_share"].eq(0.25).all() and probe.loc[[0, 2, 4], "probe_pid"].nunique() == 1
    assert probe.loc[[1, 3, 5], "probe_gpu_share"].eq(0.5).all() and probe.loc[[1, 3, 5], "probe_pid"].nunique() == 2
    assert set(probe.loc[[0, 2, 4], "probe_pid"]).isdisjoint(probe.loc[[1, 3, 5], "probe_pid"])
    seq = table(tiny(**over))
    keep = ~t.metric.str.startswith("probe_")
    pd.testing.assert_frame_equal(seq[~seq.metric.str.startswith("probe_")].reset_index(drop=True),
                                  t[keep].reset_index(drop=True), check_exact=True)


def test_a_gpu_budget_below_the_models_footprint_is_refused_before_any_actor(ray_session, tiny, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "remote", lambda *a, **k: pytest.fail("an actor was defined"))
    cfg = tiny(rounds=1, model=TWO_ARCHS, backend={
        "name": "ray", "num_actors": 1, "num_cpus": 0.5, "decoded_cache_mb": 0,
        "model_resources": [{"arch": "cnn_small", "num_gpus": 0.5, "gpu_memory_mb": 0.01}]})
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg, write=False)
    assert e.value.field == "backend.model_resources[0].gpu_memory_mb"
    assert "cnn_small needs about" in str(e.value) and "activations of a batch" in str(e.value)
    too_many = tiny(rounds=1, model=TWO_ARCHS, backend={
        "name": "ray", "num_actors": 1, "num_cpus": 0.5, "num_gpus": 1,
        "model_resources": [{"arch": "cnn_small", "num_actors": 3, "num_cpus": 0.1, "num_gpus": 0.6}]})
    with pytest.raises(ConfigError, match="do not fit") as e:
        run_experiment(too_many, write=False)
    assert e.value.field == "backend.model_resources[0].num_gpus"


def test_actor_pools_and_placement_stay_within_a_pool(tiny):
    from raysim.engine.placement import actor_pools, plan_pools

    cfg = tiny(model=TWO_ARCHS, backend={"name": "ray", "num_actors": 2,
                                         "model_resources": [{"arch": "cnn_small", "num_actors": 1, "num_gpus": 0.5}]})
    pools, layout = actor_pools(cfg.backend, ["mlp", "cnn_small"] * 3)
    assert [(p.arch, p.actors, p.num_gpus) for p in pools] == [(None, [0, 1], 0.0), ("cnn_small", [2], 0.5)]
    assert layout == {0: 0, 2: 1, 4: 0, 1: 2, 3: 2, 5: 2}
    # all the load on actor 0: the plan may move mlp clients to actor 1, never a cnn_small client off actor 2
    new = plan_pools({0: 10.0, 2: 1.0, 4: 10.0, 1: 5.0, 3: 5.0, 5: 5.0}, {0: 0, 2: 0, 4: 0, 1: 2, 3: 2, 5: 2}, pools)
    assert {new[c] for c in (1, 3, 5)} == {2} and {new[c] for c in (0, 2, 4)} == {0, 1}
    plain, lay = actor_pools(tiny(backend={"name": "ray", "num_actors": 4}).backend, ["mlp"] * 6)
    assert len(plain) == 1 and lay == {c: c % 4 for c in range(6)}


def test_cuda_without_a_visible_gpu_is_one_line_before_anything_starts(tiny, monkeypatch):
    """backend.device: cuda where no process could see a GPU: sequential without CUDA here; Ray actors (any pool)
    or the server asking for no GPU (Ray hides the GPUs a process did not reserve)."""
    import torch

    from raysim.backends import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check_device(backend_settings(tiny(backend={"name": "sequential", "device": "cuda"})))
    assert e.value.field == "backend.device"
    with pytest.raises(ConfigError) as e:
        check_device(backend_settings(tiny(backend={"name": "ray", "device": "cuda", "num_gpus": 0})))
    assert e.value.field == "backend.num_gpus"
    with pytest.raises(ConfigError) as e:
        check_device(backend_settings(tiny(model=TWO_ARCHS, backend={"name": "ray", "device": "cuda", "num_gpus": 0.5,
                                                    "server_num_gpus": 0.1,
                                                    "model_resources": [{"arch": "mlp", "num_gpus": 0}]})))
    assert e.value.field == "backend.model_resources[0].num_gpus"
    with pytest.raises(ConfigError) as e:
        check_device(backend_settings(tiny(backend={"name": "ray", "device": "cuda", "num_gpus": 0.5})))
    assert e.value.field == "backend.server_num_gpus"
    check_device(backend_settings(tiny(backend={"name": "ray", "device": "cuda", "num_gpus": 0.5, "server_num_gpus": 0.1})))
