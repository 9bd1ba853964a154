"""FedTGP margin threshold tau vs the divergence seen at tau = 100 (figure 5a setting, seed 3, 60 rounds).
    python benchmarks/protofam_tgp_tau.py TAU"""
import sys, time, torch
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
import protofam_fig_a as fa
from raysim.config import make_config
from raysim.driver import run_experiment
tau = float(sys.argv[1])
class A: rounds=60; samples=200; eval_every=5
a, p = fa.methods(100, 10.0)["FedTGP"]
p = dict(p, margin_threshold=tau)
t = time.time()
r = run_experiment(make_config(fa.config("FedTGP", a, p, 3, A)), write=False, progress=False)
d = r.table
m = d[(d.scope == "wmean") & (d.metric == "test_acc_proto")][["round", "value"]]
print("tau", tau, "seconds", round(time.time() - t), m.round(4).values.tolist(), flush=True)
