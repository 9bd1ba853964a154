#!/usr/bin/env bash
# Run a command as on a CPU SLOWDOWN times slower than this one (issue 32: the test suite must stay under 6 minutes
# on the slowest 2-core machine, an AMD EPYC with AVX2 only, last measured 2.1x slower than an AVX-512 Xeon): the
# command and every process it starts (pytest-xdist workers, Ray, subprocesses) share a CFS quota of
# nproc / SLOWDOWN CPUs in a cgroup of their own (cgroup v1 or v2 cpu controller; needs root). A quota emulates
# a slower CPU for CPU-bound work; it does not emulate other cache or memory speeds, nor a quota the machine already
# has (nproc does not see one).
#   sudo bash benchmarks/slow_cpu.sh 2.1 python3 -m pytest --durations 20
set -eu
SLOWDOWN=$1; shift
CPUS=$(nproc)
PERIOD=100000
QUOTA=$(python3 -c "print(int($PERIOD * $CPUS / $SLOWDOWN))")
NAME=raysim-slow-$$
if [ -d /sys/fs/cgroup/cpu ]; then ROOT=/sys/fs/cgroup/cpu; V=1; else ROOT=/sys/fs/cgroup; V=2; fi
if [ ! -w "$ROOT" ]; then
  echo "slow_cpu: $ROOT is not writable: run as root on a machine whose cgroup cpu controller may be used" >&2; exit 2
fi
if [ "$V" = 2 ] && ! grep -qw cpu "$ROOT/cgroup.subtree_control" 2>/dev/null; then
  echo +cpu > "$ROOT/cgroup.subtree_control" 2>/dev/null || {
    echo "slow_cpu: the cgroup v2 cpu controller is not enabled in $ROOT/cgroup.subtree_control and cannot be" >&2; exit 2; }
fi
G=$ROOT/$NAME
mkdir "$G"
cleanup() {  # stop whatever the command left in the cgroup (Ray's daemons too), then remove it
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    procs=$(cat "$G/cgroup.procs" 2>/dev/null || true)
    [ -z "$procs" ] && break
    for p in $procs; do kill "$p" 2>/dev/null || true; done
    sleep 1
  done
  for p in $(cat "$G/cgroup.procs" 2>/dev/null || true); do kill -9 "$p" 2>/dev/null || true; done
  sleep 0.5
  rmdir "$G" 2>/dev/null || echo "slow_cpu: could not remove $G (processes left in it?)" >&2
}
trap cleanup EXIT
if [ "$V" = 1 ]; then
  echo $PERIOD > "$G/cpu.cfs_period_us"; echo "$QUOTA" > "$G/cpu.cfs_quota_us"
else
  echo "$QUOTA $PERIOD" > "$G/cpu.max"
fi
echo "slow_cpu: $CPUS CPUs / $SLOWDOWN = quota $QUOTA us per $PERIOD us ($G)" >&2
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$G" "$@"
