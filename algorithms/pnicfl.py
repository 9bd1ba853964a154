"""PN-ICFL and PN-ICFL+: prototypical-network-based iterative clustered federated learning (the seed
001_ce8e72c830799c1d; reference §3.1b for what it fixes, §3.2 for what we inferred).

One prototypical network f_theta (the model's body; the head is never used) is shared by all users; each of the K
clusters is a class-prototype matrix E_k (C x d), not a model. Users never download K models.

* Setup phase (server, once): episodic pre-training of f_theta on an explicitly public dataset (``data.public``; the
  seed used Omniglot, unavailable offline: Fashion-MNIST when clients hold digits), Snell et al.'s loss
  -log softmax_c(-||f(x_q) - z_c||^2) with z_c the support mean, Adam (Snell's optimiser).
* Round, step ``embed`` (sampled users): download theta, compute the user embedding u_i (per-class mean of f_theta
  over all local training data, eval mode) and the class counts n_ic (p_i(y) = n_ic / n_i); upload both.
* Step ``assign`` (server E-step, eq. 9-10): d_ik = sum_{c in C_i and E_k} p~_i(c) ||u_i^c - E_k^c||^2 with p~_i
  renormalised over the shared classes (+inf if none); s_i = argmin_k d_ik. In the first round with participants the
  E_k come from the participants' embeddings. The default is the seed's protocol (§4.2): K of them at random are the
  E_k (``init: random, init_restarts: 0``); the seed runs 5 seeds ("5 cluster initialisations from 5 random seeds")
  and reports their mean, so an experiment's seeds are its initialisations. An option, reported in its own row
  (issue 34): k-means under d on the round's embeddings, ``init_restarts`` times from seedings of ``init``
  (``kmeans++``), keeping the solution with the lowest total distance (:func:`kmeans_init`; server compute only,
  nothing more on the wire). With K random users two of them often come from one domain (for 4 domains of 4 users,
  6 draws in 7), and the hard-assignment EM of the rounds never separates the domain that got none from its
  neighbour: on plainly separable rotated Fashion-MNIST the seed's init ends at ARI 0.59-0.67 in 2 of 5 validation
  seeds, where 10 k-means++ restarts recover 1.0 (benchmarks/REPRODUCTION_seed001.md). When PN-ICFL gets restarts,
  IFCA in the same table gets the same budget (``algorithm.params.init_restarts`` of :mod:`algorithms.ifca`:
  best of N random initialisations by training loss).
* Step ``update`` (sampled users): download E_{s_i} (C x d and its class mask) and the cluster id; run E local epochs
  of B tasks (``tasks_per_epoch``) on the local data, one step per task. ``local_update: partition`` (the default
  since issue 51: the seed's Algorithm 2, line 1 "split the data set D into B few-shot meta-learning tasks"): all of
  D split once per local round into B disjoint tasks (:func:`partition_tasks`), so every sample is used once per
  epoch. ``local_update: episodes`` (the default before
  issue 51; Snell et al.'s episodic training, an option): each task a sampled episode (n_way classes of the user's,
  n_support + n_query samples per class, drawn with replacement when a class has fewer). Every stored seed-001 table
  made before the switch ran the episodes; their experiments name ``local_update: episodes`` explicitly. A config
  that does not name it now runs the partition under the same config identity (identities omit defaults): its
  records' code version tells the two apart. Loss L = L_proto. PN-ICFL+ adds lambda * L_g, where L_g is
  the same loss with the episode's support prototypes z_c replaced by the cluster prototypes E_{s_i}^c (eq. 16-17;
  classes without a cluster prototype are left out of L_g). Upload theta_i and n_i.
* Step ``aggregate`` (server M-step, eq. 14-15): E_k^c = sum_{i: s_i = k} n_ic u_i^c / sum n_ic over the round's
  members (a class or cluster nobody brought keeps its old prototype); theta = FedAvg of theta_i weighted by n_i.
  ``m_step_embeddings: estep`` (default; the seed's Algorithm 1 and §3.4: the server aggregates the embeddings u_i the
  users sent with p_i(y) before their local update, the ones the E-step used) or ``updated`` (our earlier inferred
  variant: each user also uploads u'_i recomputed under its trained theta_i, and the M-step averages those).
* Test: a user downloads theta and E_{s_i}; prediction = the nearest prototype over every class E_{s_i} holds (it can
  predict classes it never held). A user the server has not assigned yet is a new user: it computes u under theta,
  and gets s = argmin_k d(u, E_k) (simulated in the evaluation step: the user downloads the K prototype matrices,
  K x C x d floats, never K models). ``test_acc_local`` is the nearest prototype among the user's own u_i.

The client keeps the theta it downloaded in ``embed`` for ``update`` (so theta is downloaded once per round).
Communication per participating user and round: down |theta| + C*d floats (+ C mask bytes, 1 id), up C*d + C values
+ |theta| + 1 (``updated``: another C*d + C).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from algorithms.fedavg import sample_weighted_average
from algorithms.pnicfl_maths import (body_state, e_step, embed_all, episode_losses, estep_embeddings, kmeans_init,
                                     m_step, partition_tasks, sample_episode, sq_dists, task_losses, user_embedding)
from raysim.algorithm import Algorithm, ClientUpdate, Context, ReportsClusters, ServerUpdate
from raysim.config import choice, positive
from raysim.errors import ConfigError
from raysim.messages import Message
from raysim.models import set_dropout_generator
from raysim.steps import ClientStep, ServerStep
from raysim.training import OptimizerSpec, accuracy, make_optimizer


# -- pure maths (hand examples: tests/test_clustered.py and tests/test_maths.py) ----------------------------------------

class PNICFL(ReportsClusters, Algorithm):
    name = "pnicfl"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        return {"test_acc": "cluster_prototype", "test_acc_local": "local_prototype"}
    paper = ("PN-ICFL: prototypical-network-based iterative clustered federated learning (seed 001); Snell et al., "
             "Prototypical Networks for Few-shot Learning, NeurIPS 2017")
    uploads = frozenset({"user_embedding", "weights", "num_samples"})

    @dataclass(frozen=True)
    class Params:
        num_clusters: int = 4  # K (the seed: the number of rotations / sources)
        lam: float = 0.0  # PN-ICFL+: weight of L_g (0: PN-ICFL)
        init: str = "random"  # seeding of the initial E_k: random (the seed, §4.2) | kmeans++ (under the model distance)
        init_restarts: int = 0  # k-means restarts on the first round's embeddings (0: the seeded users' own
        #                         embeddings are the E_k, the seed's §4.2 with init: random; an option, e.g. 10
        #                         with init: kmeans++, reported in its own row beside IFCA with the same budget)
        tasks_per_epoch: int = 2  # B: tasks per local epoch (the seed: B = 2); epochs = train.local_epochs (E)
        local_update: str = "partition"  # partition (the seed's Algorithm 2, the default since issue 51): all of D
        #   split into B disjoint tasks once per local round, each sample used exactly once per epoch (n_way /
        #   n_support / n_query unused) | episodes: B sampled n_way episodes per epoch (n_support + n_query per class,
        #   with replacement; Snell et al.'s episodic training, an option)
        n_way: int = 5  # classes per local episode (capped by the user's classes; Snell's / our inferred default)
        n_support: int = 5
        n_query: int = 5
        pretrain_episodes: int = 300  # server pre-training on data.public in the setup phase (0: none)
        pretrain_way: int = 10  # capped by the public dataset's classes
        pretrain_support: int = 5
        pretrain_query: int = 5
        pretrain_lr: float = 1e-3  # Adam, Snell's default
        m_step_embeddings: str = "estep"  # estep: the u_i the E-step used (the seed) | updated: u'_i after training

        def check(self, path):
            positive(f"{path}.num_clusters", self.num_clusters)
            positive(f"{path}.lam", self.lam, allow_zero=True)
            choice(f"{path}.init", self.init, ["random", "kmeans++"])
            choice(f"{path}.m_step_embeddings", self.m_step_embeddings, ["estep", "updated"])
            choice(f"{path}.local_update", self.local_update, ["episodes", "partition"])
            for name in ("tasks_per_epoch", "n_way", "n_support", "n_query", "pretrain_way", "pretrain_support",
                         "pretrain_query", "pretrain_lr"):
                positive(f"{path}.{name}", getattr(self, name))
            positive(f"{path}.pretrain_episodes", self.pretrain_episodes, allow_zero=True)
            positive(f"{path}.init_restarts", self.init_restarts, allow_zero=True)

    def validate(self):
        self.require_homogeneous()
        p, task = self.params, self.task
        if p.num_clusters > task.num_clients:
            raise ConfigError("algorithm.params.num_clusters", f"must be <= data.num_clients ({task.num_clients}), "
                                                               f"got {p.num_clusters}")
        if p.pretrain_episodes > 0:
            pub = task.public
            if pub is None:
                raise ConfigError("data.public", f"{self.name} pre-trains its prototypical network on the server on a "
                                                 f"public dataset (e.g. data.public: {{dataset: fashion_mnist, size: "
                                                 f"2000}}); or set algorithm.params.pretrain_episodes: 0")
            if tuple(pub.x.shape[1:]) != tuple(task.input_shape):
                raise ConfigError("data.public", f"public images have shape {tuple(pub.x.shape[1:])}, the clients' "
                                                 f"{tuple(task.input_shape)}")
            short = min(int((pub.y == c).sum()) for c in torch.unique(pub.y).tolist())
            if short < p.pretrain_support + p.pretrain_query:
                raise ConfigError("data.public.size", f"a public class has {short} samples, fewer than "
                                                      f"pretrain_support + pretrain_query")

    # -- schedules ----------------------------------------------------------------------------------------------
    def setup_schedule(self):
        return (ServerStep("pretrain", fn="pretrain"),) if self.params.pretrain_episodes > 0 else None

    def schedule(self):
        return (ClientStep("embed", fn="embed"), ServerStep("assign", fn="assign"),
                ClientStep("update", fn="local_update"), ServerStep("aggregate", fn="m_step"))

    # -- server -------------------------------------------------------------------------------------------------
    def init_server_state(self, ctx: Context):
        model = self.task.build_model(0)
        k, c, d = self.params.num_clusters, self.task.num_classes, model.embed_dim
        return {"theta": body_state(model), "E": torch.zeros(k, c, d), "mask": torch.zeros(k, c, dtype=torch.bool),
                "live": torch.zeros(k, dtype=torch.bool),
                "assign": torch.full((self.task.num_clients,), -1, dtype=torch.int64),
                "round_u": {"ids": torch.zeros(0, dtype=torch.int64), "u": torch.zeros(0, c, d),
                            "counts": torch.zeros(0, c, dtype=torch.int64)}}

    def pretrain(self, state, uploads, ctx: Context) -> ServerUpdate:
        """Episodic pre-training of f_theta on the public dataset (Snell et al.), on the server runner."""
        p, pub = self.params, self.task.public
        model = ctx.model(0)
        model.body.load_state_dict(state["theta"])
        body = model.body
        x, y = pub.x.to(ctx.device), pub.y
        classes = sorted(torch.unique(y).tolist())
        opt = make_optimizer(body.parameters(), OptimizerSpec("adam", p.pretrain_lr))
        r = ctx.rng("pretrain")
        set_dropout_generator(model, ctx.generator("dropout", device=ctx.device))
        losses, accs = [], []
        try:
            body.train()
            for _ in range(p.pretrain_episodes):
                episode = sample_episode(y, classes, p.pretrain_way, p.pretrain_support, p.pretrain_query, r)
                loss, acc, _ = episode_losses(body, x, episode)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                accs.append(float(acc.detach()))
        finally:
            set_dropout_generator(model, None)
        tail = max(1, len(losses) // 10)
        return ServerUpdate({**state, "theta": body_state(model)}, None,
                            {"pretrain_loss": float(np.mean(losses[-tail:])), "pretrain_acc": float(np.mean(accs[-tail:]))})

    def broadcast(self, state, ctx: Context):
        return {"theta": Message("weights", {k: v.clone() for k, v in state["theta"].items()}),
                "prototypes": Message("cluster_prototypes", {"E": state["E"].clone(), "mask": state["mask"].clone()}),
                "assignment": Message("cluster_assignment", {"assign": state["assign"].clone()})}

    def downlink(self, payload, client_id: int, ctx=None):
        step = ctx.step if ctx is not None else ""
        if step == "embed":
            return {"theta": payload["theta"]}
        k = int(payload["assignment"]["assign"][client_id])
        if step == "update":  # theta came with the embed step
            return self._cluster_download(payload, k)
        # evaluation: theta and the user's cluster prototypes; a new user gets the K prototype matrices
        if k < 0:
            return {"theta": payload["theta"], "prototypes": payload["prototypes"]}
        return {"theta": payload["theta"], **self._cluster_download(payload, k)}

    @staticmethod
    def _cluster_download(payload, k: int):
        pr = payload["prototypes"]
        return {"cluster": Message("cluster_prototypes", {"E": pr["E"][k].clone(), "mask": pr["mask"][k].clone()}),
                "cluster_id": Message("cluster_id", {"k": torch.tensor([k])})}

    def assign(self, state, uploads, ctx: Context) -> ServerUpdate:
        ids = sorted(uploads)
        if not ids:
            return ServerUpdate(state, self.broadcast(state, ctx), {})
        u = torch.stack([uploads[i]["embedding"]["u"] for i in ids]).to(torch.float32)
        counts = torch.stack([uploads[i]["embedding"]["counts"] for i in ids])
        E, mask, live = state["E"].clone(), state["mask"].clone(), state["live"].clone()
        dead = torch.nonzero(~live, as_tuple=False).flatten().tolist()
        if dead:  # the first round with participants: E_k from the users' embeddings
            E0, m0, _ = kmeans_init(u, counts, len(dead), ctx.rng("pnicfl_init"), self.params.init,
                                    self.params.init_restarts)
            for j, k in enumerate(dead[:len(E0)]):
                E[k], mask[k], live[k] = E0[j], m0[j], True
        s = e_step(u, counts, E, mask)
        assign = state["assign"].clone()
        before = assign[torch.as_tensor(ids)].clone()
        assign[torch.as_tensor(ids)] = s
        new = {**state, "E": E, "mask": mask, "live": live, "assign": assign,
               # the E-step's embeddings, for the M-step (m_step_embeddings: estep)
               "round_u": {"ids": torch.as_tensor(ids, dtype=torch.int64), "u": u, "counts": counts}}
        return ServerUpdate(new, self.broadcast(new, ctx), {"pnicfl_moved": float((before != s).sum())})

    def m_step(self, state, uploads, ctx: Context) -> ServerUpdate:
        ids = sorted(uploads)
        metrics = {}
        if ids:  # the delivered uploads (empty when nobody delivered)
            if self.params.m_step_embeddings == "updated":
                u = torch.stack([uploads[i]["embedding"]["u"] for i in ids]).to(torch.float32)
                counts = torch.stack([uploads[i]["embedding"]["counts"] for i in ids])
            else:  # the embeddings the E-step used, of the users whose update arrived
                u, counts = estep_embeddings(state["round_u"], ids)
            a = [int(state["assign"][i]) for i in ids]
            E, mask = m_step(state["E"], state["mask"], a, u, counts)
            theta = sample_weighted_average(uploads, ids)
            state = {**state, "theta": theta, "E": E, "mask": mask}
            sizes = torch.bincount(torch.as_tensor(a), minlength=self.params.num_clusters)
            metrics = {"largest_cluster": float(sizes.max()), "clusters_used": float((sizes > 0).sum())}
        return ServerUpdate(state, self.broadcast(state, ctx.next_round()), metrics)

    # -- client -------------------------------------------------------------------------------------------------
    def _embedding_message(self, body, data) -> Message:
        u, counts = user_embedding(embed_all(body, data.x_train), data.y_train, self.task.num_classes)
        return Message("user_embedding", {"u": u.detach().cpu(), "counts": counts.cpu()})

    def embed(self, payload, state, data, ctx: Context) -> ClientUpdate:
        model = ctx.model()
        model.body.load_state_dict(payload["theta"].tensors)
        theta = {k: v.clone() for k, v in payload["theta"].tensors.items()}
        return ClientUpdate({"theta": theta}, {"embedding": self._embedding_message(model.body, data)})

    def local_update(self, payload, state, data, ctx: Context) -> ClientUpdate:
        p, cfg = self.params, self.task.train
        model = ctx.model()
        model.body.load_state_dict(state["theta"])
        body = model.body
        cluster = payload["cluster"]["E"].to(ctx.device) if p.lam > 0 else None
        cmask = payload["cluster"]["mask"] if p.lam > 0 else None
        opt = make_optimizer(body.parameters(), cfg)
        r = ctx.rng("episodes")
        classes = sorted(torch.unique(data.y_train).tolist())
        tasks = (partition_tasks(data.y_train, classes, p.tasks_per_epoch, r) if p.local_update == "partition"
                 else None)  # Algorithm 2, line 1: once per local round, before the E epochs
        set_dropout_generator(model, ctx.generator("dropout", device=ctx.device))
        tot = {"loss": 0.0, "proto": 0.0, "acc": 0.0}
        if p.lam > 0:
            tot["g"] = 0.0
        steps = 0
        try:
            body.train()
            for _ in range(cfg.local_epochs):
                for j in range(p.tasks_per_epoch):
                    if tasks is None:
                        episode = sample_episode(data.y_train, classes, p.n_way, p.n_support, p.n_query, r)
                        lp, acc, lg = episode_losses(body, data.x_train, episode, cluster, cmask)
                    else:
                        lp, acc, lg = task_losses(body, data.x_train, tasks[j], cluster, cmask)
                        if lp is None:  # a task without a query (a user with fewer samples than 2 B)
                            continue
                    loss = lp if lg is None else lp + p.lam * lg
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    steps += 1
                    tot["loss"] += float(loss.detach())
                    tot["proto"] += float(lp.detach())
                    tot["acc"] += float(acc)
                    if p.lam > 0:
                        tot["g"] += float(lg.detach()) if lg is not None else 0.0
        finally:
            set_dropout_generator(model, None)
        upload = {"model": Message("weights", body_state(model)),
                  "num_samples": Message("num_samples", {"n": torch.tensor([data.num_train], dtype=torch.int64)})}
        if p.m_step_embeddings == "updated":
            upload["embedding"] = self._embedding_message(body, data)
        return ClientUpdate({}, upload, {f"train_{k}": v / max(steps, 1) for k, v in tot.items()})

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = ctx.model()
        model.body.load_state_dict(payload["theta"].tensors)
        u, counts = user_embedding(embed_all(model.body, data.x_train), data.y_train, self.task.num_classes)
        if "cluster" in payload:
            k = int(payload["cluster_id"]["k"][0])
            E, mask = payload["cluster"]["E"], payload["cluster"]["mask"]
        else:  # a new user: nearest cluster under the model distance
            pr = payload["prototypes"]
            k = int(e_step(u.unsqueeze(0).cpu(), counts.unsqueeze(0).cpu(), pr["E"], pr["mask"])[0])
            E, mask = pr["E"][k], pr["mask"][k]
        z = embed_all(model.body, data.x_test)
        out = {"cluster": float(k)}
        if bool(mask.any()):
            d = sq_dists(z, E.to(z.device)).masked_fill(~mask.to(z.device).unsqueeze(0), float("inf"))
            out["test_acc"] = accuracy(d.argmin(1), data.y_test)
        else:
            out["test_acc"] = accuracy(torch.full_like(data.y_test, -1), data.y_test)
        own = counts > 0
        d = sq_dists(z, u).masked_fill(~own.to(z.device).unsqueeze(0), float("inf"))
        out["test_acc_local"] = accuracy(d.argmin(1), data.y_test)
        return out


class PNICFLPlus(PNICFL):
    """PN-ICFL+: L_total = L + lambda * L_g (the seed: lambda = 0.2 at R = 1, 0.1 at R = 0.5; 1.0 / 2.0 on the
    multi-source digits)."""

    name = "pnicfl_plus"

    @dataclass(frozen=True)
    class Params(PNICFL.Params):
        lam: float = 0.2

        def check(self, path):
            super().check(path)
            if self.lam <= 0:
                raise ConfigError(f"{path}.lam", f"PN-ICFL+ needs lam > 0 (lam = 0 is pnicfl), got {self.lam}")
