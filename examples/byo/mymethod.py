"""A researcher's own method: FedAvg whose server takes the plain (unweighted) mean of the client models.

``algorithm.name: mymethod:UniformAvg``. It reuses FedAvg's client step and overrides the aggregation only.
"""
from algorithms.fedavg import FedAvg
from raysim.shared_maths import weighted_average_states


class UniformAvg(FedAvg):
    name = "uniform_avg"
    paper = "FedAvg with an unweighted server mean (example)"
    needs_embedding = False  # logits and whole state dicts only

    def aggregate(self, server_state, uploads, ctx):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        states = [uploads[i]["model"].tensors for i in ids]
        return {"model": weighted_average_states(states, [1.0] * len(ids))}, {"clients_averaged": float(len(ids))}
