"""Multi-seed runs: the same config once per seed, one run directory and one result table per run."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from raysim.config import ExperimentConfig
from raysim.errors import ConfigError


MAX_SEEDS = 10_000


def parse_seeds(text: str, field: str = "--seeds") -> list[int]:
    """``"1,2,3"`` or ``"1-5"`` or a mix (``"1-3,10"``) -> distinct seeds in the given order."""
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                a, b = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                if hi - lo + 1 + len(seeds) > MAX_SEEDS:
                    raise ConfigError(field, f"{text!r} asks for more than {MAX_SEEDS} seeds")
                seeds += range(lo, hi + 1)
            else:
                seeds.append(int(part))
        except ConfigError:
            raise
        except ValueError:
            raise ConfigError(field, f"{text!r} is not a seed list; write e.g. 1,2,3 or 1-5") from None
    if len(seeds) > MAX_SEEDS:
        raise ConfigError(field, f"{text!r} asks for more than {MAX_SEEDS} seeds")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(field, f"{text!r} repeats a seed")
    return seeds


def run_seeds(cfg: ExperimentConfig, seeds: list[int], out_dir: Optional[str | Path] = None,
              progress: Optional[bool] = None, log: Callable = print):
    """Run ``cfg`` once per seed. ``out_dir``: a parent directory that receives one ``seed<N>`` directory per run
    (default: each run's own ``output.dir/<run id>``, the run id already names the seed). Returns the RunResults."""
    from raysim.engine.prepare import prepare
    from raysim.engine.loop import run_experiment

    # every seed's data and partition are checked before the first run starts; each run then uses its preparation
    # (released once the run is done)
    preps = [prepare(replace(cfg, seed=int(s))) for s in seeds]
    out = []
    for i, c in enumerate([p.cfg for p in preps]):
        target = Path(out_dir) / f"seed{c.seed}" if out_dir else None
        prep, preps[i] = preps[i], None
        res = run_experiment(c, out_dir=target, progress=progress, prepared=prep)
        del prep
        mean, std = res.final("test_acc")
        log(f"seed {c.seed}: final mean local test accuracy {mean:.4f} ± {std:.4f} (sample std over clients) "
            f"-> {res.out_dir}")
        out.append(res)
    return out
