"""The search-space file of ``raysim tune``: which config keys to tune, the objective, pruner, sampler.

Example (``configs/tune_fedproto_lam.yaml``)::

    params:                      # dotted config key -> distribution
      algorithm.params.lam: {type: float, low: 0.01, high: 100.0, log: true}
    objective:
      metric: test_acc           # a client-scope metric; its mean over clients per evaluated round
      mode: final                # final | best | time_to_target
      target: 0.9                # time_to_target: the accuracy to reach
      time: round                # time_to_target: round | bytes | any total/server-scope metric summed per round
    pruner: {name: median, n_startup_trials: 3, n_warmup_steps: 1}
    sampler: {name: tpe, seed: 0}
    trial_seed: config           # config: every trial runs the config's seed; trial: seed + trial number
    trial_resources: {num_cpus: 1, num_gpus: 0}   # per trial with --parallel (Ray tasks)
    allow_test_metric: false     # default: a test_* metric is read as val_* (needs data.val_fraction > 0)

The file is validated like an experiment config: every problem is one :class:`raysim.config.ConfigError` naming the
dotted field (``space.params.<key>.low`` ...), raised before the study touches its storage.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from raysim.config import choice, from_dict, load_yaml_mapping, make_config, positive, set_dotted, to_dict
from raysim.config.yamlio import switch_method
from raysim.errors import ConfigError

PRUNERS = ("none", "median", "percentile", "successive_halving")
SAMPLERS = ("tpe", "random", "grid")
MODES = ("final", "best", "time_to_target")


@dataclass(frozen=True)
class ParamSpec:
    type: str = "float"  # float | int | categorical
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: Optional[list[Any]] = None

    def check(self, path: str) -> None:
        choice(f"{path}.type", self.type, ["float", "int", "categorical"])
        if self.type == "categorical":
            if not self.choices:
                raise ConfigError(f"{path}.choices", "a categorical parameter needs a non-empty list of choices")
            return
        for name in ("low", "high"):
            if getattr(self, name) is None:
                raise ConfigError(f"{path}.{name}", f"a {self.type} parameter needs low and high")
        if not self.low < self.high:
            raise ConfigError(f"{path}.high", f"must be greater than low ({self.low}), got {self.high}")
        if self.log and self.low <= 0:
            raise ConfigError(f"{path}.low", f"must be > 0 with log: true, got {self.low}")
        if self.log and self.step is not None:
            raise ConfigError(f"{path}.step", "cannot be combined with log: true")
        if self.step is not None:
            positive(f"{path}.step", self.step)
        if self.type == "int":
            for name in ("low", "high", "step"):
                v = getattr(self, name)
                if v is not None and not float(v).is_integer():
                    raise ConfigError(f"{path}.{name}", f"must be a whole number for an int parameter, got {v}")

    def suggest(self, trial, key: str):
        if self.type == "categorical":
            return trial.suggest_categorical(key, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(key, float(self.low), float(self.high), step=self.step, log=self.log)

    def corners(self) -> list:
        """Values that must all be valid config values (checked before the study starts)."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            return [int(self.low), int(self.high)]
        lo, hi = float(self.low), float(self.high)
        inner = [] if self.step else [v for v in (lo + (hi - lo) / math.pi,) if lo < v < hi and not v.is_integer()]
        return [lo, hi] + inner  # a value between them too: a float range on an integer key fails here, not in a trial


@dataclass(frozen=True)
class ObjectiveSpec:
    metric: str = "test_acc"
    mode: str = "final"
    target: Optional[float] = None
    time: str = "round"
    miss_penalty: float = 2.0  # time_to_target never reached: value = miss_penalty x the whole run's time

    def check(self, path: str) -> None:
        choice(f"{path}.mode", self.mode, MODES)
        if self.mode == "time_to_target" and self.target is None:
            raise ConfigError(f"{path}.target", "time_to_target needs a target value of the metric")
        positive(f"{path}.miss_penalty", self.miss_penalty)

    @property
    def direction(self) -> str:
        return "minimize" if self.mode == "time_to_target" else "maximize"


@dataclass(frozen=True)
class PrunerSpec:
    name: str = "median"
    n_startup_trials: int = 3
    n_warmup_steps: int = 0  # a round index: no pruning before this round
    percentile: float = 25.0  # percentile pruner only
    min_resource: int = 1  # successive_halving only (in rounds)
    reduction_factor: int = 3  # successive_halving only

    def check(self, path: str) -> None:
        choice(f"{path}.name", self.name, PRUNERS)
        positive(f"{path}.n_startup_trials", self.n_startup_trials, allow_zero=True)
        positive(f"{path}.n_warmup_steps", self.n_warmup_steps, allow_zero=True)
        if not 0.0 < self.percentile < 100.0:
            raise ConfigError(f"{path}.percentile", f"must be in (0, 100), got {self.percentile}")
        positive(f"{path}.min_resource", self.min_resource)
        if self.reduction_factor < 2:
            raise ConfigError(f"{path}.reduction_factor", f"must be >= 2, got {self.reduction_factor}")

    def build(self):
        import optuna

        if self.name == "none":
            return optuna.pruners.NopPruner()
        if self.name == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.n_startup_trials, n_warmup_steps=self.n_warmup_steps)
        if self.name == "percentile":
            return optuna.pruners.PercentilePruner(self.percentile, n_startup_trials=self.n_startup_trials,
                                                   n_warmup_steps=self.n_warmup_steps)
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=self.min_resource,
                                                      reduction_factor=self.reduction_factor)


@dataclass(frozen=True)
class SamplerSpec:
    name: str = "tpe"
    seed: Optional[int] = 0
    n_startup_trials: int = 5  # tpe: random trials before the model kicks in

    def check(self, path: str) -> None:
        choice(f"{path}.name", self.name, SAMPLERS)
        positive(f"{path}.n_startup_trials", self.n_startup_trials, allow_zero=True)

    def build(self, resumed_at: int = 0, grid: Optional[dict] = None):
        """``resumed_at``: trials already in the study. A resumed study reseeds its sampler from (seed, resumed_at),
        so it does not replay the draws of the first session (identical parameters twice). ``grid``: the search
        space as {key: choices} (``name: grid``; every point once, in a seeded order; a resumed study runs the points
        not yet visited)."""
        import optuna

        if self.name == "grid":
            return _GridSampler(grid or {}, seed=self.seed)

        from raysim.rng import derive_seed

        seed = self.seed
        if seed is not None and resumed_at:
            seed = derive_seed(seed, resumed_at, -1, "sampler") % 2**32
        if self.name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.n_startup_trials)


def _grid_sampler_class():
    import optuna

    class GridSampler(optuna.samplers.GridSampler):
        """Optuna's grid sampler without its ``study.stop()`` when the grid is exhausted (that call is only legal
        inside ``study.optimize``; raysim runs ask/tell and asks for at most the grid's size)."""

        def after_trial(self, study, trial, state, values) -> None:
            return None

    return GridSampler


def _GridSampler(grid: dict, seed=None):
    return _grid_sampler_class()(grid, seed=seed)


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def check(self, path: str) -> None:
        positive(f"{path}.num_cpus", self.num_cpus, allow_zero=True)
        positive(f"{path}.num_gpus", self.num_gpus, allow_zero=True)


@dataclass(frozen=True)
class SearchSpace:
    params: dict = field(default_factory=dict)  # dotted key -> ParamSpec (converted in parse_space)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    trial_seed: str = "config"
    trial_resources: Resources = field(default_factory=Resources)
    allow_test_metric: bool = False  # select on test_* metrics as written (biased; a warning is printed)

    def check(self, path: str) -> None:
        choice(f"{path}.trial_seed", self.trial_seed, ["config", "trial"])
        if not self.params:
            raise ConfigError(f"{path}.params", "name at least one config key to tune, e.g. algorithm.params.lam")
        if self.sampler.name == "grid":
            for key, spec in self.params.items():
                if spec.type != "categorical":
                    raise ConfigError(f"{path}.params.{key}.type", "sampler grid needs every parameter categorical "
                                                                   f"(a list of choices), got {spec.type}")

    @property
    def grid(self) -> Optional[dict]:
        """{key: choices} for ``sampler: {name: grid}``, else None."""
        if self.sampler.name != "grid":
            return None
        return {key: list(spec.choices) for key, spec in self.params.items()}

    @property
    def grid_size(self) -> Optional[int]:
        return None if self.grid is None else math.prod(len(v) for v in self.grid.values())

    def build_sampler(self, resumed_at: int = 0):
        return self.sampler.build(resumed_at=resumed_at, grid=self.grid)

    def to_dict(self) -> dict:
        d = to_dict(self)
        d["params"] = {k: to_dict(v) for k, v in self.params.items()}
        return d

    def space_hash(self) -> str:
        """Identity of what a study searches (not of how it runs it): a resumed study must match it."""
        d = self.to_dict()
        d.pop("trial_resources")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]

    def suggest(self, trial) -> dict:
        return {key: spec.suggest(trial, key) for key, spec in self.params.items()}


def parse_space(data: dict | None, path: str = "space") -> SearchSpace:
    data = dict(data or {})
    raw = data.pop("params", None)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}.params", f"expected a mapping of dotted config key -> distribution, got {raw!r}")
    params = {str(k): from_dict(ParamSpec, v, f"{path}.params.{k}") for k, v in (raw or {}).items()}
    space = from_dict(SearchSpace, {**data, "params": params}, path)
    return space


def load_space(path: str | Path) -> SearchSpace:
    data = load_yaml_mapping(path, "--space", what="search space")
    try:
        return parse_space(data)
    except ConfigError as e:  # name the file too: the space file is the only source of these keys
        msg = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise ConfigError(e.field, f"{msg} (in --space {path})") from None


def resolve_objective(space: SearchSpace, cfg, log=print) -> SearchSpace:
    """Honest selection: a ``test_*`` objective metric is read on the validation split (``val_*``) unless the space
    sets ``allow_test_metric: true`` (then a warning says that selection on test data is biased). A validation
    objective needs a base config with ``data.val_fraction > 0``: tuning refuses otherwise (it never changes the
    clients' training data silently)."""
    import dataclasses

    metric = space.objective.metric
    if space.allow_test_metric:
        if metric.startswith("test_"):
            log(f"WARNING: the objective {metric!r} is read on the test data (allow_test_metric: true): the selected "
                f"configuration's test accuracy is biased upwards; report it on other seeds or use a validation split")
        return space
    if metric.startswith("test_"):
        metric = "val_" + metric[len("test_"):]
    if metric.startswith("val_") and float(cfg.data.val_fraction) <= 0:
        raise ConfigError("data.val_fraction", f"tuning selects on the validation split ({metric!r}) but the base "
                                               f"config has none; set data.val_fraction (e.g. 0.2) in the config or "
                                               f"with --set data.val_fraction=0.2, or allow_test_metric: true in the "
                                               f"space (biased selection on test data)")
    return dataclasses.replace(space, objective=dataclasses.replace(space.objective, metric=metric))


_NOTICES: set = set()


def _notice_once(message: str) -> None:
    """A sweep's notice once per process, not once per trial."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        from raysim.config.yamlio import _stderr_notice

        _stderr_notice(message)


def apply_params(base: dict, params: dict, seed: Optional[int] = None):
    """The experiment config of one trial: ``base`` (a config dict) with the trial's values set by dotted key."""
    data = base
    for k, v in params.items():
        data = set_dotted(data, k, v)
    # a space that samples algorithm.name: the method's parameters reconciled as --set does (raysim.config.yamlio)
    data = switch_method(base, data, {k.split(".", 2)[2] for k in params if k.startswith("algorithm.params.")},
                         _notice_once)
    if seed is not None:
        data = set_dotted(data, "seed", int(seed))
    return make_config(data)


def check_against_config(space: SearchSpace, base: dict) -> None:
    """Every tuned key must exist in the config and every corner of its range must be a valid value."""
    from raysim.config.registry import algorithm_class

    cfg = make_config(base)
    algo = algorithm_class(cfg.algorithm.name)
    import dataclasses

    known = {f.name for f in dataclasses.fields(algo.Params)}
    for key, spec in space.params.items():
        if key.startswith("algorithm.params."):
            name = key.split(".", 2)[2]
            if name not in known:
                raise ConfigError(f"space.params.{key}", f"{cfg.algorithm.name} has no parameter {name!r}; "
                                                         f"allowed: {', '.join(sorted(known))}")
        for v in spec.corners():
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"space.params.{key}", f"range must be finite, got {v}")
            try:
                c = apply_params(base, {key: v})
                from_dict(algorithm_class(c.algorithm.name).Params, dict(c.algorithm.params), "algorithm.params")
            except ConfigError as e:
                raise ConfigError(f"space.params.{key}", f"value {v!r} is not a valid config value: {e}") from None


def trial_config(base: dict, space: SearchSpace, params: dict, trial_number: int):
    """The config dict of one trial: ``params`` set by dotted key on ``base``; with ``trial_seed: trial`` the seed
    is the base seed plus the trial number."""
    seed = None
    if space.trial_seed == "trial":
        seed = int(make_config(base).seed) + int(trial_number)
    return apply_params(base, params, seed)
