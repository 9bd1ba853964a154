#!/usr/bin/env bash
# Where MAFML's time goes on a lent GPU (after device_reproduce.sh found 17 s/round with 16 processes sharing one H100,
# IND 1.0 s/round): one process alone, per-node loop vs the grouped (vectorised) executor, then 4 processes at once.
# Per run: its whole wall time (setup included; rounds=R) and the last seconds per round of 50 iterations that tqdm
# printed. Measured on an H100 (2026-11-27): benchmarks/results/gpu/mafml_probe_h100.txt.
#   bash benchmarks/device_mafml_probe.sh        # DEVICE=cpu R=1 for a dry run here
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"; DEVICE=${DEVICE:-cuda}; R=${R:-4}
if [ -z "${RAYSIM_SKIP_INSTALL:-}" ] && ls .whl/mlxtend-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/mlxtend-*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
one() {  # one LABEL CONFIG [--set ...]: a run's wall seconds and its s/round as tqdm saw it
  local label=$1 cfg=$2; shift 2
  local t0; t0=$(date +%s.%N)
  timeout 100 python3 -m raysim run "$cfg" --set "backend.device=$DEVICE" --set "rounds=$R" "$@" --out "/tmp/probe_$label" \
    > "/tmp/probe_$label.log" 2>&1
  local rc=$?
  echo "$label rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))") s $(grep -o '[0-9.]*s/round' "/tmp/probe_$label.log" | tail -1)" | tee -a "$OUT/probe.txt"
}
C=configs/seed003_mafml
one mafml_loop $C/mafml.yaml
one mafml_vec $C/mafml.yaml --set backend.vectorize=true
one ind_loop $C/ind.yaml
for k in 1 2 3 4; do one "mafml_x4_$k" $C/mafml.yaml --set seed=$k & done; wait
tail -3 /tmp/probe_mafml_vec.log | cut -c1-300 | tee -a "$OUT/probe.txt"
