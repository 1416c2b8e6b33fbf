"""Which differences of ``multihead compare`` are real: each kind against a baseline kind,
with a 95% confidence interval over seeds.

With the same seeds on both sides (compare's default: seed s gives every kind
the same batches) the interval is the paired one, a Student t interval of the
per-seed differences; otherwise Welch's interval. A kind whose interval holds
0 cannot be told apart from the baseline at this budget; the report then
estimates how many seeds would separate them if the observed difference and
spread held. With one seed, or a loss that is not finite (a run that diverged),
there is no interval.

The t quantiles come from the closed form of Student's t distribution for a
whole number of degrees of freedom (a finite sum; Abramowitz and Stegun
26.7.3-4), found by bisection; Welch's fractional degrees of freedom are
rounded down, which only widens the interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Difference", "difference", "t_quantile", "MOST_SEEDS"]

LEVEL = 0.95
MOST_SEEDS = 10_000  # seeds_needed above this is reported as None


def _t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` >= 1 degrees of freedom and t >= 0."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` >= 1 whole degrees of freedom."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while _t_central(high, df) < 2 * p - 1:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central(mid, df) < 2 * p - 1 else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Difference:
    """A kind's mean validation loss minus the baseline's (nats/token; below 0: better).

    Attributes:
        mean: the difference of the means.
        low, high: the 95% interval (None with one seed on a side, or a loss
            that is not finite).
        paired: True when the interval pairs equal seeds.
        separated: the interval leaves out 0 (None without an interval).
        seeds_needed: seeds per kind that would give an interval without 0 at the
            observed difference and spread (None when separated, without an
            interval, or when the difference is 0).
    """

    mean: float
    low: float | None
    high: float | None
    paired: bool
    separated: bool | None
    seeds_needed: int | None


def _seeds_needed(mean: float, spread: float, n: int, *, paired: bool) -> int | None:
    """The fewest seeds per kind whose interval leaves out 0, at difference ``mean``
    and per-seed standard deviation ``spread`` (of the differences when paired, of
    either kind's losses otherwise); None above ``MOST_SEEDS``.

    The t quantile exceeds the normal one z, so no m with z * width(m) >= |mean|
    separates: the search starts at the largest such m, a few steps below the answer.
    """
    if mean == 0:
        return None
    z = statistics.NormalDist().inv_cdf((1 + LEVEL) / 2)
    below = (z * spread / abs(mean)) ** 2 * (1 if paired else 2)  # width(m) = z * spread * sqrt(1 or 2 / m)
    if below >= MOST_SEEDS:
        return None
    for m in range(max(n, 2, math.floor(below)), MOST_SEEDS + 1):
        df, width = (m - 1, spread / math.sqrt(m)) if paired else (2 * m - 2, spread * math.sqrt(2 / m))
        if t_quantile((1 + LEVEL) / 2, df) * width < abs(mean):
            return m
    return None


def difference(kind: dict[int, float], baseline: dict[int, float]) -> Difference:
    """``kind`` against ``baseline``, each {seed: final validation loss}."""
    a, b = list(kind.values()), list(baseline.values())
    mean = statistics.fmean(a) - statistics.fmean(b)
    common = sorted(set(kind) & set(baseline))
    paired = len(common) == len(kind) == len(baseline)
    if len(a) < 2 or len(b) < 2 or not all(map(math.isfinite, a + b)):
        return Difference(mean, None, None, paired, None, None)
    if paired:
        diffs = [kind[s] - baseline[s] for s in common]
        spread, df = statistics.stdev(diffs), len(diffs) - 1
        half, per_seed = t_quantile((1 + LEVEL) / 2, df) * spread / math.sqrt(len(diffs)), spread
    else:  # Welch
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        welch = (va + vb) ** 2 / ((va**2 / (len(a) - 1) if va else 0) + (vb**2 / (len(b) - 1) if vb else 0) or 1)
        half = t_quantile((1 + LEVEL) / 2, max(1, math.floor(welch))) * math.sqrt(va + vb)
        per_seed = math.sqrt((statistics.variance(a) + statistics.variance(b)) / 2)
    low, high = mean - half, mean + half
    separated = low > 0 or high < 0
    needed = None if separated else _seeds_needed(mean, per_seed, len(a), paired=paired)
    return Difference(mean, low, high, paired, separated, needed)
