"""Bring your own model, data and method on a real two-node Ray cluster (issue 24). Run it from a working directory
that holds the user's modules (neither installed nor on PYTHONPATH), e.g. a copy of examples/byo's mycnn.py,
mydata.py and mymethod.py:

    cd /tmp/mywork && PYTHONPATH=<raysim checkout> python <raysim checkout>/benchmarks/two_node_byo.py --json out.json

A head node and a second node (1 CPU each, ``ray.cluster_utils.Cluster``: separate GCS, raylets, object stores);
raysim connects with ``backend.address``, spreads its two client actors over both nodes, and each actor builds its
clients' data on its own node (``backend.data: auto`` = actors on a cluster) with the user's loader. The config names
the model (``mycnn:small_cnn``), the loader (``mydata:digits``) and the method (``mymethod:UniformAvg``) by import
path; ``backend.code: auto`` ships the three modules as Ray ``py_modules``. Checked: every actor imported the three
modules from the copy Ray unpacked on its node (not from the working directory: on a one-machine cluster Ray also
puts the driver's working directory on every worker's path, reported as ``plain_task_sees_user_module``; on separate
machines that path does not exist), and the table equals the sequential backend's. Every process started here is
ended at the end.
"""
from __future__ import annotations

import argparse
import json
import sys

import ray
from ray.cluster_utils import Cluster

from raysim.io.results import without_timing
from raysim.config import make_config
from raysim.engine.callbacks import Callback
from raysim.engine.loop import run_experiment

MODULES = ["mycnn", "mydata", "mymethod"]


def config(rounds: int, **backend) -> dict:
    return {"name": "byo_cluster", "seed": 5, "rounds": rounds,
            "data": {"dataset": "mydata:digits", "num_clients": 6, "partition": "dirichlet",
                     "partition_params": {"alpha": 0.5, "samples_per_client": 80, "test_ratio": 0.25}},
            "model": {"arch": "mycnn:small_cnn", "params": {"channels": 8, "embed_dim": 32}},
            "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
            "algorithm": {"name": "mymethod:UniformAvg"},
            "backend": {"name": "sequential", **backend}, "output": {"progress": False}}


@ray.remote(num_cpus=0)
def plain_import(name):  # a task without raysim's runtime_env: can a worker see the user's module?
    import importlib.util

    return importlib.util.find_spec(name) is not None


class Where(Callback):
    """While the run's Ray session is up: where the actors are, what was shipped, where they imported it from."""

    def __init__(self, node2):
        self.node2 = node2

    def on_run_end(self, run, result):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.nodes = run.backend.actor_nodes()
        self.shipped = run.backend.shipped
        def imported_from(actor, names):  # run in the actor's process (Ray's __ray_call__)
            import sys

            return {n: getattr(sys.modules.get(n), "__file__", None) for n in names}

        self.files = ray.get([a.__ray_call__.remote(imported_from, MODULES) for a in run.backend.actors])
        self.plain = ray.get(plain_import.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            self.node2, soft=False)).remote("mycnn"))


def byo_check(address: str, node2_id: str, rounds: int) -> dict:
    """The user's model, loader and method on the cluster at ``address`` (the driver's working directory holds their
    modules) against the sequential backend; also run by benchmarks/two_node.py --byo on its cluster."""
    ref = run_experiment(make_config(config(rounds)), progress=False, write=False)
    cfg = make_config(config(rounds, name="ray", num_actors=2, num_cpus=0.5, placement="spread", address=address))
    where = Where(node2_id)
    res = run_experiment(cfg, progress=False, write=False, callbacks=[where])
    label = lambda nid: "node2" if nid == node2_id else "head"  # noqa: E731
    identical = without_timing(ref.table).drop(columns="run_id").equals(without_timing(res.table).drop(columns="run_id"))
    return {
        "actors": [label(n) for n in where.nodes],
        "shipped": where.shipped,
        "actor_module_files": where.files,
        "from_shipped_copy": all(f[m] and "runtime_resources" in f[m] for f in where.files for m in MODULES),
        "plain_task_sees_user_module": where.plain,
        "identical_to_sequential": bool(identical),
        "final_test_acc": res.final()[0],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        node2 = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = byo_check(cluster.address, node2.node_id, args.rounds)
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f)
        return 0 if out["identical_to_sequential"] and out["from_shipped_copy"] else 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
