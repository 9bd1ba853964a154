"""Environment layer (SPEC section 5): device heterogeneity (compute speed, memory tier), network (latency,
bandwidth; communication time from accounted message bytes), participation (availability, dropout, stragglers,
deadline with over-selection) and a simulated wall clock, deterministic from (seed, round, client).

Enabled by an ``env`` section in the experiment config (``env: {preset: mobile-heterogeneous}``); raysim reaches
this package only through ``raysim.registry``.
"""
from envs.clock import resolve_round
from envs.config import EnvConfig, parse_env
from envs.environment import Environment, RoundOutcome
from envs.presets import PRESETS

__all__ = ["Environment", "EnvConfig", "PRESETS", "RoundOutcome", "parse_env", "resolve_round"]
