#!/usr/bin/env bash
# The GPU checks in one go, as run on a lent H100 (the device tool, 600 s a call): what "same seed, same table" means
# on CUDA (benchmarks/gpu_numerics.py), where a client step's time goes (benchmarks/gpu_profile.py), the GPU-first
# throughput figures (benchmarks/gpu.py) and the GPU tests (tests/test_gpu.py) with the non-Ray tests (CUDA hidden by
# conftest). Wheels that machine lacks (Ray, Optuna, mlxtend, ...) travel in .whl/. Results go to $OUT (the device
# tool's folder), or ./gpu_out. The step limits add up to 480 s; the exit status is the first failing step's.
#   bash benchmarks/gpu_check.sh            # RAYSIM_GPU_SKIP_INSTALL=1 where everything is installed already
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-20}; CLIENTS=${CLIENTS:-1000}; COHORT=${COHORT:-50}; GROUNDS=${GROUNDS:-4}
if [ -z "${RAYSIM_GPU_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "Model name|^CPU\(s\)";
  python3 -c "import torch, ray, numpy; print('torch', torch.__version__, 'ray', ray.__version__, 'numpy', numpy.__version__)"
} > "$OUT/env.txt" 2>&1
status=0
step() {  # step NAME LIMIT_S LOG CMD...: run one check under its limit, log its status and time
  local name=$1 limit=$2 log=$3; shift 3
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
  [ "$status" -eq 0 ] && [ "$rc" -ne 0 ] && status=$rc
  return 0
}
# first the figures the issues ask for: raysim's rows beside the plain-PyTorch twins in one sitting (benchmarks/twin.py:
# the hand-written per-client loop, the cohort as one vmap at 50 / 200 / 1,000), then the CUDA tests and the rest
step gpu.py 200 gpu.log python3 benchmarks/gpu.py --clients "$CLIENTS" --cohort "$COHORT" --rounds "$GROUNDS" \
  --json "$OUT/gpu.json"
step "pytest -m gpu" 60 pytest_gpu.log env RAYSIM_TEST_CUDA=1 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider \
  tests/test_gpu.py
step numerics 80 numerics.log python3 benchmarks/gpu_numerics.py --rounds "$ROUNDS" --out /tmp/gpu_numerics
cp /tmp/gpu_numerics/summary.json "$OUT/numerics_summary.json" 2>/dev/null
step gpu_profile 60 gpu_profile.log python3 benchmarks/gpu_profile.py --json "$OUT/gpu_profile.json"
step pytest 80 pytest.log python3 -m pytest -q -n 14 --tb=no -rf -m "not ray and not cluster" -p no:cacheprovider \
  --durations 5 tests
cat "$OUT/env.txt"
exit "$status"
