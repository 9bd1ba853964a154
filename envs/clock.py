"""The simulated round clock (no sleeping): when a round closes and whose uploads make it.

The server waits until the first K selected clients have uploaded, or the deadline passes, or every selected client
has either uploaded or dropped out, whichever comes first (FedScale's over-selection: select more than K, keep the
first K to finish; Lai et al., "FedScale", ICML 2022). Times are seconds since the round started.
"""
from __future__ import annotations

import math
from typing import Optional


def resolve_round(finish: dict[int, float], gone: dict[int, float], k: int,
                  deadline_s: Optional[float]) -> tuple[float, list[int], list[int]]:
    """``finish``: client -> time its upload arrives; ``gone``: client -> time it dropped out (its upload never comes).
    Returns (round duration, kept clients sorted by id, late clients sorted by id). Ties in arrival time are broken
    by client id. With no client at all the round lasts 0 (the caller adds idle time)."""
    order = sorted(finish, key=lambda c: (finish[c], c))
    t_k = finish[order[k - 1]] if 0 < k <= len(order) else math.inf
    times = list(finish.values()) + list(gone.values())
    t_all = max(times) if times else 0.0
    end = min(t_k, t_all, math.inf if deadline_s is None else deadline_s)
    kept = [c for c in order if finish[c] <= end][: max(k, 0)]
    late = sorted(set(order) - set(kept))
    return float(end), sorted(kept), late
