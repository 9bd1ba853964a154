"""CPU time used while a command runs, by kind of process (the command's own processes, Ray's daemons and workers,
and whatever else runs on the machine): samples /proc every 0.25 s while the command runs and sums each process's CPU
time (user + system) gained since it was first seen. Linux only. Issue 32: where the test suite's CPU goes.

    python benchmarks/cpu_by_process.py -- python3 -m pytest -q
    python benchmarks/cpu_by_process.py --json cpu.json -- python3 -m pytest -q tests/test_cluster.py

A process that lives less than one sampling interval is missed; one that exits between two samples loses the CPU
of its last interval. Processes that are not the command's (the rest of the machine) are counted too: run on a
quiet machine.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time


def _snapshot() -> dict:
    """{(pid, start tick): (cpu s, comm, cmdline)} for every process now."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()[:300]
        except OSError:
            continue
        rp = st.rindex(")")
        fields = st[rp + 2:].split()
        out[(pid, fields[19])] = ((int(fields[11]) + int(fields[12])) / hz, st[st.index("(") + 1:rp], cmd)
    return out


def kind(comm: str, cmd: str) -> str:
    """A process's kind: Ray workers by their actor or task name, pytest-xdist workers, other Python by script."""
    if comm.startswith("ray::"):
        return comm
    if "import sys;exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest-xdist worker"
    if "python" in comm or "python" in cmd.split(" ")[0]:
        parts = cmd.split(" ")
        return "python " + " ".join(os.path.basename(p) for p in parts[1:3])[:60]
    return comm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write every process's row (pid, CPU s, comm, cmdline) here")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    first = {k: v[0] for k, v in _snapshot().items()}  # what existed before: only its growth counts
    last: dict = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k, v in _snapshot().items():
                prev = last.get(k)
                last[k] = (v[0], v[1], v[2] or (prev[2] if prev else ""))
            time.sleep(0.25)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    time.sleep(0.5)
    done.set()
    t.join()
    me = str(os.getpid())
    rows = [(pid, cpu - first.get((pid, start), 0.0), comm, c) for (pid, start), (cpu, comm, c) in last.items()
            if pid != me]
    rows = [r for r in rows if r[1] > 0]
    by, n = collections.Counter(), collections.Counter()
    for _, cpu, comm, c in rows:
        by[kind(comm, c)] += cpu
        n[kind(comm, c)] += 1
    total = sum(by.values())
    print(f"\n{total:.1f} CPU-s in {wall:.1f} s of wall time ({total / wall:.2f} cores busy); by kind:", file=sys.stderr)
    for k, v in by.most_common(args.top):
        print(f"{v:8.1f} s  {n[k]:4d}  {k}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"pid": p, "cpu_s": round(c, 2), "comm": m, "cmdline": x} for p, c, m, x in rows], f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
