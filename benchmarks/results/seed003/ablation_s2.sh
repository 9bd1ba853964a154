#!/bin/bash
# FedAvg budget ablation at 2,000 iterations, seed 2 (waits for the scaled Table 1 to finish: at most 2 processes)
cd /work/wt/mutual; export PYTHONPATH=$PWD OMP_NUM_THREADS=1
while kill -0 $(cat /work/runs/reproduce/logs/table1_scaled.pid) 2>/dev/null; do sleep 15; done
R=/work/runs/reproduce/table1_mafml_vs_fedavg_matched_2000
for r in 0.1 0.25 0.5; do
  slug=fedavg-${r/./-}x-budget
  echo "$(date -u +%T) start ratio $r -> $slug"
  python -m raysim run configs/seed003_mafml/fedavg_matched.yaml --set rounds=40 --set algorithm.params.bandwidth_ratio=$r --set output.checkpoint_every=4 --seeds 2 --no-progress --out $R/$slug
  echo "$(date -u +%T) done ratio $r rc=$?"
done
