"""A real two-node Ray cluster on this machine, run in its own process (benchmarks/two_node.py): raysim connects
with backend.address, its client actors land on both nodes, the second node is stopped mid-run by ending its
processes, the dead actor is recreated on the surviving node and the table equals an undisturbed sequential run;
on the same cluster the user's own modules from a temporary working directory are shipped to both nodes.
The two nodes run different native CPU kernels (as two machines with different CPUs): portable numerics gives the
sequential table there, native numerics another."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cluster


def test_two_node_cluster_survives_a_node_stop(tmp_path):
    """One two-node cluster (benchmarks/two_node.py, working directory tmp_path): portable vs native kernels on nodes
    with different native kernels; then one run of the user's own model, loader and method (issue 24) from tmp_path
    — not installed, not on PYTHONPATH — shipped to both nodes, node2 stopped mid-run, its actor recreated on the
    head: the sequential table."""
    import shutil

    for m in ("mycnn", "mydata", "mymethod"):
        shutil.copy(ROOT / "examples" / "byo" / f"{m}.py", tmp_path / f"{m}.py")
    out = tmp_path / "two_node.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "two_node.py"), "--rounds", "4", "--stop-after", "1",
                        "--byo", "--config", str(ROOT / "configs" / "fedproto_mnist5k.yaml"), "--json", str(out)],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert sorted(r["actors_before"]) == ["head", "node2"]  # one actor on each node
    assert r["node2_stopped"] and r["actors_after"] == ["head", "head"]
    assert r["actor_failures"] and r["actor_failures"][0]["action"] == "retry"
    assert r["identical_to_sequential"]
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


def test_two_node_tuning_study_on_postgresql_survives_a_node_stop(tmp_path):
    if postgresql_missing():
        pytest.skip(postgresql_missing())
    out = tmp_path / "tune.json"
    p = subprocess.run([sys.executable, "benchmarks/two_node_tune.py", "--trials", "4", "--json", str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["finished"] == 6 and set(r["finished_on"]) == {"head", "node2"}  # trials ran on both nodes
    assert r["interrupted"] and r["no_trial_lost"] and r["no_trial_counted_twice"]
