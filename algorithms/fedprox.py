"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020; reference §6.2).

FedAvg whose local objective adds a proximal term that keeps the local model near the round's global model:
CE + (mu / 2) * ||w - w_g||^2 (what PFLlib's perturbed gradient step computes). Server: FedAvg. mu must be tuned in
{0.001, 0.01, 0.1, 0.5, 1} (FedProx README); the project default is 0.01. The FedPU options of FedAvg apply too.
"""
from __future__ import annotations

from dataclasses import dataclass

from algorithms.fedavg import FedAvg
from algorithms.prototype_maths import proximal_term
from raysim.config import positive


class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"

    @dataclass(frozen=True)
    class Params(FedAvg.Params):
        mu: float = 0.01

        def check(self, path):
            super().check(path)
            positive(f"{path}.mu", self.mu, allow_zero=True)

    def objective(self, start):
        base = super().objective(start)
        mu = self.params.mu
        global_w = start.aux["global"]
        anchors = None

        def loss_fn(model, xb, yb, epoch):
            nonlocal anchors
            if anchors is None:  # the global weights, in the order of model.parameters()
                anchors = [_const(global_w[n].to(p.device)) for n, p in model.named_parameters()]
            loss, parts = base(model, xb, yb, epoch)
            prox = proximal_term(list(model.parameters()), anchors, mu)
            return loss + prox, {**parts, "prox": prox.detach()}

        return loss_fn


def _const(t):
    """``t`` outside autograd (a downloaded tensor already is: no detached alias made for nothing)."""
    return t.detach() if t.requires_grad else t
