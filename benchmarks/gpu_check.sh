#!/usr/bin/env bash
# The GPU checks in one go, as run on a lent H100 (the device tool): what "same seed, same table" means on CUDA
# (benchmarks/gpu_numerics.py), where a client step's time goes (benchmarks/gpu_profile.py), the GPU-first throughput
# figures (benchmarks/gpu.py) and the GPU tests (tests/test_gpu.py) with the non-Ray tests (CUDA hidden by conftest). Wheels that machine lacks (Ray, Optuna, mlxtend, ...) travel in .whl/.
# Results go to $OUT (the device tool's folder), or ./gpu_out.
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
t0=$(date +%s)
timeout 100 python3 benchmarks/gpu_numerics.py --rounds "$ROUNDS" --out /tmp/gpu_numerics > "$OUT/numerics.log" 2>&1
echo "numerics rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
cp /tmp/gpu_numerics/summary.json "$OUT/numerics_summary.json" 2>/dev/null
t0=$(date +%s)
timeout 120 python3 benchmarks/gpu_profile.py --json "$OUT/gpu_profile.json" > "$OUT/gpu_profile.log" 2>&1
echo "gpu_profile rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
t0=$(date +%s)
timeout 200 python3 benchmarks/gpu.py --clients "$CLIENTS" --cohort "$COHORT" --rounds "$GROUNDS" \
  --json "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1
echo "gpu.py rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
t0=$(date +%s)
RAYSIM_TEST_CUDA=1 timeout 60 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?" >> "$OUT/env.txt"
timeout 140 python3 -m pytest -q -n 14 --tb=no -rf -m "not ray and not cluster" -p no:cacheprovider --durations 5 tests \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
cat "$OUT/env.txt"
