"""Environment layer (SPEC section 5): device heterogeneity (compute speed, memory tier), network (latency,
bandwidth; communication time from accounted message bytes), participation (availability, dropout, stragglers,
deadline with over-selection) and a simulated wall clock, deterministic from (seed, round, client).

Enabled by an ``env`` section in the experiment config (``env: {preset: mobile-heterogeneous}``); raysim reaches
this package only through ``raysim.config.registry``. Every key, with its default::

    env:
      preset: null                 # uniform | mobile-heterogeneous (the keys below override it)
      devices:  {speed: 1.0, sample_s: 0.005, ref_params: null, jitter: 0.0, tier: 0}
      network:  {latency_s: 0.05, down_mbps: 20.0, up_mbps: 5.0, jitter: 0.0}
      participation:
        availability: {mode: always, p: 1.0, low: 0.2, high: 0.9, period_s: null, phase: random}
        dropout: 0.0
        straggler_p: 0.0
        straggler_slowdown: 1.0
        deadline_s: null
        over_selection: 1.0
        idle_s: 60.0
      trace: {devices: null, availability: null, mapping: random}
      server_s: 0.0

Quantities of devices (speed, tier, latency_s, down_mbps, up_mbps) take a number or a distribution
(``{dist: lognormal, median: 2.0, sigma: 0.8}``; see envs/config.py).
"""
from envs.clock import resolve_round
from envs.config import EnvConfig, parse_env
from envs.environment import Environment, RoundOutcome
from envs.presets import PRESETS

__all__ = ["Environment", "EnvConfig", "PRESETS", "RoundOutcome", "parse_env", "resolve_round"]
