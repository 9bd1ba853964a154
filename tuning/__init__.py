"""Optuna integration: search spaces over dotted config keys (:mod:`tuning.space`) and persistent, resumable,
prunable studies whose trials are raysim runs (:mod:`tuning.study`). Imports raysim, never the reverse."""
from tuning.space import SearchSpace, load_space, parse_space
from tuning.study import TuneResult, open_storage, trials_frame, tune

__all__ = ["SearchSpace", "TuneResult", "load_space", "open_storage", "parse_space", "trials_frame", "tune"]
