"""Named environment presets (raw ``env`` mappings; keys given next to ``preset`` override them).

* ``uniform``: identical, always-available devices on a good network, no dropout, no deadline: the simulated clock
  then only reflects the data size and the bytes a method sends.
* ``mobile-heterogeneous``: a phone fleet. Compute speed lognormal (median 1, sigma 0.6, i.e. the middle 68% of
  devices within 0.55x-1.8x), three memory tiers (30% / 50% / 20%), LTE-like links (median 10 Mbit/s down,
  2 Mbit/s up, lognormal sigma 0.8; 30-300 ms latency; 20% per-round bandwidth jitter), 80% availability per round,
  5% mid-round dropout, 10% stragglers at 4x slowdown, 30% over-selection (FedScale's default, Lai et al. 2022).
  The numbers are plausible orders of magnitude for a phone fleet, not measurements.
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    "uniform": {
        "devices": {"speed": 1.0, "sample_s": 0.005, "jitter": 0.0, "tier": 0},
        "network": {"latency_s": 0.02, "down_mbps": 100.0, "up_mbps": 100.0, "jitter": 0.0},
        "participation": {"availability": {"mode": "always"}, "dropout": 0.0, "straggler_p": 0.0,
                          "straggler_slowdown": 1.0, "deadline_s": None, "over_selection": 1.0},
    },
    "mobile-heterogeneous": {
        "devices": {"speed": {"dist": "lognormal", "median": 1.0, "sigma": 0.6}, "sample_s": 0.005, "jitter": 0.1,
                    "tier": {"dist": "choice", "values": [0, 1, 2], "probs": [0.3, 0.5, 0.2]}},
        "network": {"latency_s": {"dist": "uniform", "low": 0.03, "high": 0.3},
                    "down_mbps": {"dist": "lognormal", "median": 10.0, "sigma": 0.8},
                    "up_mbps": {"dist": "lognormal", "median": 2.0, "sigma": 0.8}, "jitter": 0.2},
        "participation": {"availability": {"mode": "bernoulli", "p": 0.8}, "dropout": 0.05, "straggler_p": 0.1,
                          "straggler_slowdown": 4.0, "deadline_s": None, "over_selection": 1.3},
    },
}
