"""MAFML's own baselines (seed 003, §4.1.1): IND and AGG, on the four-way local split (``data.local_split``).

* ``ind`` — each node alone: cross-entropy with Adam on its own private + public data (``x_train``), no communication
  (the ``local`` method under its seed name; "IND's performance does not depend on alpha" holds because the node
  trains on private + public, 75% of its samples, whatever the public share).
* ``agg`` — each node trains with cross-entropy on its own private + public data *and every other node's public
  share* (read from the public dataset, which every node may read); no model or label exchange, CE only.

Both train ``train.local_steps`` minibatch steps per round (the seed validates every 50 iterations) with the optimiser
state kept across rounds (``train.persist_optimizer``), and report the seed's bwt / fwt / acc_all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from algorithms.local import Local
from algorithms.mafml import require_public_shares
from algorithms.mutual_maths import public_shares
from raysim.algorithm import Context, LocalStart


class Ind(Local):
    name = "ind"
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = "Baseline IND of MAFML's seed (Zhou et al. 2023, §4.1.1): each node alone on its private + public data"


class Agg(Local):
    name = "agg"
    headline = ("test_acc", "test_acc_all")  # own domain; all domains (with data.local_split)
    paper = ("Baseline AGG of MAFML's seed (Zhou et al. 2023, §4.1.1): own private + public data plus every other "
             "node's public share, CE only")

    @dataclass(frozen=True)
    class Params:
        pass

    def validate(self):
        require_public_shares(self, self.name)

    def vectorizable(self, start) -> bool:
        return True  # plain cross-entropy on LocalStart.x/y (own data, public data, the others' public shares)

    def client_init(self, model, payload, state, data, ctx: Context) -> LocalStart:
        """Local's start, training on the node's own private + public data and every other node's public share."""
        px, py, own = public_shares(self.task, ctx)
        others = torch.cat([own[j] for j in range(self.task.num_clients) if j != ctx.client_id])
        start = super().client_init(model, payload, state, data, ctx)
        return replace(start, x=torch.cat([data.x_train, px[others]]), y=torch.cat([data.y_train, py[others]]))
