"""The client runner's batched ways of running a client step (``backend.vectorize``), mixed into
:class:`raysim.engine.runners.ClientRunner`: a method's group form of the step (``_run_group``) and the vectorised
executor for local training (``_run_vectorized``, :mod:`raysim.engine.vectorized`). Both keep the per-client loop's
contract: each client's report, staged state and upload, and its own failure."""
from __future__ import annotations

import time
import warnings
from typing import Optional

import torch

from raysim import rng as rngmod
from raysim.algorithm import ClientUpdate
from raysim.engine.reports import ClientReport, step_purpose as _purpose, step_token
from raysim.engine.vectorized import check_model, vmap_local_sgd
from raysim.errors import DamagedFileError
from raysim.messages import payload_sizes
from raysim.steps import ClientStep


class BatchedSteps:
    """Mixed into ClientRunner (uses its ``algorithm``, ``spec``, ``_ctx``, ``state``, ``_data``, ``_finish_update``,
    ``_fail`` and ``_group_warned``)."""

    def _run_group(self, step: ClientStep, group_fn, payload, round_idx: int, iteration: int,
                   client_ids: list[int]) -> Optional[tuple[dict, list[ClientReport]]]:
        """``backend.vectorize`` for a step whose method has a group form (``<fn>_group(payloads, states, datas,
        ctxs)``, the contract in the comment after :meth:`raysim.algorithm.Algorithm.evaluate_client`): one call for
        the hosted clients of the step. The group form returns None when it cannot take this group (the per-client
        loop runs instead); if it raises, the per-client loop runs too (warned once per step), so a failing client
        fails alone and with its own error. A result that is not one ClientUpdate per client is the method's bug: a
        TypeError naming it."""
        t0 = time.perf_counter()
        name = f"{type(self.algorithm).__name__}.{step.method}_group"
        try:
            ctxs = [self._ctx(round_idx, cid, step.name, iteration) for cid in client_ids]
            downs = [self.algorithm.downlink(payload, cid, ctx) for cid, ctx in zip(client_ids, ctxs)]
            states = [self.state(cid) for cid in client_ids]
            datas = [self._data(cid) for cid in client_ids]
            results = group_fn(downs, states, datas, ctxs)
        except DamagedFileError:
            raise
        except Exception as e:
            if name not in self._group_warned:
                self._group_warned.add(name)
                warnings.warn(f"{name} failed ({type(e).__name__}: {e}); its clients run the per-client steps",
                              RuntimeWarning, stacklevel=2)
            return None
        if results is None:
            return None
        if (not isinstance(results, (list, tuple)) or len(results) != len(client_ids)
                or not all(isinstance(r, ClientUpdate) for r in results)):
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
                self._finish_update(rep, cid, res, token, uploads)
            except Exception as e:
                self._fail(rep, cid, e, uploads)
            rep.seconds = share
            reports.append(rep)
        return uploads, reports

    def _run_vectorized(self, step: ClientStep, payload, round_idx: int, iteration: int,
                        client_ids: list[int]) -> tuple[dict, list[ClientReport]]:
        """``backend.vectorize``: ``client_init`` per client, the local training of every client whose method opts
        in (``vectorizable``) batched per architecture (:mod:`raysim.engine.vectorized`), ``client_final`` per client;
        every client keeps its own failure guard. Clients that do not opt in run the per-client loop."""
        alg, cfg = self.algorithm, self.spec.task.train
        token = step_token(round_idx, step, iteration)
        uploads, reports, pending, groups = {}, {}, {}, {}
        for cid in client_ids:
            t0 = time.perf_counter()
            rep = reports[cid] = ClientReport(cid, round_idx, step.name, iteration=iteration)
            try:
                ctx = self._ctx(round_idx, cid, step.name, iteration)
                down = alg.downlink(payload, cid, ctx)
                rep.down = payload_sizes(down)
                state = self.state(cid)
                data = self._data(cid)
                rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, cid, _purpose(step, iteration))
                model = alg.live_model(ctx)
                start = alg.client_init(model, down, state, data, ctx)
                if alg.vectorizable(start):
                    check_model(model)
                    params = {n: p.detach().clone() for n, p in model.named_parameters()}
                    opt_state = (state or {}).get("opt") if cfg.persist_optimizer else None
                    pending[cid] = (ctx, down, state, data, start, params, opt_state)
                    groups.setdefault(id(model), (model, []))[1].append(cid)
                else:
                    rngmod.seed_torch_global(self.spec.cfg.seed, round_idx, cid, _purpose(step, iteration))
                    self._finish_update(rep, cid, alg.client_update(down, state, data, ctx), token, uploads)
            except Exception as e:
                self._fail(rep, cid, e, uploads)
                pending.pop(cid, None)
            rep.seconds += time.perf_counter() - t0
        for model, cids in groups.values():
            cids = [c for c in cids if c in pending]
            if not cids:
                continue
            t0 = time.perf_counter()
            items = [pending[c] for c in cids]
            try:
                trained, metrics, opt_states = vmap_local_sgd(
                    model, alg.objective(items[0][4]), [it[5] for it in items],
                    [it[3].x_train if it[4].x is None else it[4].x for it in items], [it[3].y_train if it[4].y is None else it[4].y for it in items],
                    cfg, [it[0].generator("batches") for it in items],
                    [it[0].generator("dropout", device=it[0].device) for it in items], [it[6] for it in items])
            except Exception as e:  # the batched computation failed: every client in it failed with the error
                for c in cids:
                    self._fail(reports[c], c, e)
                continue
            share = (time.perf_counter() - t0) / len(cids)
            for j, c in enumerate(cids):
                t1 = time.perf_counter()
                ctx, down, state, data, start, _, _ = pending[c]
                rep = reports[c]
                try:
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            p.copy_(trained[j][n])
                    new_state, upload = alg.client_final(model, start, down, state, data, ctx)
                    if cfg.persist_optimizer:
                        new_state = {**(new_state or {}), "opt": opt_states[j]}
                    self._finish_update(rep, c, ClientUpdate(new_state, upload, metrics[j]), token, uploads)
                except Exception as e:
                    self._fail(rep, c, e, uploads)
                rep.seconds += share + time.perf_counter() - t1
        return uploads, [reports[c] for c in client_ids]
