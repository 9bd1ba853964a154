"""Local training only (no communication): the lower bound every federated method must beat."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from algorithms.mutual_maths import domain_metrics
from raysim.algorithm import Context, LocalStart, LocalTraining
from raysim.messages import rows_of
from raysim.runner.grouped import group_test_accuracy
from raysim.training import clone_state


def ce_loss(model, xb, yb, epoch: int = 0):
    """Plain cross-entropy, a loss function of the training loops (the epoch does not enter it)."""
    return F.cross_entropy(model(xb), yb), {}


class Local(LocalTraining):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    uploads = frozenset()

    name = "local"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), "personalised")
    paper = "Baseline: each client trains alone on its own data."

    @dataclass(frozen=True)
    class Params:
        pass

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.task.build_model(ctx.client_id))}

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        return LocalStart(weights=state["model"])  # loaded by the executor (stacked for a vectorised group)

    def objective(self, start: LocalStart):
        return ce_loss

    def vectorizable(self, start: LocalStart) -> bool:
        return True  # plain cross-entropy: the same loss for every client

    def client_final(self, model, start, payload, state, data, ctx: Context):
        return {"model": clone_state(model)}, {}

    def client_final_group(self, group):
        """A vectorised group's new states: each its row of the trained stacks (no copy per client)."""
        if type(self).client_final is not Local.client_final:
            return None
        return [({"model": w}, {}) for w in rows_of(group.state_stacks())]

    def evaluate_group(self, payloads, states, datas, ctxs):
        """evaluate_client for clients of one architecture with test sets of one shape and no cross-domain tests:
        one grouped forward of every client's test set under its own weights. None: per client."""
        if type(self).evaluate_client is not Local.evaluate_client or any(d.cross_test is not None for d in datas):
            return None
        model = ctxs[0].model()
        if any(c.model() is not model for c in ctxs[1:]):
            return None
        accs = group_test_accuracy(model, [s["model"] for s in states], [d.x_test for d in datas],
                                   [d.y_test for d in datas])
        return None if accs is None else [{"test_acc": a} for a in accs]

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.load_state_dict(state["model"])
        # test_acc on the client's test split; with data.local_split also the seed-003 metrics bwt / fwt / acc_all
        return domain_metrics(model, data)
