"""Verdicts from paired runs: ``raysim reproduce``'s claims table, ``raysim compare`` and ``raysim.results.paired``.

A claim says one method is better than another. Both ran with the same seeds (the same data, partition and
initialisation stream), so the evidence is the per-seed *paired* difference d_s = better_s - worse_s (sign flipped
when lower is better): its mean, and a 95 % interval mean +- t_{0.975, n-1} * sd / sqrt(n) (Student t with n - 1
degrees of freedom, sd the sample standard deviation of the d_s). The verdict:

* ``held``: the interval lies above 0 (excludes 0 in the claimed direction);
* ``tie``: the interval contains 0;
* ``reversed``: the interval lies below 0 (excludes 0 in the other direction);
* ``n too small``: fewer paired seeds than the experiment's minimum (``min_seeds``: at least 3; 5 where the seed
  paper ran 5) -- no verdict is given, whatever the numbers.

Power (issue 51): beside every tie, the interval's half-width is the smallest difference it could have excluded; a
tie whose seed's own difference lies inside the half-width (``|seed's difference| <= half-width``) is
``underpowered``: the runs could not have told the seed's effect from none (:func:`power`). Across the claims of one
seed, a Holm-corrected column (:func:`holm`, :func:`holm_verdict`) on the two-sided paired t-test's p-values
(:func:`p_value`; p < 0.05 is the same as the 95 % interval excluding 0).

What a run contributes (issue 51, fixed in advance): the mean of its last :data:`WINDOW` evaluated rounds
(:func:`window_mean`), the final round shown beside it; where the seed states its own rule (a validation-selected
checkpoint), that rule.

The t quantile is computed here (the exact Student t distribution function for integer degrees of freedom, inverted
by bisection): no statistics package is needed.
"""
from __future__ import annotations

import math
from typing import Mapping

HELD, TIE, REVERSED, TOO_FEW = "held", "tie", "reversed", "n too small"
UNDERPOWERED = "underpowered"
VERDICTS = (HELD, TIE, UNDERPOWERED, REVERSED, TOO_FEW)
LEVEL = 0.95
ALPHA = 1.0 - LEVEL
DEFAULT_MIN_SEEDS = 3
WINDOW = 5  # the last k evaluated rounds a run's verdict value averages (issue 51: k >= 5, fixed in advance)


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` (a positive integer) degrees of freedom, in closed form: with
    theta = atan(t / sqrt(df)), P(|T| < |t|) is (2/pi)(theta + sin(theta) sum_k c_k cos^(2k+1)(theta)) for odd df and
    sin(theta) sum_k c_k cos^(2k)(theta) for even df (Abramowitz & Stegun 26.7.3-4)."""
    df = int(df)
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        term, total = c, (c if df > 1 else 0.0)  # terms cos, (2/3) cos^3, (2*4)/(3*5) cos^5, ... up to cos^(df-2)
        for k in range(1, (df - 1) // 2):
            term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        a = (2.0 / math.pi) * (theta + s * total)
    else:
        term, total = 1.0, 1.0  # terms 1, (1/2) cos^2, (1*3)/(2*4) cos^4, ... up to cos^(df-2)
        for k in range(1, df // 2):
            term *= c * c * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    a = min(max(a, 0.0), 1.0)
    return 0.5 + a / 2 if t >= 0 else 0.5 - a / 2


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0 < p < 1), by bisection on :func:`t_cdf`
    to machine precision."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def paired_differences(better: Mapping[int, float], worse: Mapping[int, float],
                       lower_is_better: bool = False) -> dict[int, float]:
    """seed -> the claimed-direction difference (better - worse; worse - better when lower is better), over the seeds
    both methods have a finite value for."""
    sign = -1.0 if lower_is_better else 1.0
    out = {}
    for s in sorted(set(better) & set(worse)):
        b, w = better[s], worse[s]
        if b is None or w is None:
            continue
        b, w = float(b), float(w)
        if math.isfinite(b) and math.isfinite(w):
            out[int(s)] = sign * (b - w)
    return out


def interval(diffs, level: float = LEVEL) -> dict:
    """Mean, sample std, half-width and the ``level`` interval of the mean of ``diffs`` (Student t, n - 1 degrees of
    freedom); the interval is NaN below 2 values."""
    d = [float(x) for x in diffs]
    n = len(d)
    mean = sum(d) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "sd": math.nan, "t": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = t_quantile(0.5 + level / 2.0, n - 1)
    half = t * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "t": t, "half": half, "lo": mean - half, "hi": mean + half}


def verdict(lo: float, hi: float, n: int, min_n: int = DEFAULT_MIN_SEEDS) -> str:
    """``held`` (lo > 0), ``reversed`` (hi < 0), ``tie`` (lo <= 0 <= hi), or ``n too small`` (n < min_n)."""
    if n < max(int(min_n), 2) or not (math.isfinite(lo) and math.isfinite(hi)):
        return TOO_FEW
    if lo > 0:
        return HELD
    if hi < 0:
        return REVERSED
    return TIE


def judge(better: Mapping[int, float], worse: Mapping[int, float], lower_is_better: bool = False,
          min_n: int = DEFAULT_MIN_SEEDS, level: float = LEVEL, seed_diff: float = math.nan) -> dict:
    """The whole verdict of one claim from per-seed values of its two methods: the paired differences (by seed),
    n, mean, sd, the interval, the paired t-test's two-sided p-value and the verdict (a tie ``underpowered`` where
    ``seed_diff``, the seed's own difference in the claimed direction, lies inside the half-width: :func:`power`)."""
    diffs = paired_differences(better, worse, lower_is_better)
    out = interval(list(diffs.values()), level)
    out["diffs"] = diffs
    out["min_n"] = int(min_n)
    out["p"] = p_value(out) if out["n"] >= max(int(min_n), 2) else math.nan
    out["verdict"] = power(verdict(out["lo"], out["hi"], out["n"], min_n), out["half"], seed_diff)
    return out


def format_interval(res: dict, digits: int = 2, thousands: bool = False) -> str:
    """``+2.00 ± 2.48 [-0.48, +4.48]``; the mean alone below 2 seeds; '–' without any."""
    mean = res.get("mean", math.nan)
    if not (isinstance(mean, (int, float)) and math.isfinite(mean)):
        return "–"
    f = f"{{:+,.{digits}f}}" if thousands else f"{{:+.{digits}f}}"
    g = f"{{:,.{digits}f}}" if thousands else f"{{:.{digits}f}}"
    half = res.get("half", math.nan)
    if not math.isfinite(half):
        return f.format(mean)
    return f"{f.format(mean)} ± {g.format(half)} [{f.format(res['lo'])}, {f.format(res['hi'])}]"


def window_mean(curve: Mapping[int, float], k: int = WINDOW) -> tuple[float, int]:
    """One run's verdict value: the mean of its last ``k`` evaluated rounds (``curve``: round -> value; rounds with a
    non-finite value are left out), and how many rounds it averaged (all of them when the run evaluated fewer than
    ``k`` times); (NaN, 0) for an empty curve."""
    if k < 1:
        raise ValueError(f"the window must hold at least one round, got {k}")
    pts = sorted((int(r), float(v)) for r, v in curve.items() if v is not None and math.isfinite(float(v)))
    last = [v for _, v in pts[-k:]]
    return (sum(last) / len(last), len(last)) if last else (math.nan, 0)


def p_value(res: Mapping) -> float:
    """The two-sided p-value of the paired t-test behind an interval (``res``: :func:`interval`'s n, mean, sd): 2 P(T >
    |mean| sqrt(n) / sd), T Student's t with n - 1 degrees of freedom; 0 when every difference is the same non-zero
    number, 1 when they are all 0, NaN below 2 pairs. p < 1 - LEVEL exactly when the interval excludes 0."""
    n, mean, sd = res.get("n", 0), res.get("mean", math.nan), res.get("sd", math.nan)
    if n < 2 or not (math.isfinite(mean) and math.isfinite(sd)):
        return math.nan
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = abs(mean) * math.sqrt(n) / sd
    return min(1.0, 2.0 * (1.0 - t_cdf(t, n - 1)))


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: with the m finite p-values sorted p_(1) <= ... <=
    p_(m), p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). NaN (no verdict) stays NaN and is not counted in m."""
    ps = [float(p) for p in pvalues]
    order = sorted((i for i, p in enumerate(ps) if math.isfinite(p)), key=lambda i: ps[i])
    m = len(order)
    out = [math.nan] * len(ps)
    running = 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * ps[i]))
        out[i] = running
    return out


def power(verdict_: str, half: float, seed_diff: float) -> str:
    """A tie whose seed's own difference lies inside the half-width (``|seed_diff| <= half``) is ``underpowered``:
    the interval could not have excluded the seed's effect. Any other verdict, or a tie without a seed number (the
    half-width is then shown beside it), is returned unchanged."""
    if verdict_ == TIE and math.isfinite(seed_diff) and math.isfinite(half) and abs(seed_diff) <= half:
        return UNDERPOWERED
    return verdict_


def holm_verdict(mean: float, p_adj: float, alpha: float = ALPHA) -> str:
    """The verdict after Holm's correction: held / reversed when the adjusted p-value is below ``alpha`` (by the sign
    of the mean), tie otherwise; ``n too small`` without a p-value."""
    if not math.isfinite(p_adj):
        return TOO_FEW
    if p_adj < alpha and mean != 0:
        return HELD if mean > 0 else REVERSED
    return TIE


def combine(parts: list[dict], rule: str = "all") -> dict:
    """One verdict for a claim the seed makes over several comparisons (issue 51: one claim, one verdict), from its
    parts' verdicts (each a :func:`judge` result or a claims record: ``verdict``, ``p``, ``mean``):

    * ``all`` (the seed: "better than every one", "on all metrics"): held when every part is held (an
      intersection-union test: its p-value is the largest part's), reversed when any part is reversed (p: the
      smallest reversed part's), otherwise underpowered when any part is, else tie (p: the largest);
    * ``most`` (the seed: "for most settings", "usually"): held when more than half the parts are held and none is
      reversed, reversed when more than half are reversed, otherwise as ``all``'s tie.

    ``n too small`` when any part has no verdict. Returns ``verdict``, ``p`` (for Holm's column), ``sign`` (+1, or -1
    when reversed) and ``counts`` (the parts' verdicts)."""
    if rule not in ("all", "most"):
        raise ValueError(f"rule must be 'all' or 'most', got {rule!r}")
    vs = [p["verdict"] for p in parts]
    ps = [float(p.get("p", math.nan)) for p in parts]
    counts = count(vs)
    if not parts or counts[TOO_FEW]:
        return {"verdict": TOO_FEW, "p": math.nan, "sign": 1, "counts": counts}
    need = len(parts) if rule == "all" else len(parts) // 2 + 1
    if counts[REVERSED] and (rule == "all" or counts[REVERSED] >= need):
        return {"verdict": REVERSED, "p": min(p for p, v in zip(ps, vs) if v == REVERSED), "sign": -1,
                "counts": counts}
    if counts[HELD] >= need and not counts[REVERSED]:
        held = sorted(p for p, v in zip(ps, vs) if v == HELD)
        return {"verdict": HELD, "p": held[need - 1] if rule == "most" else max(ps), "sign": 1, "counts": counts}
    return {"verdict": UNDERPOWERED if counts[UNDERPOWERED] else TIE, "p": max(ps), "sign": 1, "counts": counts}


def count(verdicts) -> dict[str, int]:
    """How many of each verdict (every key of :data:`VERDICTS`, 0 included)."""
    out = {v: 0 for v in VERDICTS}
    for v in verdicts:
        out[v] = out.get(v, 0) + 1
    return out

