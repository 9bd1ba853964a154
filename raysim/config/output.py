"""The ``output`` section: where a run is written, checkpoints, progress, trackers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, positive


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs"
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2  # the newest N round checkpoints stay (older ones are removed); 0: every one stays
    progress: Any = True  # true (auto): a tqdm bar when stderr is a terminal, else one line per evaluated round (a
    #                       log file gets no \r frames) | bar | lines | false (none)
    tensorboard: Optional[str] = None  # a directory: TensorBoard event files per run (raysim/engine/tracking.py)
    mlflow: Optional[str] = None  # an MLflow tracking URI (file:///path/mlruns, http://host:5000): one MLflow run each
    wandb: Optional[str] = None  # a directory: Weights & Biases offline runs (DIR/wandb/offline-run-*; wandb sync)

    def check(self, path: str) -> None:
        positive(_p(path, "checkpoint_every"), self.checkpoint_every, allow_zero=True)
        positive(_p(path, "keep_checkpoints"), self.keep_checkpoints, allow_zero=True)
        if not (isinstance(self.progress, bool) or self.progress in ("auto", "bar", "lines")):
            raise ConfigError(_p(path, "progress"), f"{self.progress!r} is not allowed; choose one of: auto, bar, "
                                                    f"lines, true, false")
        for key in ("tensorboard", "mlflow", "wandb"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(_p(path, key), f"must be a {'tracking URI' if key == 'mlflow' else 'directory'}"
                                                 f" (text), got {v!r}")
