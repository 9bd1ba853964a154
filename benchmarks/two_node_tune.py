"""Tuning across a two-node Ray cluster with a PostgreSQL study (issue "Fault tolerance", item 6).

Starts a private PostgreSQL server (Debian's postgresql; initdb in a temporary directory, its own port, run as the
postgres user), a two-node Ray cluster (``ray.cluster_utils.Cluster``: head and node 2, 1 CPU each), and runs
``tuning.study.tune(..., parallel=2, storage=postgresql+psycopg://...)`` with ``backend.address`` pointing at the
cluster, so one trial runs on each node. While a trial runs on node 2, node 2 is stopped (its processes ended by
PID). The lost trial is marked failed ("interrupted") and its values enqueued again; they finish on the head. Then
a fresh node 3 joins and the study is resumed with 2 more trials, one per node. Checks: no trial lost (each
interrupted trial's values finish in a trial naming it) or counted twice; results came back from both nodes.
Everything started here is stopped at the end.

    python benchmarks/two_node_tune.py [--trials 6] [--json out.json]

``benchmarks/two_node.py --tune N`` runs the same study (``study_on_cluster``) on its own cluster after its node-stop
run, on a fresh second node: the test suite's way (one cluster, one driver process for both).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

PG_BIN = Path("/usr/lib/postgresql")


def _pg_bin() -> Path:
    versions = sorted(PG_BIN.glob("*/bin/initdb"))
    if not versions:
        raise SystemExit("PostgreSQL server binaries not found (apt-get install -y postgresql)")
    return versions[-1].parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A throw-away PostgreSQL server in ``root`` (trust auth on 127.0.0.1 only)."""

    def __init__(self, root: Path):
        self.root, self.bin, self.port = root / "pg", _pg_bin(), _free_port()
        self.as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *args):
        subprocess.run(self.as_pg + [str(self.bin / args[0]), *args[1:]], check=True, capture_output=True)

    def start(self) -> str:
        self.root.mkdir()
        os.chmod(self.root.parent, 0o755)
        if self.as_pg:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.root), "-A", "trust", "-U", "postgres", "--no-sync")
        self._run("pg_ctl", "-D", str(self.root), "-w", "-l", str(self.root / "log"), "-o",
                  f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "raysim")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/raysim"

    def stop(self):
        try:
            self._run("pg_ctl", "-D", str(self.root), "-m", "immediate", "stop")
        except Exception:
            pass


BASE = {"name": "tune2node", "seed": 5, "rounds": 4, "clients_per_round": None,
        "data": {"dataset": "mnist5k", "num_clients": 8, "partition": "nway_kshot",
                 "partition_params": {"ways": 3, "shots": 20, "stdev": 1, "test_shots": 10}, "val_fraction": 0.2},
        "model": {"arch": "cnn_mnist", "params": {"embed_dim": 16}},
        "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.02, "momentum": 0.5},
        "algorithm": {"name": "fedproto", "params": {}}, "eval": {"every": 2}, "output": {"progress": False}}
SPACE = {"params": {"algorithm.params.lam": {"type": "float", "low": 0.05, "high": 5.0, "log": True}},
         "objective": {"metric": "val_acc", "mode": "final"}, "pruner": {"name": "none"},
         "sampler": {"name": "random", "seed": 0}, "trial_resources": {"num_cpus": 1, "num_gpus": 0}}


def study_on_cluster(cluster, node2, url: str, trials: int, out_dir: Path, log=print) -> dict:
    """The study on a running two-node cluster (``node2``: the node to stop) with PostgreSQL storage ``url``: node2
    is stopped while a trial runs there; then a fresh node 3 joins and the study is resumed with 2 more trials (one
    per node: a result comes back from a node other than the head). Returns what happened (trials, where they ran,
    interrupted and retried ones, the checks)."""
    import optuna

    from tuning.space import parse_space
    from tuning.study import open_storage, tune

    study_name = "two-node"
    stopped = {}

    def watch():  # stop node 2 while a trial runs there (its first, most often: the window is a whole trial; waiting
        # for a second one there could miss it, as the head may take the remaining trials while node 2 starts up)
        while not stopped:
            time.sleep(0.25)
            try:  # a fresh connection each time: a cached storage would not show other processes' updates
                st = optuna.load_study(study_name=study_name, storage=open_storage(url))
            except Exception as e:
                log(f"watch: {type(e).__name__} {str(e)[:200]}")
                continue
            ts = st.get_trials(deepcopy=False)
            run2 = [t for t in ts if t.user_attrs.get("node") == node2.node_id and not t.state.is_finished()]
            if run2:
                stopped.update(at=time.time(), running_trial=run2[0].number)
                cluster.remove_node(node2)

    own = not ray.is_initialized()
    if own:  # one Ray job for both tune calls below: the resumed study reuses the first one's task workers
        root = str(Path(__file__).resolve().parent.parent)
        ray.init(address=cluster.address, logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": root}})
    open_storage(url)  # create the schema once, before the watcher and the study connect (concurrent
    # first connections race on PostgreSQL's CREATE TYPE: duplicate key in pg_type_typname_nsp_index)
    threading.Thread(target=watch, daemon=True).start()
    over = [f"backend.address={cluster.address}"]
    t0 = time.perf_counter()
    tune(BASE, parse_space(SPACE), trials, storage=url, study_name=study_name, out_dir=out_dir,
         parallel=2, overrides=over, log=lambda m: log(f"tune: {m}"))
    wall1 = time.perf_counter() - t0
    stopped.setdefault("at", None)
    node3 = None
    if stopped["at"] is not None:  # a fresh node for the resumed study: one of its 2 trials runs there
        node3 = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    r2 = tune(BASE, parse_space(SPACE), trials + 2, storage=url, study_name=study_name, out_dir=out_dir,
              parallel=2, overrides=over, log=lambda m: log(f"tune (resumed): {m}"))
    if own:
        ray.shutdown()
    st = optuna.load_study(study_name=study_name, storage=open_storage(url))
    ts = st.get_trials(deepcopy=False)
    finished = [t for t in ts if t.user_attrs.get("outcome") in ("complete", "pruned", "diverged", "error")]
    interrupted = [t for t in ts if t.user_attrs.get("outcome") == "interrupted"]
    names = {node2.node_id: "node2", cluster.head_node.node_id: "head"}
    if node3 is not None:
        names[node3.node_id] = "node3"
    where = lambda t: names.get(t.user_attrs.get("node"), "?")  # noqa: E731
    retried = {t.user_attrs.get("retry_of") for t in ts if t.user_attrs.get("retry_of") is not None}
    lam_of = lambda t: round(t.params.get("algorithm.params.lam", float("nan")), 6)  # noqa: E731
    lam = [lam_of(t) for t in finished]
    # an interrupted trial is not lost: a finished trial runs its values again and names it (retry_of)
    rerun = {t.user_attrs.get("retry_of"): lam_of(t) for t in finished if t.user_attrs.get("retry_of") is not None}
    out = {
        "storage": url.split("@")[0] + "@127.0.0.1:<port>/raysim",
        "trials": [{"number": t.number, "outcome": t.user_attrs.get("outcome"), "node": where(t),
                    "retry_of": t.user_attrs.get("retry_of"), "value": t.value} for t in ts],
        "finished": len(finished), "finished_on": sorted({where(t) for t in finished}),
        "ran_on": sorted({where(t) for t in ts if t.user_attrs.get("node")}),
        "interrupted": [t.number for t in interrupted], "retried": sorted(retried),
        "node2_stopped_while_running_trial": stopped.get("running_trial"),
        "no_trial_lost": all(rerun.get(t.number) == lam_of(t) for t in interrupted),
        "no_trial_counted_twice": len(lam) == len(set(lam)) and len(finished) == trials + 2,
        "first_call_wall_s": round(wall1, 1), "best_value": r2.best_value,
    }
    lost_on = {where(t) for t in interrupted}
    out["ok"] = bool(out["no_trial_lost"] and out["no_trial_counted_twice"] and out["interrupted"]
                     and lost_on == {"node2"} and out["finished_on"] == ["head", "node3"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="raysim-2node-tune-"))
    pg = Postgres(root)
    cluster = None
    try:
        url = pg.start()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        node2 = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = study_on_cluster(cluster, node2, url, args.trials, root / "study")
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out))
        return 0 if out["ok"] else 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
