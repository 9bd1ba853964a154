"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022).

Clients upload per-class mean embeddings (prototypes) with their counts; the server averages them into global
prototypes and sends those back; no model weights are exchanged, so clients may run different architectures as long
as the embedding size agrees. Local loss: CE + lambda * MSE(z, P_y) (nn.MSELoss, i.e. averaged over |B| x d).
Evaluation reports the client's own classifier ("test_acc", w/o protos) and nearest-global-prototype inference
("test_acc_proto"), restricted to the client's own classes as in the official code, or over all classes (HtFLlib).
Options ``positive_rate`` / ``pu_weight``: the FedPU positive-unlabelled setting (algorithms/fedpu.py); then the CE
and prototype terms use the labelled rows only, prototypes are means over labelled samples, and the PU loss is added.
Subclasses (FedProto-UH, FedTGP) change the model (``build_client_model`` / :meth:`LocalTraining.live_model`) or the
server side.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algorithms import fedpu
from raysim.algorithm import Asynchronous, Context, LocalStart, LocalTraining
from raysim.config import choice
from raysim.errors import ConfigError
from raysim.runner.grouped import grouped_embeddings, stack_weights
from raysim.messages import Message, rows_of
from raysim.shared_maths import (aggregate_prototypes, class_prototypes, group_class_prototypes,
                                 known_class_prototypes, moved_like, nearest_prototype, prototype_regulariser)
from raysim.training import clone_state, device_accuracy, epoch_count, forward_all


class FedProto(Asynchronous, LocalTraining):
    uploads = frozenset({"prototypes"})

    name = "fedproto"

    @classmethod
    def measures(cls, params=None) -> dict:  # what each metric evaluates (raysim.algorithm.MEASURES)
        own = bool(cls._param(params, "restrict_local_classes"))
        return {"test_acc": "personalised", "test_acc_proto": "prototype_own" if own else "prototype_all"}
    headline = ("test_acc", "test_acc_proto")  # own classifier, nearest global prototype
    paper = "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"

    @dataclass(frozen=True)
    class Params(fedpu.PUParams):  # FedPU's options (positive_rate, pu_weight, ...) + FedProto's
        lam: float = 1.0  # weight of the prototype regulariser (official `ld`)
        proto_agg: str = "weighted"  # weighted (paper) | mean (official code)
        proto_collect: str = "after"  # after: eval-mode pass after training | during_train: last epoch (official)
        restrict_local_classes: bool = True  # prototype inference among the client's own classes (official)

        def check(self, path):
            super().check(path)
            choice(f"{path}.proto_agg", self.proto_agg, ["weighted", "mean"])
            choice(f"{path}.proto_collect", self.proto_collect, ["after", "during_train"])
            if self.lam < 0:
                raise ConfigError(f"{path}.lam", f"must be >= 0, got {self.lam}")

    def validate(self):
        dims = {self.task.build_model(i).embed_dim for i in range(self.task.num_clients)}
        if len(dims) > 1:
            raise ConfigError("model.per_client", f"prototype methods need one embedding size for all clients, got {sorted(dims)}")

    # -- server -------------------------------------------------------------------------------------------------
    def embed_dim(self) -> int:
        """The clients' embedding size (built once: the task does not change)."""
        if getattr(self, "_embed_dim", None) is None:
            self._embed_dim = self.task.build_model(0).embed_dim
        return self._embed_dim

    def init_server_state(self, ctx: Context):
        d = self.embed_dim()
        return {"protos": torch.zeros(self.task.num_classes, d), "mask": torch.zeros(self.task.num_classes, dtype=torch.bool)}

    def broadcast(self, server_state, ctx: Context):
        mask = server_state["mask"]
        if not bool(mask.any()):
            return {}  # round 0: no global prototypes yet, clients train with CE only
        classes = torch.nonzero(mask).flatten()
        return {"global_protos": Message("global_prototypes", {"protos": server_state["protos"][classes].clone(),
                                                               "classes": classes})}

    def async_mix(self, server_state, target, weight, ctx: Context):
        """Staleness-weighted prototypes (server.mode: async): a class both states hold moves ``weight`` of the way
        to the target's prototype; a class only the target holds (first seen) takes it; the others stay."""
        old, new = server_state["protos"], target["protos"]
        both = server_state["mask"] & target["mask"]
        protos = new.clone()
        protos[both] = old[both] + (new[both] - old[both]) * weight
        return {"protos": protos, "mask": server_state["mask"] | target["mask"]}

    def aggregate(self, server_state, uploads, ctx: Context):
        ids = sorted(uploads)
        if not ids:
            return server_state, {}
        ups = [(uploads[i]["protos"]["classes"], uploads[i]["protos"]["protos"], uploads[i]["protos"]["counts"]) for i in ids]
        protos, mask = aggregate_prototypes(ups, self.task.num_classes, self.embed_dim(), self.params.proto_agg)
        protos, mask = moved_like(protos, server_state["protos"]), moved_like(mask, server_state["mask"])
        # keep prototypes of classes nobody uploaded this round (partial participation)
        keep = server_state["mask"] & ~mask
        protos[keep] = server_state["protos"][keep]
        return {"protos": protos, "mask": mask | server_state["mask"]}, {"num_global_protos": float((mask | server_state["mask"]).sum())}

    def merge_uploads(self, uploads):
        """A partial aggregate of the paper's weighted rule: per class sum_i n_ic p_ic / sum_i n_ic with the summed
        counts (an upload of the same form). The ``mean`` rule (the official code) weighs clients, not samples: a
        merged upload cannot carry it, so it is not merged."""
        if not uploads or self.params.proto_agg != "weighted":
            return None
        ups = [(u["protos"]["classes"], u["protos"]["protos"], u["protos"]["counts"]) for _, u in sorted(uploads.items())]
        protos, mask = aggregate_prototypes(ups, self.task.num_classes, self.embed_dim(), "weighted")
        counts = torch.zeros(self.task.num_classes, dtype=torch.int64, device=mask.device)
        for classes, _, n in ups:
            counts.index_add_(0, classes.to(mask.device), n.to(mask.device, torch.int64))
        classes = torch.nonzero(mask).flatten()  # the merged classes (one host read per step on a GPU)
        return {"protos": Message("prototypes", {"protos": protos[classes], "classes": classes,
                                                 "counts": counts[classes]})}

    # -- client -------------------------------------------------------------------------------------------------
    @staticmethod
    def unpack(payload, num_classes, dim, device):
        protos = torch.zeros(num_classes, dim, device=device)
        mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
        if "global_protos" in payload:
            c = payload["global_protos"]["classes"].to(device)
            protos[c] = payload["global_protos"]["protos"].to(device)
            mask[c] = True
        return protos, mask

    def unpack_shared(self, payload, dim, device):
        """:meth:`unpack` once per broadcast: every client of a step downloads the same message, so its dense
        prototypes and mask are built for the first and shared (read-only) by the others. Returns (protos, mask,
        the number of classes with a prototype -- known on the host from the message's shape)."""
        msg = payload.get("global_protos")
        key = (msg, dim, torch.device(device))
        hit = getattr(self, "_unpacked", None)
        if hit is None or hit[0][0] is not msg or hit[0][1:] != key[1:]:
            protos, mask = self.unpack(payload, self.task.num_classes, dim, device)
            known = 0 if msg is None else int(msg["classes"].numel())
            hit = self._unpacked = (key, (protos, mask, known))
        return hit[1]

    def build_client_model(self, client_id: int):
        """A fresh model for a client (its initial weights)."""
        return self.task.build_model(client_id)

    def init_client_state(self, ctx: Context):
        return {"model": clone_state(self.build_client_model(ctx.client_id))}

    def client_regulariser(self, z, y, protos, mask):
        """The prototype term of the local objective: FedProto's nn.MSELoss(z, P_y) (``mask`` None: every class has
        a global prototype). FedTGP overrides it (``client_reg``)."""
        return prototype_regulariser(z, y, protos, mask)

    def make_loss(self, protos, mask, collect=None, pu=None, known=None):
        """The local objective. ``known``: how many classes have a global prototype, when the host knows it (no
        read of ``mask``; with every class known the regulariser's target is P_y without the mask)."""
        lam = self.params.lam
        use_protos = (known > 0 if known is not None else bool(mask.any())) and lam > 0
        reg_mask = None if known == self.task.num_classes else mask

        def loss_fn(model, xb, yb, epoch):
            logits, z = model(xb, return_embedding=True)
            if pu is None:
                ce = F.cross_entropy(logits, yb)
                parts = {"ce": ce.detach()}
            else:  # yb are observed labels: UNLABELLED rows only enter the PU term
                ce, parts = fedpu.pu_objective(logits, yb, pu, self.params.pu_weight)
                lab = yb >= 0
                z, yb = z[lab], yb[lab]
            if collect is not None:
                collect(z.detach(), yb, epoch)
            if not use_protos or yb.numel() == 0:
                return ce, {**parts, "proto": 0.0}
            reg = self.client_regulariser(z, yb, protos, reg_mask)
            return ce + lam * reg, {**parts, "proto": reg.detach()}

        return loss_fn

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        protos, mask, known = self.unpack_shared(payload, model.embed_dim, data.y_train.device)
        pu = fedpu.make_view(data, self.task.num_classes, self.task.seed, self.params)
        aux = {"protos": protos, "mask": mask, "known": known, "pu": pu, "collect": None}
        if self.params.proto_collect == "during_train":
            # official code: embeddings of the last local epoch, in train mode while the weights move (one optimiser
            # for all epochs: momentum carries on into the collecting epoch)
            cfg = self.task.train
            aux["collect"] = {"epoch": epoch_count(cfg, data.num_train, cfg.local_epochs) - 1, "z": [], "y": []}
        # unlabelled samples carry UNLABELLED, not their label; the client's own weights are the start (loaded by
        # the executor: LocalStart.weights)
        return LocalStart(y=None if pu is None else pu.y_obs, aux=aux, weights=state["model"])

    def objective(self, start: LocalStart):
        a = start.aux
        collect = None
        if a["collect"] is not None:
            box = a["collect"]

            def collect_on(z, y, epoch):  # a side effect: such a client is not vectorizable
                if epoch == box["epoch"]:
                    box["z"].append(z)
                    box["y"].append(y)

            collect = collect_on
        return self.make_loss(a["protos"], a["mask"], collect, pu=a["pu"], known=a.get("known"))

    def vectorizable(self, start: LocalStart) -> bool:
        # the global prototypes come from the broadcast; FedPU's view is per client and during_train collects the
        # last epoch's embeddings as a side effect of the objective (not pure): those run in the per-client loop
        return start.aux["pu"] is None and start.aux["collect"] is None

    def client_final(self, model, start, payload, state, data, ctx: Context):
        a = start.aux
        if a["collect"] is not None:
            z, y = torch.cat(a["collect"]["z"]), torch.cat(a["collect"]["y"])
        else:
            _, z = forward_all(model, data.x_train)
            y = data.y_train if a["pu"] is None else a["pu"].y_obs
            if a["pu"] is not None:
                z, y = z[a["pu"].labelled], y[a["pu"].labelled]
        if a["collect"] is None and a["pu"] is None:  # all training labels: their classes are known on the host
            classes, local, counts = known_class_prototypes(z, y, data.classes, self.task.num_classes)
        else:
            classes, local, counts = class_prototypes(z, y, self.task.num_classes)
        # the upload stays on the device until it leaves the runner (the server's rule reads it on the host)
        upload = {"protos": Message("prototypes", {"protos": local, "classes": classes, "counts": counts})}
        return {"model": clone_state(model)}, upload

    def client_final_group(self, group):
        """client_final for a vectorised group with data of one shape and a model with a grouped form: the new
        states are rows of the trained stacks, the prototypes come from one grouped forward of every client's
        training data and one index_add over all clients' classes
        (:func:`raysim.shared_maths.group_class_prototypes`)."""
        if type(self).client_final is not FedProto.client_final or any(
                s.aux["collect"] is not None or s.aux["pu"] is not None for s in group.starts):
            return None
        xs, ys = [d.x_train for d in group.datas], [d.y_train for d in group.datas]
        if len({(tuple(x.shape), x.device) for x in xs}) != 1 or len({tuple(y.shape) for y in ys}) != 1:
            return None
        out = grouped_embeddings(group.model, group.trained, torch.stack(xs))
        if out is None:
            return None
        protos = group_class_prototypes(out[1], torch.stack(ys), [d.classes for d in group.datas],
                                        self.task.num_classes)
        return [({"model": w}, {"protos": Message("prototypes", {"protos": p, "classes": c, "counts": n})})
                for w, (c, p, n) in zip(rows_of(group.state_stacks()), protos)]

    def evaluate_group(self, payloads, states, datas, ctxs):
        """evaluate_client for clients of one architecture with a grouped form, test sets of one shape and one
        broadcast: one grouped forward of every client's test set under its own weights
        (:func:`raysim.runner.grouped.grouped_embeddings`), the prototype classifier over each client's candidate classes
        as one batched distance (the per-client arithmetic, element for element); one host read for the group (which
        clients have a candidate class). None: evaluate_client per client."""
        if type(self).evaluate_client is not FedProto.evaluate_client:
            return None
        model = self.live_model(ctxs[0])
        msg = payloads[0].get("global_protos")
        if any(self.live_model(c) is not model for c in ctxs[1:]) or any(p.get("global_protos") is not msg
                                                                         for p in payloads[1:]):
            return None
        xs, ys = [d.x_test for d in datas], [d.y_test for d in datas]
        if len({(tuple(x.shape), x.device) for x in xs}) != 1 or not ys[0].numel():
            return None
        out = grouped_embeddings(model, stack_weights(model, [s["model"] for s in states]), torch.stack(xs))
        if out is None:
            return None
        logits, z = out
        y = torch.stack(ys)
        n = int(y.shape[1])
        acc = ((logits.argmax(2) == y).sum(1).to(torch.float64) / n).unbind()
        protos, mask = self.unpack(payloads[0], self.task.num_classes, model.embed_dim, z.device)
        cand = mask.unsqueeze(0).expand(len(datas), -1).clone()
        if self.params.restrict_local_classes:
            local = torch.zeros_like(cand)
            flat = [i * cand.shape[1] + int(c) for i, d in enumerate(datas) for c in d.classes]
            local.view(-1)[torch.as_tensor(flat, dtype=torch.int64).to(cand.device)] = True
            cand &= local
        d2 = ((z.unsqueeze(2) - protos.unsqueeze(0).unsqueeze(0)) ** 2).mean(dim=3)  # [K, n, C]: nearest_prototype's
        pred = d2.masked_fill(~cand.unsqueeze(1), float("inf")).argmin(dim=2)
        proto_acc = ((pred == y).sum(1).to(torch.float64) / n).unbind()
        has = cand.any(1).tolist()  # one read for the group (the loop reads it per client)
        return [{"test_acc": (a, float(n)), **({"test_acc_proto": (p, float(n))} if h else {})}
                for a, p, h in zip(acc, proto_acc, has)]

    def evaluate_client(self, payload, state, data, ctx: Context) -> dict:
        model = self.live_model(ctx)
        model.load_state_dict(state["model"])
        logits, z = forward_all(model, data.x_test)
        out = {"test_acc": device_accuracy(logits.argmax(1), data.y_test)}
        protos, mask, known = self.unpack_shared(payload, model.embed_dim, z.device)
        cand = mask.clone()
        if self.params.restrict_local_classes:
            local = torch.zeros_like(mask)
            local[torch.as_tensor(data.classes, device=mask.device)] = True
            cand &= local
            has = bool(self.host_classes(payload) & set(data.classes))
        else:
            has = known > 0
        if has:  # known on the host (one read per broadcast, not one per client)
            out["test_acc_proto"] = device_accuracy(nearest_prototype(z, protos, cand), data.y_test)
        return out

    def host_classes(self, payload) -> frozenset:
        """The classes the broadcast's global prototypes cover, on the host: read once per broadcast message."""
        msg = payload.get("global_protos")
        if msg is None:
            return frozenset()
        hit = getattr(self, "_host_classes", None)
        if hit is None or hit[0] is not msg:
            hit = self._host_classes = (msg, frozenset(int(c) for c in msg["classes"].tolist()))
        return hit[1]
