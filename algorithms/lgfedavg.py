"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", NeurIPS 2020 workshop / arXiv 2001.01523), in the heterogeneous-model form of HtFLlib
(reference §6.4): the feature extractors (bodies) stay local and may differ between clients; the classifier heads,
which must have one shape across clients, are averaged with sample-count weights and pushed back.
"""
from __future__ import annotations

from algorithms.fedper import SharedPartAverage
from algorithms.prototype_maths import select_prefix
from raysim.errors import ConfigError
from raysim.training import clone_state


class LGFedAvg(SharedPartAverage):
    name = "lgfedavg"
    paper = ("Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, "
             "arXiv:2001.01523, 2020 (HtFLlib's heterogeneous form)")
    shared = "head"

    def validate(self):
        shapes = None
        for i in range(self.task.num_clients):
            head = select_prefix(clone_state(self.task.build_model(i)), "head.")
            s = {k: tuple(v.shape) for k, v in head.items()}
            if shapes is None:
                shapes = s
            elif s != shapes:
                raise ConfigError("model.per_client", f"LG-FedAvg averages the heads, so every architecture needs the "
                                                      f"same head; client {i} has {s}, client 0 has {shapes}")
