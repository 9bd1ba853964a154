"""FedTGP divergence diagnosis (figure 5a setting, seed 3, 50 rounds): per-round server margin/loss and the largest
client training loss. Run: PYTHONPATH=$PWD nice -n 10 python benchmarks/protofam_tgp_diag.py"""
import sys, torch
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
import protofam_fig_a as fa
from raysim.config import make_config
from raysim.driver import run_experiment
class A: rounds=50; samples=200; eval_every=5
a, p = fa.methods(100, 10.0)["FedTGP"]
r = run_experiment(make_config(fa.config("FedTGP", a, p, 3, A)), write=False, progress=False)
d = r.table
s = d[d.scope == "server"].pivot(index="round", columns="metric", values="value")
tl = d[(d.scope == "client") & (d.metric.isin(["train_loss", "train_proto"]))].groupby(["round", "metric"])["value"].agg(lambda v: float(v.abs().max())).unstack()
print(s.join(tl).round(3).to_string())
