"""FedTGP with margin threshold TAU in the figure 5a setting (30 rounds) for one SEED:
    python benchmarks/protofam_tgp_tau30.py TAU SEED"""
import sys, torch
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
import protofam_fig_a as fa
from raysim.config import make_config
from raysim.driver import run_experiment
tau, seed = float(sys.argv[1]), int(sys.argv[2])
class A: rounds=30; samples=200; eval_every=5
a, p = fa.methods(100, 10.0)["FedTGP"]
p = dict(p, margin_threshold=tau)
r = run_experiment(make_config(fa.config("FedTGP", a, p, seed, A)), write=False, progress=False)
d = r.table
m = d[(d.scope == "wmean") & (d.metric == "test_acc_proto")]["value"].tolist()
c = d[(d.scope == "wmean") & (d.metric == "test_acc")]["value"].tolist()
print("tau", tau, "seed", seed, "final", round(m[-1], 4), "best", round(max(m), 4), "classifier_final", round(c[-1], 4), flush=True)
