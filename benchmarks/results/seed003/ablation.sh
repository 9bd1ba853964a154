#!/bin/bash
# Record of how the FedAvg budget ablation at 2,000 iterations was run, one seed per call (seeds 1, 2, 3) while the
# scaled Table 1 ran beside it (at most 2 processes). `raysim reproduce table1_mafml_vs_fedavg_matched_2000` runs the
# same runs (they are in its manifest) and is the way to repeat it.
SEED=${1:?usage: ablation.sh SEED}
cd /work/wt/mutual; export PYTHONPATH=$PWD OMP_NUM_THREADS=1
while kill -0 $(cat /work/runs/reproduce/logs/table1_scaled.pid) 2>/dev/null; do sleep 15; done
R=/work/runs/reproduce/table1_mafml_vs_fedavg_matched_2000
for r in 0.5 0.25 0.1; do
  slug=fedavg-${r/./-}x-budget
  echo "$(date -u +%T) start ratio $r seed $SEED -> $slug"
  python -m raysim run configs/seed003_mafml/fedavg_matched.yaml --set rounds=40 --set algorithm.params.bandwidth_ratio=$r --set output.checkpoint_every=4 --seeds $SEED --no-progress --out $R/$slug
  echo "$(date -u +%T) done ratio $r seed $SEED rc=$?"
done
