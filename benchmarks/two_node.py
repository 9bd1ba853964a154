"""A real two-node Ray cluster on this machine (issue "Fault tolerance"): a head node and a second node, each with
1 CPU, started as separate Ray node processes (``ray.cluster_utils.Cluster``: its own GCS, raylets, object stores);
raysim connects with ``backend.address``, places its two client actors (0.5 CPU each) on both nodes
(``backend.placement: spread``; client data built on each actor's node from the config), and part-way into a round
the second node is stopped by ending its own processes by PID (``Cluster.remove_node``; ``ray stop`` would end
every Ray process of the machine). The actor that lived there dies; on_actor_failure: retry recreates it on the
surviving node (its 0.5 CPU fits there), its clients' committed states come from the run's state directory, and the
run completes with the table of an undisturbed sequential run. Every process started here is ended at the end.

The two nodes also run different native kernels, as two machines with different CPUs would (issue "Same table on any
machine"): the head's processes start with ``ATEN_CPU_CAPABILITY=avx2``, node2's with ``default`` (torch's kernels for
a CPU without AVX2). In ``backend.numerics: native`` the table then depends on where each client ran (a native run on
the cluster differs from a native sequential run with the head's kernels; its metadata shows both capabilities); in
``portable`` (the default, the run above) every process runs the same kernels and the table equals the sequential one.

With ``--tune N`` the same cluster then hosts benchmarks/two_node_tune.py's study (a PostgreSQL server started and
stopped here; a fresh second node joins, is stopped while a trial runs there, and a third joins for the resumed
study): the test suite runs everything in one process on one cluster (tests/test_cluster.py). ``--json`` is written
after the node-stop part and again after the study; a failed study is reported under ``tune.error``.

    python benchmarks/two_node.py [--rounds 8] [--stop-after 3] [--byo] [--tune 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import yaml
import ray
from ray.cluster_utils import Cluster

from raysim import numerics
from raysim.config import load_config, make_config
from raysim.engine.callbacks import Callback
from raysim.engine.loop import run_experiment
from raysim.io.results import without_timing


class StopNode(Callback):
    def __init__(self, cluster, node, after_round: int, delay_s: float, modules: tuple = ()):
        self.cluster, self.node, self.after, self.delay = cluster, node, after_round, delay_s
        self.before, self.after_nodes, self.stopped_at = None, None, None
        self.modules, self.shipped, self.files = list(modules), None, None

    def on_run_start(self, run):
        self.before = run.backend.actor_nodes()
        self.server = run.backend.server_node()
        print(f"client actors on {self.before}, server on {self.server}, node2 {self.node.node_id}", file=sys.stderr, flush=True)

    def on_round_end(self, run, round_idx, evaluated):
        if self.modules and self.files is None:  # the user's modules, after a round (the model is built on first use):
            # what was shipped, where each actor (on both nodes, before the stop) imported them from
            self.shipped = run.backend.shipped
            def imported_from(actor, names):  # run in the actor's process (Ray's __ray_call__)
                import sys

                return {n: getattr(sys.modules.get(n), "__file__", None) for n in names}

            self.files = ray.get([a.__ray_call__.remote(imported_from, self.modules) for a in run.backend.actors])
        if round_idx == self.after:
            def stop():
                self.stopped_at = time.time()
                self.cluster.remove_node(self.node)  # ends that node's raylet, object store and workers by PID

            if self.delay:  # part-way into the next round
                threading.Timer(self.delay, stop).start()
            else:  # before the next round starts: its first step meets the dead actor, whatever the round's length
                stop()

    def on_run_end(self, run, result):
        self.after_nodes = run.backend.actor_nodes()


def own_kernels(capability: str) -> dict:
    """Make the environment a node (its raylet and workers) starts with: its own native kernel choice and none of
    raysim's pins. Returns the environment to restore."""
    saved = dict(os.environ)
    numerics.unpin()
    os.environ["ATEN_CPU_CAPABILITY"] = capability
    return saved


def restore(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)


NATIVE_PAIR = """
import json, sys
from raysim.app.cli import main
sys.exit(main(["run", *json.loads(sys.argv[1])]) or main(["run", *json.loads(sys.argv[2])]))
"""


def native_checks(config: str, ov: list, address: str, node2_id: str) -> dict:
    """backend.numerics: native on the mixed cluster vs native sequentially with the head's kernels: both runs with
    ``raysim run``'s code in one fresh process (a process keeps one numerics mode; this driver is portable)."""
    from raysim.io import results

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != numerics.MARK and k not in numerics.PORTABLE_ENV}
    # the driver process computes the sequential run: the head's kernels (the actors' come from their nodes' env)
    env.update(PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
               RAYSIM_NUMERICS="native", ATEN_CPU_CAPABILITY="avx2")
    ov = ov + ["backend.numerics=native", "output.progress=false"]
    with tempfile.TemporaryDirectory() as tmp:
        def args(out, extra):
            return json.dumps([config, "--out", out] + [a for o in ov + extra for a in ("--set", o)])

        ray_ov = ["backend.name=ray", "backend.num_actors=2", "backend.num_cpus=0.5", "backend.placement=spread",
                  f"backend.address={address}"]
        p = subprocess.run([sys.executable, "-c", NATIVE_PAIR, args(f"{tmp}/seq", ["backend.name=sequential"]),
                            args(f"{tmp}/cluster", ray_ov)], env=env, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"raysim run failed ({p.returncode}): {p.stderr[-2000:]}")
        seq = without_timing(results.load(f"{tmp}/seq").drop(columns="run_id"))
        clu = without_timing(results.load(f"{tmp}/cluster").drop(columns="run_id"))
        meta = results.load_metadata(f"{tmp}/cluster")
    procs = meta["numerics_processes"]
    return {"native_capabilities": sorted({("node2" if p["node"] == node2_id else "head") + ":" + p["cpu_capability"]
                                            for p in procs}),
            "native_modes": sorted({p["mode"] for p in procs}),
            "native_cluster_differs_from_native_sequential": not clu.equals(seq)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/fedproto_mnist5k.yaml")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--stop-after", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-native", dest="native", action="store_false", help="skip the native-kernels checks")
    ap.add_argument("--byo", action="store_true",
                    help="the node-stop run uses the user's own model, loader and method (benchmarks/two_node_byo.py's "
                         "config; their modules in the working directory, shipped to both nodes) instead of --config")
    ap.add_argument("--tune", type=int, default=0, metavar="N",
                    help="then a tuning study of N trials on PostgreSQL on the same cluster, with a fresh second node "
                         "stopped mid-study (benchmarks/two_node_tune.py's study_on_cluster); its report under 'tune'")
    args = ap.parse_args()
    ov = [f"rounds={args.rounds}", "eval.every=4", "clients_per_round=10"]
    if args.byo:
        from two_node_byo import MODULES, config as byo_config  # this script's folder is on sys.path

        def make(*backend):
            return make_config(byo_config(args.rounds, **{k: yaml.safe_load(v) for k, v in (b.split("=", 1) for b in backend)}))
    else:
        MODULES = ()

        def make(*backend):
            return load_config(args.config, ov + [f"backend.{b}" for b in backend])
    ref = run_experiment(make("name=sequential"), progress=False, write=False)
    saved = own_kernels("avx2")  # the head's processes: AVX2 kernels natively
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        os.environ["ATEN_CPU_CAPABILITY"] = "default"  # node2's: the kernels of a CPU without AVX2
        node2 = cluster.add_node(num_cpus=1)
    finally:
        restore(saved)
    try:
        cluster.wait_for_nodes()
        native = native_checks(args.config, ["rounds=1", "eval.every=1", "clients_per_round=10"],
                               cluster.address, node2.node_id) if args.native else {}
        cfg = make("name=ray", "num_actors=2", "num_cpus=0.5", "placement=spread", f"address={cluster.address}")
        stopper = StopNode(cluster, node2, args.stop_after, 0.0 if args.byo else 0.3, MODULES)
        t0 = time.perf_counter()
        res = run_experiment(cfg, progress=False, write=False, callbacks=[stopper])
        wall = time.perf_counter() - t0
        node2_id = node2.node_id
        label = lambda nid: "node2" if nid == node2_id else "head"  # noqa: E731
        a, b = without_timing(ref.table.drop(columns="run_id")), without_timing(res.table.drop(columns="run_id"))
        identical = a.equals(b)  # but for the wall-time rows (round_s, step_s@*), which differ run to run
        out = {
            "actors_before": [label(n) for n in stopper.before],
            "actors_after": [label(n) for n in stopper.after_nodes] if stopper.after_nodes else None,
            "server": label(stopper.server),
            "node2_stopped": stopper.stopped_at is not None,
            "actor_failures": res.metadata["actor_failures"],
            "identical_to_sequential": bool(identical),
            "final_test_acc": res.final()[0], "wall_s": round(wall, 1),
            "portable_capabilities": sorted({("node2" if p["node"] == node2_id else "head") + ":" + p["cpu_capability"]
                                             for p in res.metadata["numerics_processes"]}),
            **native,
        }
        if args.byo:
            out["byo"] = {"shipped": stopper.shipped, "actor_module_files": stopper.files,
                          "from_shipped_copy": all(f[m] and "runtime_resources" in f[m] for f in stopper.files
                                                   for m in MODULES)}
        report(out, args.json)  # the node-stop part's report stands even if the study below fails
        if args.tune:
            out["tune"] = tune_part(cluster, args.tune)
            report(out, args.json)
        if not identical:
            pd.testing.assert_frame_equal(a, b)
        ok_byo = not args.byo or out["byo"]["from_shipped_copy"]
        ok_tune = not args.tune or out["tune"].get("ok", False)
        return 0 if identical and out["actor_failures"] and ok_byo and ok_tune else 1
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            cluster.shutdown()


def report(out: dict, path) -> None:
    print(json.dumps(out, indent=1), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f)


def tune_part(cluster, trials: int) -> dict:
    """The study of benchmarks/two_node_tune.py on this cluster (node2 is gone: a fresh second node joins and is
    stopped in its turn while a trial runs there); its PostgreSQL server is started and stopped here. A failure is
    reported as ``{"error": ...}``, not raised."""
    import traceback

    from two_node_tune import Postgres, study_on_cluster

    pg_root = Path(tempfile.mkdtemp(prefix="raysim-2node-tune-"))
    pg = None
    try:
        pg = Postgres(pg_root)
        url = pg.start()
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        return study_on_cluster(cluster, node, url, trials, pg_root / "study",
                                log=lambda m: print(m, file=sys.stderr, flush=True))
    except Exception as e:
        detail = getattr(e, "stderr", None)
        return {"ok": False, "error": "".join(traceback.format_exception(e))[-3000:]
                + (f"\n{detail.decode(errors='replace')[-2000:]}" if isinstance(detail, bytes) else "")}
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(pg_root, ignore_errors=True)

if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped test or CI job: clean up (the finally blocks)
    sys.exit(main())
