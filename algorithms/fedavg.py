"""FedAvg (McMahan et al., AISTATS 2017): clients train the global model locally, the server averages the
uploaded weights with sample-count weights: w = sum_i (n_i / sum n) w_i.

Options ``positive_rate`` / ``pu_weight``: the FedPU positive-unlabelled setting and loss (algorithms/fedpu.py).

**Iteration mode** (``sync_every`` or ``bandwidth_ratio``; MAFML's seed 003 compares FedAvg at controlled
communication): a round is ``train.local_steps`` iterations, each one Adam/SGD step of every node on a random batch
of its ``x_train`` (``train.persist_optimizer`` keeps the optimiser state on the node); the nodes average every k
iterations (global iteration g = round * local_steps + iteration, 0-based; an average after the step of every g with
(g + 1) % k == 0: weights up, the average down). Schedule per iteration: ``local`` (the step; uploads only on an
averaging iteration), ``average`` (server), ``receive`` (a node loads the average when one was made); a setup step
``start`` downloads the initial global model once (accounted at round -1). Evaluation (``eval_model``): ``global``
(default) tests the last average each node received — one model, as the seed's FedAvg row (one ACC for every node);
``local`` tests each node's current weights.

k is ``sync_every``, or with ``bandwidth_ratio`` r > 0 derived from the budget: the smallest k whose accounted
floats over the run, N*P (the initial download) + floor(T/k) * 2*N*P (each average: N*P up, N*P down; P = floats of
the model's state dict), stay within r x MAFML's floats in the same task, r * T * m, where T = rounds * local_steps
and m = MAFML's accounted floats per iteration with public batch ``train.batch_size``
(:func:`algorithms.mafml.floats_per_iteration`: N^2 (B*C + 1)). LeNet on Rotated MNIST (N = 4, P = 61,706, B = 32,
C = 10): m = 5,136, one average = 493,648 floats (96.1 x m); r = 1 gives k = 97 over 10,000 iterations (total
0.995 x MAFML's), r = 100 (the seed's PACS cap) gives k = 1. k depends on ``rounds``: a resume that changes
``rounds`` changes k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import torch
import torch.nn.functional as F

from algorithms import fedpu
from algorithms.local import ce_loss
from algorithms.mutual_maths import domain_metrics, random_batch
from raysim import rng as rngmod
from raysim.algorithm import (Asynchronous, ClientUpdate, Context, LocalStart, LocalTraining, ServerUpdate,
                              inert_switches)
from raysim.errors import ConfigError
from raysim.messages import Message, payload_sizes, rows_of, stacked_segments, state_message
from raysim.models import live_state, load_live
from raysim.shared_maths import rebase_trees, weighted_average_states
from raysim.steps import ALL, ClientStep, Repeat, ServerStep
from raysim.training import (accuracy, clone_state, forward_all, group_accuracies, make_optimizer,
                             optimizer_state)


def sample_counts(uploads, ids) -> list[int]:
    """n_i of each upload's ``num_samples`` message (FedAvg's weights), in ``ids`` order."""
    return [int(uploads[i]["num_samples"]["n"][0]) for i in ids]


def sample_count_tensor(uploads, ids) -> torch.Tensor:
    """n_i of each upload's ``num_samples`` message as one int64 tensor, in ``ids`` order (nothing read)."""
    segments = stacked_segments([uploads[i]["num_samples"].tensors for i in ids])
    if segments is not None and len(segments) <= max(1, len(ids) // 4):  # vectorised groups' counts, stacked
        parts = []
        for stacks, rows in segments:
            n = stacks["n"].reshape(stacks["n"].shape[0], -1)[:, 0]
            parts.append(n if rows == list(range(n.shape[0])) else n[torch.as_tensor(rows)])
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    counts = [uploads[i]["num_samples"]["n"].reshape(-1)[:1] for i in ids]
    return torch.cat(counts) if len(counts) > 1 else counts[0]


def model_uploads(group) -> list:
    """A vectorised group's (state, upload) pairs when each client uploads its trained model and its sample count
    (FedAvg's ``client_final``, VHL's): every upload holds its row of the trained stacks (the group's uploads stay
    stacked until the partial aggregate reduces them), the sample counts one stacked tensor."""
    counts = torch.tensor([[d.num_train] for d in group.datas], dtype=torch.int64)
    return [(state, {"model": Message("weights", w), "num_samples": Message("num_samples", n)})
            for state, w, n in zip(group.states, rows_of(group.state_stacks()), rows_of({"n": counts}))]


def sample_weighted_average(uploads, ids, key: str = "model") -> dict:
    """FedAvg's rule over the state messages ``uploads[i][key]``: sum_i (n_i / sum n) w_i."""
    return weighted_average_states([uploads[i][key].tensors for i in ids], sample_count_tensor(uploads, ids))


def rebase_state_upload(upload: dict, key: str, base_state: dict, server_state: dict) -> dict:
    """FedBuff from the dispatch version (server.mode: async): the state message ``upload[key]`` moved by the
    current state minus the dispatch version's (``raysim.shared_maths.rebase_trees``), so the weighted mean the
    aggregate takes is the current state plus the weighted mean of the clients' deltas."""
    if key not in upload or key not in base_state or key not in server_state:
        return upload
    m = upload[key]
    return {**upload, key: Message(m.kind, rebase_trees(dict(m.tensors), base_state[key], server_state[key]), m.meta)}


def merge_sample_weighted(uploads: dict, key: str = "model") -> dict:
    """A partial aggregate of FedAvg's rule: the uploads' sample-weighted average under ``key`` with the summed
    sample count, itself an upload of the same form (the weighted average of such partials, weighted by their
    counts, is the weighted average of all: sum_j N_j (sum_{i in j} n_i w_i / N_j) / N)."""
    ids = sorted(uploads)
    first = uploads[ids[0]][key]
    n = sample_count_tensor(uploads, ids).sum().reshape(1).to(torch.int64)
    return {key: Message(first.kind, sample_weighted_average(uploads, ids, key), first.meta),
            "num_samples": Message("num_samples", {"n": n})}


class FedAvg(Asynchronous, LocalTraining):
    needs_embedding = False  # logits and whole state dicts only: any user model will do
    uploads = frozenset({"weights", "num_samples"})

    name = "fedavg"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        # iteration mode (sync_every or bandwidth_ratio) with eval_model: local tests each node's own weights
        iterations = bool(cls._param(params, "sync_every") or cls._param(params, "bandwidth_ratio"))
        own = iterations and cls._param(params, "eval_model") == "local"
        kind = "personalised" if own else "global"
        return {**dict.fromkeys(("test_acc", "test_bwt", "test_fwt", "test_acc_all"), kind), "global_test_acc": "global"}
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"

    @dataclass(frozen=True)
    class Params(fedpu.PUParams):  # FedPU's options (positive_rate, pu_weight, ...) + the iteration mode's
        sync_every: int = 0  # iteration mode: average every k iterations (train.local_steps per round); 0: classic
        bandwidth_ratio: float = 0.0  # iteration mode: k from a budget of this many times MAFML's floats (1: matched)
        eval_model: str = "global"  # iteration mode: test the last average (global) or each node's weights (local)

        def check(self, path):
            super().check(path)
            if int(self.sync_every) != self.sync_every or self.sync_every < 0:
                raise ConfigError(f"{path}.sync_every", f"must be an integer >= 0 (0: classic rounds), got "
                                                        f"{self.sync_every!r}")
            if not math.isfinite(self.bandwidth_ratio) or self.bandwidth_ratio < 0:
                raise ConfigError(f"{path}.bandwidth_ratio", f"must be >= 0 (0: off), got {self.bandwidth_ratio!r}")
            if self.sync_every and self.bandwidth_ratio:
                raise ConfigError(f"{path}.bandwidth_ratio", "set sync_every or bandwidth_ratio, not both")
            if self.eval_model not in ("global", "local"):
                raise ConfigError(f"{path}.eval_model", f"{self.eval_model!r} is not allowed; choose one of: global, "
                                                        f"local")

    @property
    def iteration_mode(self) -> bool:
        # methods built on FedAvg (SCAFFOLD, MOON, FedGen, ...) have their own Params without the iteration mode
        return bool(getattr(self.params, "sync_every", 0) or getattr(self.params, "bandwidth_ratio", 0))

    def validate(self):
        self.require_homogeneous()
        if not self.iteration_mode:
            return
        where = "algorithm.params.sync_every" if self.params.sync_every else "algorithm.params.bandwidth_ratio"
        if not self.task.train.local_steps:
            raise ConfigError("train.local_steps", f"{where} counts iterations: set train.local_steps (the iterations "
                                                   f"per round, e.g. 50 as MAFML's seed validates every 50)")
        if self.params.positive_rate < 1.0:
            raise ConfigError(where, "the iteration mode trains with plain cross-entropy; FedPU's positive_rate < 1 "
                                     "needs classic rounds (sync_every: 0)")
        self.sync_period  # the budget must allow one average at least

    # -- iteration mode: an average every k iterations ----------------------------------------------------------
    def model_floats(self) -> int:
        """P: the floats one node's weights message carries, as the accounting counts them."""
        with rngmod.keep_global_rng():
            model = self.task.build_model(0)
        return payload_sizes({"m": state_message("weights", model.state_dict(keep_vars=True))})["weights"][0]

    @cached_property
    def sync_period(self) -> int:
        """k: ``sync_every``, or the smallest k whose floats over the run stay within the ``bandwidth_ratio`` budget
        (module docstring)."""
        if self.params.sync_every:
            return int(self.params.sync_every)
        from algorithms.mafml import floats_per_iteration

        return budget_sync_period(self.task.num_clients, self.model_floats(),
                                  floats_per_iteration(self.task.num_clients, self.task.num_classes,
                                                       self.task.train.batch_size),
                                  self.task.rounds * int(self.task.train.local_steps), self.params.bandwidth_ratio)

    def _due(self, round_idx: int, iteration: int) -> bool:
        g = round_idx * int(self.task.train.local_steps) + iteration
        return (g + 1) % self.sync_period == 0

    @classmethod
    def settings_without_effect(cls, env: bool) -> tuple[str, ...]:
        # the iteration mode's server steps declare no merge: only the classic round's merge may apply
        return inert_switches(cls, env, classic=True)

    def schedule(self):
        if not self.iteration_mode:
            return super().schedule()
        return (Repeat(int(self.task.train.local_steps),
                       (ClientStep("local", fn="step_local"), ServerStep("average", fn="average_due"),
                        ClientStep("receive", fn="receive"))),)

    def setup_schedule(self):
        if not self.iteration_mode:
            return None
        return (ServerStep("share", fn="share"), ClientStep("start", fn="receive", clients=ALL))

    def downlink(self, payload, client_id, ctx=None):
        if not self.iteration_mode or ctx is None or ctx.step in ("start", "receive"):
            return payload
        return {}  # the local step and the evaluation download nothing: the node holds its weights

    def share(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        return ServerUpdate(server_state, self.broadcast(server_state, ctx))

    def receive(self, payload, state, data, ctx: Context) -> ClientUpdate:
        if "model" not in payload:
            return ClientUpdate(state, {}, {})
        w = dict(payload["model"].tensors)
        return ClientUpdate({"opt": {}, **(state or {}), "model": w, "global": w}, {}, {})

    def step_local(self, payload, state, data, ctx: Context) -> ClientUpdate:
        from raysim.models import set_dropout_generator

        cfg = self.task.train
        model = ctx.model()
        model.load_state_dict(state["model"])
        opt = make_optimizer(model.parameters(), cfg, state=state["opt"] if cfg.persist_optimizer else None,
                             model=model)
        idx = random_batch(data.num_train, cfg.batch_size, ctx.generator("batches")).to(data.y_train.device)
        set_dropout_generator(model, ctx.generator("dropout", device=ctx.device))
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        opt.step()
        upload = {}
        if self._due(ctx.round_idx, ctx.iteration):
            upload = {"model": state_message("weights", model.state_dict(keep_vars=True)),
                      "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        new = {"model": clone_state(model), "opt": optimizer_state(opt, model) if cfg.persist_optimizer else {},
               "global": state["global"]}
        return ClientUpdate(new, upload, {"train_loss": float(loss.detach())})

    def average_due(self, server_state, uploads, ctx: Context) -> ServerUpdate:
        ids = [i for i in sorted(uploads) if uploads[i]]
        if not self._due(ctx.round_idx, ctx.iteration) or not ids:
            return ServerUpdate(server_state, {}, {})
        new = {"model": sample_weighted_average(uploads, ids)}
        return ServerUpdate(new, self.broadcast(new, ctx), {})

    def init_server_state(self, ctx: Context):
        return {"model": clone_state(self.build_global_model())}

    def build_global_model(self):
        """A fresh global model (its initial weights: the server's first state)."""
        return self.task.build_model(0)

    def broadcast(self, server_state, ctx: Context):
        return {"model": state_message("weights", server_state["model"])}

    def pu_view(self, data):
        return fedpu.make_view(data, self.task.num_classes, self.task.seed, self.params)

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        view = self.pu_view(data)
        # unlabelled samples carry UNLABELLED, not their label; the global weights are the start (loaded by the
        # executor: LocalStart.weights)
        return LocalStart(y=None if view is None else view.y_obs, aux={"view": view, "global": payload["model"].tensors},
                          weights=payload["model"].tensors)

    def objective(self, start: LocalStart):
        view = start.aux["view"]
        return ce_loss if view is None else fedpu.pu_ce_loss(view, self.params.pu_weight)

    def vectorizable(self, start: LocalStart) -> bool:
        return start.aux["view"] is None  # FedPU's view is per client (its own prior and positive classes)

    def client_final(self, model, start, payload, state, data, ctx: Context):
        upload = {"model": state_message("weights", live_state(model)),  # model.state_dict(keep_vars=True)
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        return state, upload

    def client_final_group(self, group):
        """client_final for a vectorised group: every upload holds its row of the trained stacks (the group's uploads
        stay stacked until the partial aggregate reduces them), the sample counts one stacked tensor."""
        if type(self).client_final is not FedAvg.client_final:
            return None  # a subclass sends something else
        return model_uploads(group)

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        return {"model": sample_weighted_average(uploads, ids)}, {}

    def merge_uploads(self, uploads):
        return merge_sample_weighted(uploads) if uploads else None

    def async_rebase(self, upload, base_state, server_state, ctx):
        return rebase_state_upload(upload, "model", base_state, server_state)

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = self.live_model(ctx)
        if self.iteration_mode:
            model.load_state_dict(state["global" if self.params.eval_model == "global" else "model"])
        else:
            load_live(model, payload["model"].tensors)  # model.load_state_dict, lighter (raysim.modelstate)
        # test_acc on the client's test split; with data.local_split also the seed-003 metrics bwt / fwt / acc_all
        return domain_metrics(model, data)

    def evaluate_group(self, payloads, states, datas, ctxs):
        """evaluate_client for clients that test one global model (classic rounds, no cross-domain tests): one
        forward of their test sets concatenated, each client's accuracy from its own segment
        (:func:`raysim.training.group_accuracies`). None: evaluate_client per client."""
        if self.iteration_mode or type(self).evaluate_client is not FedAvg.evaluate_client:
            return None
        first = payloads[0]["model"].tensors
        if any(p["model"].tensors is not first for p in payloads) or any(d.cross_test is not None for d in datas):
            return None
        model = self.live_model(ctxs[0])
        model.load_state_dict(first)
        accs = group_accuracies(model, [d.x_test for d in datas], [d.y_test for d in datas])
        return [{"test_acc": a} for a in accs]

    def global_model(self, ctx: Context):
        """The runner's live module of the global model (the server's evaluation)."""
        return ctx.model(0)

    def evaluate_server(self, server_state, test, ctx: Context) -> dict:
        model = self.global_model(ctx)
        model.load_state_dict(server_state["model"])
        logits, _ = forward_all(model, test.x.to(ctx.device))
        out = {"global_test_acc": accuracy(logits.argmax(1), test.y.to(ctx.device))}
        if self.iteration_mode:
            out["sync_every"] = float(self.sync_period)
        return out


def budget_sync_period(num_clients: int, model_floats: int, reference_per_iteration: int, iterations: int,
                       ratio: float) -> int:
    """The smallest k >= 1 with N*P + floor(T/k) * 2*N*P <= ratio * T * m (FedAvg's accounted floats over T
    iterations, averaging every k, within ``ratio`` times the reference's m floats per iteration)."""
    n, p, t = int(num_clients), int(model_floats), int(iterations)
    budget = Fraction(repr(float(ratio))) * t * int(reference_per_iteration)
    syncs = math.floor((budget - n * p) / (2 * n * p))  # the most averages the budget pays for
    if syncs < 1:
        raise ConfigError("algorithm.params.bandwidth_ratio",
                          f"a budget of {float(ratio)} x {int(reference_per_iteration)} floats per iteration over {t} "
                          f"iterations ({float(budget):.0f} floats) pays for no average of {n} x {p}-float models "
                          f"({n * p} floats to start, {2 * n * p} per average); raise the ratio or the rounds")
    return t // (syncs + 1) + 1
