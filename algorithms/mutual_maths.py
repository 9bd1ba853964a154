"""Shared maths of the mutual-learning family (MAFML, seed 003, and its baselines IND, AGG, FedMD, FML, FedKD).

* :func:`project_conflicting` — MAFML's conflict check and projection (seed definition 2, eq. 7);
* :func:`weighted_kl` — the accuracy-weighted KL term (eq. 3-4) of a student against its teachers' soft labels;
* :func:`domain_metrics` — the seed's §3.2 metrics of a node's model: BWT (its own domain's test split), FWT (every
  other domain's test split), ACC (all domains' test splits), read from ``ClientData.cross_test`` (built by
  ``data.local_split``); the validation view swaps in the validation splits, so the same call gives ``val_*``;
* small helpers over flat gradients and random batches.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from raysim import rng as rngmod
from raysim.training import device_accuracy, forward_all, make_optimizer, OptimizerSpec


def project_conflicting(g_pub: torch.Tensor, g_loc: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(g~, fired): when cos(g_pub, g_loc) < 0, g~ = g_pub - (g_loc . g_pub / ||g_loc||^2) g_loc (eq. 7: g_pub with
    its component along g_loc removed); otherwise g~ = g_pub. A zero g_loc never conflicts."""
    dot = torch.dot(g_pub, g_loc)
    nn2 = torch.dot(g_loc, g_loc)
    if float(dot) < 0.0 and float(nn2) > 0.0:  # cos < 0 <=> dot < 0 (both norms positive)
        return g_pub - (dot / nn2) * g_loc, True
    return g_pub, False


def weighted_kl(student_logits: list, teacher_probs: list, accs: list) -> torch.Tensor:
    """(1 / T) sum_j A_j KL(p_j || softmax(s_j)) over the T teachers j (eq. 3; T = N - 1 in the summed form), the KL
    of each batch averaged over its samples (``batchmean``): KL(p || q) = sum_c p_c (log p_c - log q_c)."""
    terms = [float(a) * F.kl_div(F.log_softmax(s, dim=1), p, reduction="batchmean")
             for s, p, a in zip(student_logits, teacher_probs, accs)]
    return torch.stack(terms).sum() / len(terms)


def flat_grad(model) -> torch.Tensor:
    """The model's parameter gradients as one vector (zeros for parameters without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def set_flat_grad(model, g: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = g[off:off + n].view_as(p).clone()
        off += n


def random_batch(n: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``min(batch_size, n)`` distinct indices in [0, n), drawn at random (one iteration's batch)."""
    return torch.randperm(n, generator=generator)[:batch_size]


def _acc(pred: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None):
    if mask is not None:
        pred, y = pred[mask], y[mask]
    return device_accuracy(pred, y)


def domain_metrics(model, data) -> dict:
    """``test_acc`` on the client's own test split, and with ``data.local_split`` the seed's metrics of the model:
    ``test_bwt`` (own domain's test split — the same samples as test_acc), ``test_fwt`` (the other domains'),
    ``test_acc_all`` (all domains'). Each value carries its sample count as weight."""
    logits, _ = forward_all(model, data.x_test)
    out = {"test_acc": _acc(logits.argmax(1), data.y_test)}
    if data.cross_test is not None:
        x, y, owner = data.cross_test
        pred = forward_all(model, x)[0].argmax(1)
        own = owner == data.client_id
        out.update({"test_bwt": _acc(pred, y, own), "test_fwt": _acc(pred, y, ~own), "test_acc_all": _acc(pred, y)})
    return out


def step_batches(n: int, cfg, generator: torch.Generator):
    """Index batches of one round in the order of the reference loop (raysim.training): shuffled epochs of
    ``cfg.batch_size``; exactly ``cfg.local_steps`` batches when set, else ``cfg.local_epochs`` epochs."""
    from raysim.training import minibatches

    limit = cfg.local_steps
    epochs = cfg.local_epochs if limit is None else -(-int(limit) * cfg.batch_size // max(n, 1)) + 1
    steps = 0
    for _ in range(epochs):
        for idx in minibatches(n, cfg.batch_size, generator):
            if limit is not None and steps >= limit:
                return
            steps += 1
            yield idx


class WarmClients:
    """Live (model, Adam optimiser) pairs of the clients a runner used last, kept across the steps and iterations of
    a round so that a step whose client state is the very one this cache produced last time skips loading it
    (``load_state_dict`` and the optimiser state's copies). States stay the source of truth: any other state (spilled
    and read back, restored from a checkpoint, the previous one after a failed step) is loaded as before, so the
    numbers are those of a fresh load. At most ``size`` clients (least recently used dropped).

    ``snapshot`` copies the live pair into a new state (the same values and layout as ``clone_state`` and
    ``optimizer_state``) from tensor lists cached once per model, and ``mode`` switches train/eval by setting the
    flags of the cached module list, both without walking the module tree on every step."""

    def __init__(self, task, size: int = 16):
        from collections import OrderedDict

        self.task, self.size, self._live = task, size, OrderedDict()

    def get(self, state: dict, ctx, lr: float):
        """(model, optimiser) holding ``state['model']`` / ``state['opt']`` (an Adam with learning rate ``lr``)."""
        from raysim.training import load_optimizer_state

        cid = ctx.client_id
        entry = self._live.pop(cid, None)
        if entry is None:
            with rngmod.keep_global_rng():  # building draws from the global RNG: leave it alone
                model = self.task.build_model(cid).to(ctx.device)
            opt = make_optimizer(model.parameters(), OptimizerSpec("adam", weight_decay=self.task.train.weight_decay), lr)
            entry = [model, opt, None, None, _Layout(model)]
        model, opt, weights, opt_state, _ = entry
        if state["model"] is not weights:
            model.load_state_dict(state["model"])
        if state["opt"] is not opt_state:
            opt.state.clear()
            load_optimizer_state(opt, model, state["opt"])
        opt.param_groups[0]["lr"] = lr
        entry[2] = entry[3] = None  # the live pair no longer matches any state until done() says so
        self._live[cid] = entry
        while len(self._live) > self.size:
            self._live.popitem(last=False)
        return model, opt

    def snapshot(self, ctx) -> tuple[dict, dict]:
        """Copies of the live model's state dict and of its optimiser's state, keyed as ``clone_state`` and
        ``optimizer_state`` key them."""
        model, opt, _, _, layout = self._live[ctx.client_id]
        weights = {k: v.detach().clone() for k, v in layout.entries}
        opt_state = {}
        for name, p in layout.params:
            st = opt.state.get(p)
            if st:
                opt_state[name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        return weights, opt_state

    def mode(self, ctx, training: bool) -> None:
        """``model.train(training)`` for the live model of ``ctx.client_id``."""
        model, layout = self._live[ctx.client_id][0], self._live[ctx.client_id][4]
        if layout.plain_modes:
            for m in layout.modules:  # what Module.train stores, without Module.__setattr__'s checks
                m.__dict__["training"] = training
        else:
            model.train(training)

    def done(self, ctx, new_state: dict) -> None:
        """The live pair of ``ctx.client_id`` now equals ``new_state`` (its model and opt entries, copies)."""
        entry = self._live.get(ctx.client_id)
        if entry is not None:
            entry[2], entry[3] = new_state["model"], new_state["opt"]


class _Layout:
    """A model's state-dict entries, named parameters and modules, listed once (the tensors are updated in place by
    training and ``load_state_dict``, so the lists stay valid for the model's life)."""

    def __init__(self, model: torch.nn.Module):
        self.entries = list(model.state_dict(keep_vars=True).items())
        self.params = list(model.named_parameters())
        self.modules = list(model.modules())
        # setting the flags directly is what Module.train does, unless a module overrides train()
        self.plain_modes = all(type(m).train is torch.nn.Module.train for m in self.modules)


def public_shares(task, ctx):
    """The public dataset on the runner's device (kept in the runner's cache, ``ctx.models``): x, y and each node's
    global indices."""

    def make():
        pub = task.public
        own = [torch.nonzero(pub.owner == i).flatten() for i in range(task.num_clients)]
        return pub.x.to(ctx.device), pub.y.to(ctx.device), own

    return ctx.models.get("public_shares", make)
