"""A real two-node Ray cluster on this machine, run in its own process (benchmarks/two_node.py): raysim connects
with backend.address, its client actors land on both nodes, the second node is stopped mid-run by ending its
processes, the dead actor is recreated on the surviving node and the table equals an undisturbed sequential run;
on the same cluster the user's own modules from a temporary working directory are shipped to both nodes.
The two nodes run different native CPU kernels (as two machines with different CPUs): portable numerics gives the
sequential table there, native numerics another. Then, on the same cluster with a fresh second node, a tuning study
on PostgreSQL loses that node mid-study and loses no trial. One cluster and one driver process serve both tests (the
module's fixture; both tests on one xdist worker)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]  # one worker: one cluster for both


def postgresql_missing() -> str:
    """Why benchmarks/two_node_tune.py cannot start its PostgreSQL server here ('' when it can): it needs Debian's
    server binaries, psycopg, and as root the runuser command (the server runs as the postgres user)."""
    import importlib.util
    import shutil

    if not sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        return "PostgreSQL server binaries not found (apt-get install -y postgresql)"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser (the server must run as the postgres user)"
    return ""


@pytest.fixture(scope="module")
def two_node(tmp_path_factory):
    """One two-node cluster for both tests below (benchmarks/two_node.py, working directory a temporary one): portable
    vs native kernels on nodes with different native kernels; one run of the user's own model, loader and method
    (issue 24) from the working directory — not installed, not on PYTHONPATH — shipped to both nodes, node2 stopped
    mid-run, its actor recreated on the head; then (where PostgreSQL can run) a tuning study on PostgreSQL across the
    head and a fresh second node, stopped mid-study, resumed with a third. Returns (report, the finished process)."""
    import shutil

    tmp_path = tmp_path_factory.mktemp("two_node")
    for m in ("mycnn", "mydata", "mymethod"):
        shutil.copy(ROOT / "examples" / "byo" / f"{m}.py", tmp_path / f"{m}.py")
    out = tmp_path / "two_node.json"
    tune = [] if postgresql_missing() else ["--tune", "2"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "two_node.py"), "--rounds", "3",
                             "--stop-after", "1", "--byo", "--config", str(ROOT / "configs" / "fedproto_mnist5k.yaml"),
                             "--json", str(out), *tune], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:  # SIGTERM first: the script stops its cluster and PostgreSQL server
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        stderr += "\n[test_cluster: benchmarks/two_node.py ran past 900 s and was stopped]"
    p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return (json.loads(out.read_text()) if out.exists() else None), p


def test_two_node_cluster_survives_a_node_stop(two_node):
    r, p = two_node
    assert r is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(r["actors_before"]) == ["head", "node2"]  # one actor on each node
    assert r["node2_stopped"] and r["actors_after"] == ["head", "head"]
    assert r["actor_failures"] and r["actor_failures"][0]["action"] == "retry"
    assert r["identical_to_sequential"], p.stdout[-3000:] + p.stderr[-3000:]
    # the nodes run different native kernels (head AVX2, node2 those of a CPU without AVX2): portable pins every
    # process to the same ones (the table above equals the sequential run); native leaves each node its own, and the
    # table then depends on where the clients ran
    assert r["portable_capabilities"] == ["head:AVX2", "node2:AVX2"]
    assert r["native_capabilities"] == ["head:AVX2", "node2:DEFAULT"] and r["native_modes"] == ["native"]
    assert r["native_cluster_differs_from_native_sequential"]
    byo = r["byo"]  # the node-stop run above is the user's model, loader and method, shipped to both nodes
    assert sorted(Path(s).name for s in byo["shipped"]) == ["mycnn.py", "mydata.py", "mymethod.py"]
    assert len(byo["actor_module_files"]) == 2  # both actors, one per node (actors_before)
    assert byo["from_shipped_copy"]  # every actor imported them from the copy Ray unpacked on its node
    assert p.returncode == 0 or not r.get("tune", {}).get("ok", True), p.stdout[-3000:] + p.stderr[-3000:]


def test_two_node_tuning_study_on_postgresql_survives_a_node_stop(two_node):
    if postgresql_missing():
        pytest.skip(postgresql_missing())
    r, p = two_node
    assert r is not None and "tune" in r, p.stdout[-3000:] + p.stderr[-3000:]
    t = r["tune"]
    assert "error" not in t, t["error"]
    # node2 stopped while a trial ran there: that trial is interrupted, its values run again (retry_of) and finish;
    # then node 3 joins and the resumed study's 2 trials run one on each node: results come back from both
    lost = [x for x in t["trials"] if x["outcome"] == "interrupted"]
    assert lost and {x["node"] for x in lost} == {"node2"}, t
    assert t["no_trial_lost"] and t["no_trial_counted_twice"] and t["finished"] == 4, t
    assert t["finished_on"] == ["head", "node3"] and t["ok"], t
