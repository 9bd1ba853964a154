"""Fate-sharing for the local Ray cluster a driver starts with ``ray.init()``.

When the driver dies without ``ray.shutdown()`` (``kill -9``, OOM killer), Ray's own processes mostly follow, but not
all: measured with Ray 2.60 on Linux, after SIGKILL of a driver running the ray backend, the raylet, GCS and workers
were gone within a minute while ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` were still alive 60 s later
(they try to report the raylet's death to the dead GCS). This watchdog closes that gap.

``start()`` spawns ``python ray_watchdog.py DRIVER_PID`` (this file, as a plain script) in its own session, holding the read end of a pipe
whose write end only the driver holds. The watchdog records, every half second, the driver's descendants that are
Ray processes (with their start times, so a reused pid is never touched). When the pipe reaches EOF (the driver
closed it in ``stop()`` after ``ray.shutdown()``, or the driver died), it sends SIGTERM to every recorded process
still alive and their Ray children, then SIGKILL one second later, and exits.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, start time, command line) for every process readable under /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()  # fields after the command name: state, ppid, ...
        out[int(name)] = (int(rest[1]), rest[19], cmd)
    return out


def _is_ray(cmd: str) -> bool:
    return cmd.startswith("ray::") or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd


def _ray_descendants(root: int, table: dict) -> dict[int, str]:
    """pid -> start time of the Ray processes below ``root``."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, stack = {}, [root]
    while stack:
        for k in kids.get(stack.pop(), []):
            if _is_ray(table[k][2]):
                found[k] = table[k][1]
            stack.append(k)
    return found


def _signal_all(tracked: dict[int, str], sig: int) -> int:
    table = _table()
    alive = {pid: st for pid, st in tracked.items() if pid in table and table[pid][1] == st}
    for pid in list(alive):  # workers started after the last scan, below a tracked raylet
        alive.update(_ray_descendants(pid, table))
    for pid in alive:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return len(alive)


STATUS_ENV = "RAYSIM_WATCHDOG_STATUS"  # optional file: the pids tracked so far, rewritten after every scan


def _write_status(path: str, tracked: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(" ".join(str(p) for p in sorted(tracked)) + "\n")
    os.replace(tmp, path)


def watch(driver_pid: int, fd: int = 0) -> None:
    tracked: dict[int, str] = {}
    status = os.environ.get(STATUS_ENV)
    while True:
        tracked.update(_ray_descendants(driver_pid, _table()))
        if status:
            _write_status(status, tracked)
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready and not os.read(fd, 4096):
            break  # EOF: the driver is done or dead
    if _signal_all(tracked, signal.SIGTERM):
        time.sleep(1.0)
        _signal_all(tracked, signal.SIGKILL)


# -- driver side ---------------------------------------------------------------------------------------------------
_PIPES: dict[int, int] = {}  # watchdog pid -> write end of its pipe


def start() -> Optional[subprocess.Popen]:
    """Start a watchdog for this process's local Ray cluster (Linux only; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    r, w = os.pipe()  # both ends are non-inheritable: Ray's processes never hold the write end
    try:
        # run as a plain script: importing the raysim package (torch) would delay the first scan by seconds
        proc = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())], stdin=r,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
    _PIPES[proc.pid] = w
    return proc


def stop(proc: Optional[subprocess.Popen]) -> None:
    """After ``ray.shutdown()``: let the watchdog clean up whatever is left and exit."""
    if proc is None:
        return
    w = _PIPES.pop(proc.pid, None)
    if w is not None:
        os.close(w)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for the driver
    watch(int(sys.argv[1]))
