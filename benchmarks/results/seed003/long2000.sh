#!/bin/bash
# MAFML vs FedAvg matched at 2,000 iterations (alpha 10%), seed by seed, into the reproduce layout
cd /work/wt/mutual; export PYTHONPATH=$PWD OMP_NUM_THREADS=1
R=/work/runs/reproduce/table1_mafml_vs_fedavg_matched_2000
for s in 1 2 3; do
  for pair in "mafml:mafml-a-10" "fedavg_matched:fedavg-matched"; do
    c=${pair%%:*}; slug=${pair##*:}
    [ -f $R/$slug/seed$s/results.parquet ] && continue
    echo "$(date -u +%T) start $c seed $s"
    python -m raysim run configs/seed003_mafml/$c.yaml --set rounds=40 --set output.checkpoint_every=4 --seeds $s --no-progress --out $R/$slug
    echo "$(date -u +%T) done $c seed $s rc=$?"
  done
done
