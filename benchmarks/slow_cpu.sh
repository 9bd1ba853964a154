#!/usr/bin/env bash
# Run a command as on a CPU SLOWDOWN times slower than this one (issue 32: the test suite must stay under 6 minutes
# on the slowest 2-core machine, an AMD EPYC with AVX2 only, last measured 2.1x slower than an AVX-512 Xeon): the
# command and every process it starts (pytest-xdist workers, Ray, subprocesses) share a CFS quota of
# nproc / SLOWDOWN CPUs in a cgroup of their own (cgroup v1 or v2 cpu controller; needs root). A quota emulates
# a slower CPU for CPU-bound work; it does not emulate other cache or memory speeds.
#   sudo bash benchmarks/slow_cpu.sh 2.1 python3 -m pytest --durations 20
set -eu
SLOWDOWN=$1; shift
CPUS=$(nproc)
PERIOD=100000
QUOTA=$(python3 -c "print(int($PERIOD * $CPUS / $SLOWDOWN))")
NAME=raysim-slow-$$
if [ -d /sys/fs/cgroup/cpu ]; then  # v1
  G=/sys/fs/cgroup/cpu/$NAME; mkdir "$G"
  echo $PERIOD > "$G/cpu.cfs_period_us"; echo "$QUOTA" > "$G/cpu.cfs_quota_us"
else  # v2
  G=/sys/fs/cgroup/$NAME; mkdir "$G"; echo "$QUOTA $PERIOD" > "$G/cpu.max"
fi
trap 'for p in $(cat "$G/cgroup.procs" 2>/dev/null); do kill "$p" 2>/dev/null || true; done; sleep 1; rmdir "$G" 2>/dev/null || true' EXIT
echo "slow_cpu: $CPUS CPUs / $SLOWDOWN = quota $QUOTA us per $PERIOD us ($G)" >&2
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$G" "$@"
