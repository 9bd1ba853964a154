"""Shared fixtures. Ray tests use one Ray session per test session (``ray_session``), declared with 2 CPUs and 2
fake GPUs so that GPU packing can be tested without CUDA (nothing in the tests calls CUDA: it is hidden, below, on a
machine that has it), with warm actors
(``keep_actors_warm``): a Ray run reuses the worker processes of the previous run whose actors asked for the same
resources instead of starting new ones. Parked actors hold their CPUs: a test that runs its own Ray tasks or actors
asks for no CPU (``num_cpus=0``) or calls ``release_warm_actors()`` first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.config import make_config

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray starts its workers at niceness 15: with pytest-xdist the Ray-session tests (one worker) would then get almost no
# CPU while the other worker computes at niceness 0, and their serial chain becomes the suite's longest. The test
# session's Ray clusters (the session, the two-node clusters, `raysim run` subprocesses) run their workers at the
# pytest workers' niceness instead: the same work, shared fairly. (raysim itself leaves Ray's default alone.)
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray starts idle workers ahead of demand at ray.init; raysim's actors never use them (each actor starts its own
# process) and the suite starts several Ray clusters: the prestarted processes (an interpreter importing Ray each)
# only take CPU from the tests. Tasks (tuning trials) start their workers on demand instead.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# The suite computes on the CPU on every machine, a GPU box included: `backend.device: auto` would otherwise pick CUDA
# there and every exact comparison (goldens, sequential = Ray, hand-computed maths) would meet GPU numbers. Hidden
# before anything initialises CUDA; Ray is told not to reset CUDA_VISIBLE_DEVICES in the actors that hold the session's
# fake GPUs (the placement probe reads its reserved slots from Ray). RAYSIM_TEST_CUDA=1 keeps the GPUs visible for the
# tests marked `gpu` (tests/test_gpu.py: RAYSIM_TEST_CUDA=1 pytest -m gpu), which are skipped where CUDA is absent or
# hidden; it is for those alone (the Ray session's 2 fake GPUs then map onto the real ones).
if os.environ.get("RAYSIM_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"

ROOT = Path(__file__).resolve().parent.parent  # the checkout under test


def register_for_test(monkeypatch, **targets: str) -> None:
    """Register test-only algorithms (name -> "module:Class") for one test: undone after it, so no registration
    leaks into later tests (the runners receive them with the run, as any user registration)."""
    from raysim.config import registry

    for name, target in targets.items():
        monkeypatch.setitem(registry.ALGORITHMS, name, target)
        monkeypatch.setitem(registry.USER_ALGORITHMS, name, target)


def tiny_config(**over) -> dict:
    """A run that takes well under a second per round: synthetic data, 6 clients, an MLP."""
    cfg = {
        "name": "tiny",
        "seed": 7,
        "rounds": 3,
        "data": {"dataset": "synthetic", "num_clients": 6, "partition": "nway_kshot",
                 "partition_params": {"ways": 3, "shots": 10, "stdev": 1, "test_shots": 5}},
        "model": {"arch": "mlp", "params": {"hidden": 32, "embed_dim": 16}},
        "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
        "algorithm": {"name": "fedproto", "params": {"lam": 1.0}},
        "backend": {"name": "sequential"},
        "output": {"progress": False},
    }
    for key, value in over.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


def method_overrides(name: str) -> dict:
    """Config overrides a method needs on the tiny config: FedPer shares conv layers by default (the mlp has none),
    so it runs on the two-conv cnn_small; PN-ICFL pre-trains on a public set. Every branch returns; one method, one
    branch (tests/test_conformance.py: test_slaugfl_runs_its_small_generator_in_the_suites)."""
    if name == "fedper":
        return {"model": {"arch": "cnn_small", "params": {"channels": 4, "embed_dim": 16}}}
    if name in ("pnicfl", "pnicfl_plus"):  # server pre-training on a public set; 2 clusters of 6 clients
        return {"data__public": {"dataset": "synthetic", "size": 400},
                "algorithm__params": {"num_clusters": 2, "pretrain_episodes": 5}}
    if name == "slaugfl":  # picks representatives on a server-held validation set; a small generator (the
        # production default trains 300 steps of a 128-channel one)
        return {"data__server_val": 100, "algorithm__params": dict(SLAUGFL_SMALL)}
    if name == "fedfomo":  # weighs the received models on a validation split
        return {"data__val_fraction": 0.2}
    if name in MUTUAL:  # the mutual-learning family: 4 rotated domains with the four-way local split, Adam
        return {"data": {"dataset": "synthetic", "num_clients": 4, "partition": "shared_base",
                         "partition_params": {"per_class": 12}, "rotations": [0, 90, 180, 270],
                         "local_split": {"public": 0.1, "val": 0.1, "test": 0.15}},
                "train": {"optimizer": "adam", "lr": 0.01, "batch_size": 8, "persist_optimizer": True,
                          "local_steps": 2},
                "algorithm__params": MUTUAL[name]}
    return {}


SLAUGFL_SMALL = {"gen_steps": 20, "gen_channels": 8, "gen_noise": 8, "prep_epochs": 3}
MUTUAL = {"mafml": {"iterations": 2}, "ind": {}, "agg": {}, "fml": {}, "fedkd": {"ramp_rounds": 3},
          "fedmd": {"n_alignment": 30, "digest_batch": 16, "transfer_public_epochs": 1, "transfer_private_epochs": 1}}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks (else they are ignored)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (the suite runs on every core, pyproject.toml): every test that uses the Ray session runs on
    one worker (one Ray session per test session); the two-node cluster tests share one cluster, on one worker (their
    own group, tests/test_cluster.py); the rest wherever a worker is free."""
    in_ray = []
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            continue
        if "ray_session" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
            in_ray.append(item)
    # Within the Ray group, the runs with the default actor resources first and together, then those whose actors
    # ask for other resources or that end the parked actors (RAY_LATE, moved to the end of the session in rank
    # order; the rest keep their places): each switch of resources ends the parked actors and starts new processes
    # (torch imported again, seconds each). Same order on every xdist worker.
    rank = {id(i): RAY_LATE.get(getattr(i, "originalname", i.name), 0) for i in in_ray}
    late = sorted((i for i in in_ray if rank[id(i)]), key=lambda i: rank[id(i)])  # stable: collection order within
    if late:
        moved = {id(i) for i in late}
        items[:] = [i for i in items if id(i) not in moved] + late


# Ray-group tests that run after the others (the rank orders them): their actors ask for other resources than the
# default backend's (1 CPU per client actor), or they end the session's parked actors (tasks, model_resources).
RAY_LATE = {
    "test_warm_actors_are_reused_only_when_their_resources_match": 1,  # default, then 0.5 CPU per actor
    "test_mafml_sequential_equals_ray_one_actor_per_node": 2,  # 0.5 CPU per actor (4 actors), as the warm test's last
    "test_fractional_gpus_pack_onto_declared_gpus": 3,  # 0.5 GPU per actor
    "test_user_code_ships_to_ray_actors": 4,  # a runtime_env with the user's modules
    "test_model_resources_give_each_architecture_its_own_actors": 5,  # several pools: no warm actors
    "test_parallel_trials_on_ray_match_in_process_runs": 5,  # Ray tasks need the CPUs the parked actors hold
}


@pytest.fixture(scope="session")
def fresh_process(tmp_path_factory):
    """tests/fresh_process.py's report (a dict): one fresh process for the checks that need one — what ``import
    raysim`` loads, ``raysim list``, GPU requests refused before Ray starts on a plain machine (the configs: client
    actors' GPUs, then the server's). Its tests share an xdist group: one process per test session."""
    import json
    import yaml

    tmp = tmp_path_factory.mktemp("fresh_process")
    runs = []
    for k, b in enumerate(({"num_gpus": 0.5}, {"server_num_gpus": 1})):
        cfg = tmp / f"gpu{k}.yaml"
        cfg.write_text(yaml.safe_dump(tiny_config(backend={"name": "ray", "num_actors": 2, **b})))
        runs.append([str(cfg), "--out", str(tmp / f"out{k}")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "fresh_process.py"), str(tmp / "report.json"),
                        json.dumps(runs)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp / "report.json").read_text())
    report["files_left"] = sorted(q.name for q in tmp.iterdir())  # nothing but the configs and the report
    return report


@pytest.fixture
def tiny():
    return lambda **over: make_config(tiny_config(**over))


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {"PYTHONPATH": root}
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden == "":  # Ray refuses 2 GPUs where none is visible: it sees the fake ones' ids, its workers none
            os.environ["CUDA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"] = "0,1", ""
        try:
            ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR",
                     runtime_env={"env_vars": env})
        finally:
            if hidden is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    from raysim.backends.ray_actors import keep_actors_warm

    keep_actors_warm(True)  # each run reuses the previous run's actor processes when their resources match
    yield ray
    keep_actors_warm(False)
    ray.shutdown()
