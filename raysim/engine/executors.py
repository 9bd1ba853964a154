"""Executors: the ways a client runner runs a client step for its hosted clients, as objects behind one interface
(:class:`Executor`). A runner holds a chain of them, chosen once from the run's settings (:func:`executor_chain`);
a step goes to the first that takes it (``run`` returns None to pass it on):

* :class:`GroupForm` — a method's group form of the step (``<fn>_group(payloads, states, datas, ctxs)``, MAFML's);
* :class:`Vectorized` — local training of ``LocalTraining`` methods batched per architecture
  (:mod:`raysim.engine.vectorized`: the grouped network of :mod:`raysim.grouped` where the model has one, else
  ``torch.func.vmap``);
* :class:`Loop` — one client after another (always last: it takes every step).

Each keeps the per-client loop's contract: each client's report, staged state and upload, and its own failure. They
read the runner's parts (``algorithm``, ``spec``, ``_ctx``, ``state``, ``_data``, ``_finish_update``, ``_fail``)
and hold no client state of their own."""
from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from raysim import rng as rngmod
from raysim.algorithm import ClientUpdate, LocalTraining
from raysim.engine.reports import ClientReport, step_purpose as _purpose, step_token
from raysim.engine.vectorized import Member, check_model, vmap_local_sgd
from raysim.errors import DamagedFileError
from raysim.messages import payload_sizes
from raysim.steps import ClientStep


class Executor(ABC):
    """One way of running a client step. ``run`` returns (uploads by client, reports in ``client_ids`` order), or
    None when it does not take this step (the next executor of the chain runs it)."""

    name = "executor"

    @abstractmethod
    def run(self, r, step: ClientStep, payload, round_idx: int, iteration: int,
            client_ids: list[int]) -> Optional[tuple[dict, list[ClientReport]]]:
        """Run ``step`` for ``client_ids`` on runner ``r``, or return None to pass it on."""


class GroupForm(Executor):
    """``backend.vectorize``: a training step whose method has a group form, for two clients or more."""

    name = "group_form"

    def __init__(self):
        self._warned: set = set()  # group forms that failed once (warned)

    def run(self, r, step: ClientStep, payload, round_idx: int, iteration: int,
            client_ids: list[int]) -> Optional[tuple[dict, list[ClientReport]]]:
        """``backend.vectorize`` for a step whose method has a group form (``<fn>_group(payloads, states, datas,
        ctxs)``, the contract in the comment after :meth:`raysim.algorithm.Algorithm.evaluate_client`): one call for
        the hosted clients of the step. The group form returns None when it cannot take this group (the per-client
        loop runs instead); if it raises, the per-client loop runs too (warned once per step), so a failing client
        fails alone and with its own error. A result that is not one ClientUpdate per client is the method's bug: a
        TypeError naming it."""
        if step.mode == "evaluate" or len(client_ids) < 2 or getattr(r.algorithm, f"{step.method}_group", None) is None:
            return None
        t0 = time.perf_counter()
        name = f"{type(r.algorithm).__name__}.{step.method}_group"
        try:
            ctxs = [r._ctx(round_idx, cid, step.name, iteration) for cid in client_ids]
            downs = [r.algorithm.downlink(payload, cid, ctx) for cid, ctx in zip(client_ids, ctxs)]
            states = [r.state(cid) for cid in client_ids]
            datas = [r._data(cid) for cid in client_ids]
            results = getattr(r.algorithm, f"{step.method}_group")(downs, states, datas, ctxs)
        except DamagedFileError:
            raise
        except Exception as e:
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"{name} failed ({type(e).__name__}: {e}); its clients run the per-client steps",
                              RuntimeWarning, stacklevel=2)
            return None
        if results is None:
            return None
        if (not isinstance(results, (list, tuple)) or len(results) != len(client_ids)
                or not all(isinstance(u, ClientUpdate) for u in results)):
            raise TypeError(f"{name} must return None or one ClientUpdate per client ({len(client_ids)}), got "
                            f"{type(results).__name__}"
                            f"{f' of {len(results)}' if isinstance(results, (list, tuple)) else ''}")
        token = step_token(round_idx, step, iteration)
        share = (time.perf_counter() - t0) / len(client_ids)
        uploads, reports = {}, []
        for cid, down, res in zip(client_ids, downs, results):
            rep = ClientReport(cid, round_idx, step.name, iteration=iteration)
            rep.down = payload_sizes(down)
            try:
                r._finish_update(rep, cid, res, token, uploads)
            except Exception as e:
                r._fail(rep, cid, e, uploads)
            rep.seconds = share
            reports.append(rep)
        return uploads, reports


@dataclass
class _Pending:
    """A client whose local training waits for its architecture's batched computation."""

    ctx: object
    down: dict
    state: object
    data: object
    start: object
    params: dict
    opt_state: Optional[dict]


@dataclass
class _VectorStep:
    """One vectorised client step's bookkeeping: every client's report, the uploads so far, the clients waiting for
    their architecture's batched training (grouped by live model)."""

    token: str
    reports: dict = field(default_factory=dict)
    uploads: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)


class Vectorized(Executor):
    """``backend.vectorize``: the local training step (``client_update``) of a ``LocalTraining`` method:
    ``client_init`` per client, the local training of every client whose method opts in (``vectorizable``) batched
    per architecture (:mod:`raysim.engine.vectorized`), ``client_final`` per client; every client keeps its own
    failure guard. Clients that do not opt in run the per-client loop."""

    name = "vectorized"

    def run(self, r, step: ClientStep, payload, round_idx: int, iteration: int,
            client_ids: list[int]) -> Optional[tuple[dict, list[ClientReport]]]:
        if step.mode == "evaluate" or step.method != "client_update" or not isinstance(r.algorithm, LocalTraining):
            return None
        vs = _VectorStep(step_token(round_idx, step, iteration))
        for cid in client_ids:
            t0 = time.perf_counter()
            rep = vs.reports[cid] = ClientReport(cid, round_idx, step.name, iteration=iteration)
            try:
                self._start(r, vs, step, payload, (round_idx, iteration), cid)
            except Exception as e:
                r._fail(rep, cid, e, vs.uploads)
                vs.pending.pop(cid, None)
            rep.seconds += time.perf_counter() - t0
        for model, cids in vs.groups.values():
            cids = [c for c in cids if c in vs.pending]
            if cids:
                self._train(r, vs, model, cids)
        return vs.uploads, [vs.reports[c] for c in client_ids]

    @staticmethod
    def _start(r, vs: _VectorStep, step: ClientStep, payload, when: tuple, cid: int) -> None:
        """``client_init`` for one client: it joins its architecture's group, or runs the per-client loop."""
        alg, cfg = r.algorithm, r.spec.task.train
        round_idx, iteration = when
        ctx = r._ctx(round_idx, cid, step.name, iteration)
        down = alg.downlink(payload, cid, ctx)
        vs.reports[cid].down = payload_sizes(down)
        state = r.state(cid)
        data = r._data(cid)
        rngmod.seed_torch_global(r.spec.runner.seed, round_idx, cid, _purpose(step, iteration))
        model = alg.live_model(ctx)
        start = alg.client_init(model, down, state, data, ctx)
        if alg.vectorizable(start):
            check_model(model)
            with torch.no_grad():  # the client's starting weights (the live model is reloaded for the next client)
                params = {n: p.clone() for n, p in model.named_parameters()}
            opt_state = (state or {}).get("opt") if cfg.persist_optimizer else None
            vs.pending[cid] = _Pending(ctx, down, state, data, start, params, opt_state)
            vs.groups.setdefault(id(model), (model, []))[1].append(cid)
        else:
            rngmod.seed_torch_global(r.spec.runner.seed, round_idx, cid, _purpose(step, iteration))
            r._finish_update(vs.reports[cid], cid, alg.client_update(down, state, data, ctx), vs.token, vs.uploads)

    @staticmethod
    def _train(r, vs: _VectorStep, model, cids: list[int]) -> None:
        """The group's batched local training, then ``client_final`` per client (each in its own failure guard)."""
        alg, cfg = r.algorithm, r.spec.task.train
        t0 = time.perf_counter()
        items = [vs.pending[c] for c in cids]
        try:
            members = [Member(it.params, it.data.x_train if it.start.x is None else it.start.x,
                              it.data.y_train if it.start.y is None else it.start.y, it.ctx.generator("batches"),
                              it.ctx.generator("dropout", device=it.ctx.device), it.opt_state) for it in items]
            trained, metrics, opt_states = vmap_local_sgd(model, alg.objective(items[0].start), members, cfg)
        except Exception as e:  # the batched computation failed: every client in it failed with the error
            for c in cids:
                r._fail(vs.reports[c], c, e)
            return
        share = (time.perf_counter() - t0) / len(cids)
        for j, (c, it) in enumerate(zip(cids, items)):
            t1 = time.perf_counter()
            rep = vs.reports[c]
            try:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(trained[j][n])
                new_state, upload = alg.client_final(model, it.start, it.down, it.state, it.data, it.ctx)
                if cfg.persist_optimizer:
                    new_state = {**(new_state or {}), "opt": opt_states[j]}
                r._finish_update(rep, c, ClientUpdate(new_state, upload, metrics[j]), vs.token, vs.uploads)
            except Exception as e:
                r._fail(rep, c, e, vs.uploads)
            rep.seconds += share + time.perf_counter() - t1


class Loop(Executor):
    """One client after another, each inside its own failure guard (training and evaluation steps)."""

    name = "loop"

    def run(self, r, step: ClientStep, payload, round_idx: int, iteration: int,
            client_ids: list[int]) -> tuple[dict, list[ClientReport]]:
        fn = getattr(r.algorithm, step.method)
        evaluate = step.mode == "evaluate"
        uploads, reports = {}, []
        for cid in client_ids:
            if evaluate and r.data[cid].y_test.numel() == 0:
                continue  # a client without local test data is not evaluated
            t0 = time.perf_counter()
            rep = ClientReport(cid, round_idx, step.name, iteration=iteration)
            try:
                ctx = r._ctx(round_idx, cid, step.name, iteration)
                down = r.algorithm.downlink(payload, cid, ctx)
                if not evaluate:
                    rep.down = payload_sizes(down)
                state = r.state(cid, keep=not evaluate)
                rngmod.seed_torch_global(r.spec.runner.seed, round_idx, cid, _purpose(step, iteration))
                if evaluate:
                    data = r._data(cid)
                    rep.metrics = dict(fn(down, state, data, ctx))
                    if data.has_val:  # the same evaluation on the validation split: test_* -> val_*
                        rngmod.seed_torch_global(r.spec.runner.seed, round_idx, cid, _purpose(step, iteration))
                        vm = fn(down, state, data.validation_view(), ctx)
                        rep.metrics.update({"val_" + k[5:]: v for k, v in vm.items() if k.startswith("test_")})
                else:
                    r._finish_update(rep, cid, fn(down, state, r._data(cid), ctx),
                                        step_token(round_idx, step, iteration), uploads)
            except Exception as e:  # a failing client is a value, not a crashed pool
                r._fail(rep, cid, e, uploads)
            rep.seconds = time.perf_counter() - t0
            reports.append(rep)
        return uploads, reports


def executor_chain(vectorize: bool) -> tuple[Executor, ...]:
    """The executors a runner tries, in order: with ``backend.vectorize`` the vectorised executor and group forms
    first; the per-client loop always last."""
    return ((Vectorized(), GroupForm()) if vectorize else ()) + (Loop(),)
