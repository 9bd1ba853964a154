"""The ``train``, ``algorithm`` and ``eval`` sections: local training, the method and its parameters, evaluation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, choice, positive


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: int = 1
    batch_size: int = 4
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    persist_optimizer: bool = False  # keep each client's optimizer state (momentum) across rounds
    local_steps: Optional[int] = None  # exactly this many minibatch steps per round (epochs of shuffled batches
    #                                    continued as needed) instead of local_epochs; None: local_epochs

    def check(self, path: str) -> None:
        positive(_p(path, "local_epochs"), self.local_epochs)
        positive(_p(path, "batch_size"), self.batch_size)
        positive(_p(path, "lr"), self.lr)
        positive(_p(path, "momentum"), self.momentum, allow_zero=True)
        positive(_p(path, "weight_decay"), self.weight_decay, allow_zero=True)
        choice(_p(path, "optimizer"), self.optimizer, ["sgd", "adam"])
        if self.local_steps is not None:
            if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int):
                raise ConfigError(_p(path, "local_steps"), f"must be a positive integer, got {self.local_steps!r}")
            positive(_p(path, "local_steps"), self.local_steps)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "fedproto"
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 1  # evaluate every N rounds (the last round is always evaluated)
    fraction: float = 1.0  # share of the clients evaluated per evaluation round (a seeded sample; huge populations)

    def check(self, path: str) -> None:
        positive(_p(path, "every"), self.every)
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(_p(path, "fraction"), f"must be in (0, 1], got {self.fraction}")
