"""Executors: the ways a client runner runs a client step for its hosted clients, as objects behind one open
interface (:class:`Executor`), registered in order (:func:`register_executor`). A runner builds its chain once from
its settings (:func:`executor_chain`: the registered executors that are ``enabled`` for them); a step goes to the
first executor that ``accepts`` it and runs it (``run`` returns False to pass it on after all):

* :class:`GroupForm` — a method's group form of the step (``<fn>_group(payloads, states, datas, ctxs)``, MAFML's);
* :class:`Vectorized` — local training of ``LocalTraining`` methods batched per architecture
  (:mod:`raysim.runner.vectorized`: the grouped network of :mod:`raysim.runner.grouped` where the model has one, else
  ``torch.func.vmap``);
* :class:`Loop` — one client after another (always last: it takes every step).

An executor sees one :class:`StepRun`: the step, its payload and clients, and the runner's small public surface
(``context``, ``download``, ``state``, ``data``, ``seed``) with the per-client bookkeeping, which lives only there
(``finish``: a client's update staged, its upload kept, its report filled; ``fail``: its own failure, its staged
state and upload dropped; ``result``: uploads and reports). Executors hold no client state and never touch the
runner's private parts, so a new one (a CUDA-graph loop, a compiled group, a method's own group form) is a class
with ``enabled``, ``accepts`` and ``run``, registered with :func:`register_executor`."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from raysim import rng as rngmod
from raysim.algorithm import ClientUpdate, LocalTraining, TrainedGroup
from raysim.runner import fallbacks
from raysim.runner.step_reports import ClientReport, step_purpose, step_token
from raysim.runner.vectorized import (ClientInputs, Member, check_model, running_stat_names, stack_rows,
                                      train_group)
from raysim.errors import DamagedFileError
from raysim.messages import payload_sizes
from raysim.steps import ClientStep


class StepRun:
    """One client step on one runner, as an executor sees it (module docstring): ``step``, ``payload``,
    ``round_idx``, ``iteration``, ``client_ids``, the ``algorithm``, the train section ``train``, and the per-client
    bookkeeping. Made by the runner for each step."""

    def __init__(self, runner, step: ClientStep, payload, round_idx: int, iteration: int, client_ids: list[int]):
        self._runner = runner
        self.step, self.payload, self.round_idx, self.iteration = step, payload, round_idx, iteration
        self.client_ids = list(client_ids)
        self.algorithm = runner.algorithm
        self.train = runner.spec.task.train
        self.evaluate = step.mode == "evaluate"
        self.max_group = int(getattr(runner.spec.runner, "max_group", 0) or 0)
        self.token = step_token(round_idx, step, iteration)
        self.uploads: dict = {}
        self._reports: dict[int, ClientReport] = {}

    # -- the runner's surface -------------------------------------------------------------------------------------
    def context(self, cid: int):
        return self._runner.context(self.round_idx, cid, self.step.name, self.iteration)

    def download(self, cid: int):
        """(the client's context, what it downloads of the payload), the download accounted in its report."""
        ctx = self.context(cid)
        down = self.algorithm.downlink(self.payload, cid, ctx)
        if not self.evaluate:
            self.report(cid).down = payload_sizes(down)
        return ctx, down

    def state(self, cid: int):
        return self._runner.state(cid, keep=not self.evaluate)

    def data(self, cid: int):
        return self._runner.client_data(cid)

    def has_test_data(self, cid: int) -> bool:
        return self._runner.has_test_data(cid)

    def seed(self, cid: int) -> None:
        """torch's global RNG for this client's step (what the per-client loop sets before each call)."""
        rngmod.seed_torch_global(self._runner.spec.runner.seed, self.round_idx, cid,
                                 step_purpose(self.step, self.iteration))

    # -- the bookkeeping -----------------------------------------------------------------------------------------
    def report(self, cid: int) -> ClientReport:
        rep = self._reports.get(cid)
        if rep is None:
            rep = self._reports[cid] = ClientReport(cid, self.round_idx, self.step.name, iteration=self.iteration)
        return rep

    def finish(self, cid: int, update: ClientUpdate) -> None:
        """A client's update: its state staged, its upload kept, its metrics and sizes reported (whether it
        diverged is checked for the whole step by the runner, before anything leaves it)."""
        self._runner.finish_update(self.report(cid), cid, update, self.token, self.uploads)

    def fail(self, cid: int, e: BaseException) -> None:
        """A client's own failure: its report says why, its staged state and upload are dropped."""
        self._runner.fail(self.report(cid), cid, e, self.uploads)

    def result(self) -> tuple[dict, list[ClientReport]]:
        """Uploads by client, and the reports in ``client_ids`` order (clients never reported are left out: an
        evaluation skips clients without test data)."""
        return self.uploads, [self._reports[c] for c in self.client_ids if c in self._reports]


_REGISTRY: list = []


def register_executor(cls, before: Optional[str] = None):
    """Add an executor class to the chain every runner builds (before the one named ``before``; default: before the
    per-client loop, which stays last). Usable as a decorator. Returns ``cls``."""
    names = [c.name for c in _REGISTRY]
    if cls.name in names:
        _REGISTRY.pop(names.index(cls.name))
        names.remove(cls.name)
    if before is None and "loop" in names:
        before = "loop"
    _REGISTRY.insert(names.index(before) if before in names else len(_REGISTRY), cls)
    return cls


class Executor(ABC):
    """One way of running a client step (module docstring)."""

    name = "executor"

    @classmethod
    def enabled(cls, settings) -> bool:
        """Whether a runner with these settings (``RunnerSettings``) holds this executor (default: always)."""
        return True

    def accepts(self, run: StepRun) -> bool:
        """Whether this executor runs ``run``'s step (default: every step)."""
        return True

    @abstractmethod
    def run(self, run: StepRun) -> bool:
        """Run the step for every client of ``run`` through its bookkeeping; False passes it on to the next
        executor (only before anything was recorded)."""


class GroupForm(Executor):
    """``backend.vectorize``: a training step whose method has a group form, for two clients or more."""

    name = "group_form"

    @classmethod
    def enabled(cls, settings) -> bool:
        return bool(settings.vectorize)

    def accepts(self, run: StepRun) -> bool:
        return (not run.evaluate and len(run.client_ids) >= 2
                and getattr(run.algorithm, f"{run.step.method}_group", None) is not None)

    def run(self, run: StepRun) -> bool:
        """One call of the method's group form (``<fn>_group(payloads, states, datas, ctxs)``, the contract in the
        comment after :meth:`raysim.algorithm.Algorithm.evaluate_client`) for the step's clients. The group form
        returns None when it cannot take this group (the per-client loop runs instead); if it raises, the per-client
        loop runs too (a fallback, reported once per run: :mod:`raysim.runner.fallbacks`), so a failing client fails
        alone and with its own error. A result that is not one ClientUpdate per client is the method's bug: a
        TypeError naming it."""
        t0 = time.perf_counter()
        name = f"{type(run.algorithm).__name__}.{run.step.method}_group"
        ids = run.client_ids
        try:
            ctxs = [run.context(cid) for cid in ids]
            downs = [run.algorithm.downlink(run.payload, cid, ctx) for cid, ctx in zip(ids, ctxs)]
            states = [run.state(cid) for cid in ids]
            datas = [run.data(cid) for cid in ids]
            results = getattr(run.algorithm, f"{run.step.method}_group")(downs, states, datas, ctxs)
        except DamagedFileError:
            raise
        except Exception as e:
            fallbacks.note(name, "its clients run the per-client steps", e)
            return False
        if results is None:
            return False
        if (not isinstance(results, (list, tuple)) or len(results) != len(ids)
                or not all(isinstance(u, ClientUpdate) for u in results)):
            raise TypeError(f"{name} must return None or one ClientUpdate per client ({len(ids)}), got "
                            f"{type(results).__name__}"
                            f"{f' of {len(results)}' if isinstance(results, (list, tuple)) else ''}")
        share = (time.perf_counter() - t0) / len(ids)
        for cid, down, res in zip(ids, downs, results):
            run.report(cid).down = payload_sizes(down)
            try:
                run.finish(cid, res)
            except Exception as e:
                run.fail(cid, e)
            run.report(cid).seconds = share
        return True


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
class _Groups:
    """The clients of a vectorised step waiting for their architecture's batched training, by live model."""

    pending: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)


class Vectorized(Executor):
    """``backend.vectorize``: the local training step (``client_update``) of a ``LocalTraining`` method:
    ``client_init`` per client, the local training of every client whose method opts in (``vectorizable``) batched
    per architecture (:mod:`raysim.runner.vectorized`; the clients' own inputs of the objective, ``LocalStart.rows``,
    stacked and handed to ``row_objective``), ``client_final_group`` or ``client_final`` per client; every client
    keeps its own failure guard. Clients that do not opt in run the per-client loop."""

    name = "vectorized"

    @classmethod
    def enabled(cls, settings) -> bool:
        return bool(settings.vectorize)

    def accepts(self, run: StepRun) -> bool:
        return (not run.evaluate and run.step.method == "client_update"
                and isinstance(run.algorithm, LocalTraining))

    def __init__(self):
        self._footprints: dict = {}  # id(live model) -> one client's training footprint in bytes (GPU runners)

    def run(self, run: StepRun) -> bool:
        g = _Groups()
        for cid in run.client_ids:
            t0 = time.perf_counter()
            try:
                self._start(run, g, cid)
            except Exception as e:
                run.fail(cid, e)
                g.pending.pop(cid, None)
            run.report(cid).seconds += time.perf_counter() - t0
        for model, cids in g.groups.values():
            cids = [c for c in cids if c in g.pending]
            size = self._limit(run, model) or len(cids)
            for lo in range(0, len(cids), size):  # a group larger than the limit trains in chunks, in order
                self._train(run, g, model, cids[lo:lo + size])
        return True

    def _limit(self, run: StepRun, model) -> int:
        """The most clients one batched group may hold: ``backend.max_group``; else, on a GPU, as many as the
        device's free share holds by the footprint estimate (raysim.runner.footprint: weights, gradients, optimiser
        state, one batch's activations, per client; 20 % kept free); 0: no limit (a CPU)."""
        if run.max_group:
            return run.max_group
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cuda":
            return 0
        fp = self._footprints.get(id(model))
        if fp is None:
            import copy

            from raysim.runner.footprint import training_footprint

            cpu_model = copy.deepcopy(model).cpu()
            fp = self._footprints[id(model)] = max(1, training_footprint(
                cpu_model, tuple(run.algorithm.task.input_shape), run.train).total)
        fraction = torch.cuda.get_per_process_memory_fraction(p.device)
        cap = fraction * torch.cuda.get_device_properties(p.device).total_memory
        free = min(cap - torch.cuda.memory_allocated(p.device), torch.cuda.mem_get_info(p.device)[0])
        return max(1, int(0.8 * free) // fp)

    @staticmethod
    def _start(run: StepRun, g: _Groups, cid: int) -> None:
        """``client_init`` for one client: it joins its architecture's group, or runs the per-client loop."""
        alg = run.algorithm
        ctx, down = run.download(cid)
        state = run.state(cid)
        data = run.data(cid)
        run.seed(cid)
        model = alg.live_model(ctx)
        start = alg.client_init(model, down, state, data, ctx)
        if alg.vectorizable(start) and (not (start.rows or start.draws is not None)
                                        or type(alg).row_objective is not LocalTraining.row_objective):
            check_model(model)
            if start.weights is not None:  # declared, not loaded: the group stacks them in one op per parameter
                params = start.weights
            else:
                with torch.no_grad():  # the client's starting weights and running statistics (the live model is
                    # reloaded for the next one)
                    params = {n: p.clone() for n, p in model.named_parameters()}
                    params.update({n: model.get_buffer(n).clone() for n in running_stat_names(model)})
            opt_state = (state or {}).get("opt") if run.train.persist_optimizer else None
            g.pending[cid] = _Pending(ctx, down, state, data, start, params, opt_state)
            g.groups.setdefault(id(model), (model, []))[1].append(cid)
        else:
            run.seed(cid)
            run.finish(cid, alg.client_update(down, state, data, ctx))

    @staticmethod
    def _train(run: StepRun, g: _Groups, model, cids: list[int]) -> None:
        """The group's batched local training, then ``client_final`` per client (each in its own failure guard)."""
        alg, cfg = run.algorithm, run.train
        t0 = time.perf_counter()
        items = [g.pending[c] for c in cids]
        try:
            members = [Member(it.params, it.data.x_train if it.start.x is None else it.start.x,
                              it.data.y_train if it.start.y is None else it.start.y, it.ctx.stream("batches"),
                              it.ctx.stream("dropout"), it.opt_state) for it in items]
            start0 = items[0].start
            per_client = bool(start0.rows) or start0.draws is not None  # the objective's per-client inputs
            rows = stack_rows([it.start.rows for it in items]) if per_client else None
            loss_fn = alg.objective(start0) if rows is None else alg.row_objective(start0)
            inputs = None if rows is None else ClientInputs(rows, start0.frozen,
                                                            [it.start.draws for it in items])
            trained, metrics, opt_states = train_group(model, loss_fn, members, cfg, inputs=inputs)
        except Exception as e:  # the batched computation failed: every client in it failed with the error
            for c in cids:
                run.fail(c, e)
            return
        share = (time.perf_counter() - t0) / len(cids)
        finals = None
        if not any(it.start.weights is None for it in items):  # else the live model holds the last client's start
            try:
                finals = alg.client_final_group(TrainedGroup(
                    model, trained, [it.start for it in items], [it.down for it in items], [it.state for it in items],
                    [it.data for it in items], [it.ctx for it in items], rows or {}))
            except Exception as e:  # the batch form failed: client_final runs per client (each fails on its own)
                fallbacks.note(f"{type(alg).__name__}.client_final_group", "its clients run client_final one by one", e)
                finals = None
        if finals is not None:
            for j, (c, (new_state, upload)) in enumerate(zip(cids, finals)):
                try:
                    if cfg.persist_optimizer:
                        new_state = {**(new_state or {}), "opt": opt_states[j]}
                    run.finish(c, ClientUpdate(new_state, upload, metrics[j]))
                except Exception as e:
                    run.fail(c, e)
                run.report(c).seconds += share
            return
        for j, (c, it) in enumerate(zip(cids, items)):
            t1 = time.perf_counter()
            try:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(trained[n][j])
                    for n in running_stat_names(model):  # the client's own batch-norm statistics
                        model.get_buffer(n).copy_(trained[n][j])
                new_state, upload = alg.client_final(model, it.start, it.down, it.state, it.data, it.ctx)
                if cfg.persist_optimizer:
                    new_state = {**(new_state or {}), "opt": opt_states[j]}
                run.finish(c, ClientUpdate(new_state, upload, metrics[j]))
            except Exception as e:
                run.fail(c, e)
            run.report(c).seconds += share + time.perf_counter() - t1


class GroupEvaluation(Executor):
    """``backend.vectorize``: an evaluation step of a method with a group form of ``evaluate_client``
    (``evaluate_group(payloads, states, datas, ctxs) -> [metrics] | None``, e.g. FedAvg's: one forward of every
    client's test set under the global model) for the step's clients with test data, and the same on their
    validation splits; None or an error passes the step on to the per-client loop (an error: a fallback, reported
    once per run)."""

    name = "group_evaluation"

    @classmethod
    def enabled(cls, settings) -> bool:
        return bool(settings.vectorize)

    def accepts(self, run: StepRun) -> bool:
        return (run.evaluate and run.step.method == "evaluate_client"
                and getattr(run.algorithm, "evaluate_group", None) is not None)

    def run(self, run: StepRun) -> bool:
        t0 = time.perf_counter()
        ids = [c for c in run.client_ids if run.has_test_data(c)]
        if len(ids) < 2:
            return False
        try:
            ctxs, downs = map(list, zip(*[run.download(c) for c in ids]))
            states, datas = [run.state(c) for c in ids], [run.data(c) for c in ids]
            metrics = self._by_architecture(run, ctxs, downs, states, datas)
            if metrics is None:
                return False
            val = [j for j, d in enumerate(datas) if d.has_val]
            vm = self._by_architecture(run, [ctxs[j] for j in val], [downs[j] for j in val],
                                       [states[j] for j in val], [datas[j].validation_view() for j in val]) \
                if val else []
            if vm is None:
                return False
        except DamagedFileError:
            raise
        except Exception as e:
            fallbacks.note(f"{type(run.algorithm).__name__}.evaluate_group", "its clients are evaluated one by one", e)
            return False
        share = (time.perf_counter() - t0) / len(ids)
        for cid, m in zip(ids, metrics):
            run.report(cid).metrics = dict(m)
            run.report(cid).seconds = share
        for j, m in zip(val, vm):  # the same evaluation on the validation split: test_* -> val_*
            run.report(ids[j]).metrics.update({"val_" + k[5:]: v for k, v in m.items() if k.startswith("test_")})
        return True


    @staticmethod
    def _by_architecture(run: StepRun, ctxs: list, downs: list, states: list, datas: list) -> Optional[list]:
        """``evaluate_group`` once per architecture among the clients (a heterogeneous population: one group per
        live model), the metrics back in the clients' order; None when the method declines any group."""
        groups: dict = {}
        for j, ctx in enumerate(ctxs):
            groups.setdefault(id(run.algorithm.live_model(ctx)), []).append(j)
        out: list = [None] * len(ctxs)
        for idx in groups.values():
            got = run.algorithm.evaluate_group([downs[j] for j in idx], [states[j] for j in idx],
                                               [datas[j] for j in idx], [ctxs[j] for j in idx])
            if got is None:
                return None
            for j, m in zip(idx, got):
                out[j] = m
        return out


class Loop(Executor):
    """One client after another, each inside its own failure guard (training and evaluation steps)."""

    name = "loop"

    def run(self, run: StepRun) -> bool:
        fn = getattr(run.algorithm, run.step.method)
        for cid in run.client_ids:
            if run.evaluate and not run.has_test_data(cid):
                continue  # a client without local test data is not evaluated
            t0 = time.perf_counter()
            rep = run.report(cid)
            try:
                ctx, down = run.download(cid)
                state = run.state(cid)
                run.seed(cid)
                if run.evaluate:
                    data = run.data(cid)
                    rep.metrics = dict(fn(down, state, data, ctx))
                    if data.has_val:  # the same evaluation on the validation split: test_* -> val_*
                        run.seed(cid)
                        vm = fn(down, state, data.validation_view(), ctx)
                        rep.metrics.update({"val_" + k[5:]: v for k, v in vm.items() if k.startswith("test_")})
                else:
                    run.finish(cid, fn(down, state, run.data(cid), ctx))
            except Exception as e:  # a failing client is a value, not a crashed pool
                run.fail(cid, e)
            rep.seconds = time.perf_counter() - t0
        return True


# the built-in chain: the vectorised executor (client_update of LocalTraining methods) and group forms (a method's
# <fn>_group), both enabled by backend.vectorize, ahead of the per-client loop
for _cls in (Loop, Vectorized, GroupForm, GroupEvaluation):
    register_executor(_cls)


def executor_chain(settings) -> tuple[Executor, ...]:
    """The executors a runner with ``settings`` (``RunnerSettings``) tries, in registration order: the enabled ones,
    the per-client loop always last."""
    chain = tuple(cls() for cls in _REGISTRY if cls.enabled(settings))
    return chain if chain and isinstance(chain[-1], Loop) else chain + (Loop(),)
