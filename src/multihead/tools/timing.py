"""How much faster one call is than another, with the spread of the measurement.

    s = measure_speedup(lambda: big(x), lambda: small(x), rounds=7)
    str(s)   # "1.31x (per-round ratios 1.12x to 1.45x, median of 7 alternating rounds)"
             # "below measurement noise (per-round ratios 0.93x to 1.12x over 7 alternating rounds)"

After one warm-up call of each, every round times ``before`` and ``after``
once each, in alternating order (even rounds ``before`` first, odd rounds
``after`` first, so drift of the machine's speed does not favour one), and
takes the ratio before / after. A call shorter than ``MIN_SAMPLE_SECONDS``
is repeated inside each sample until a sample lasts that long (the same
count for both), so the clock's resolution does not dominate a tiny model.

The speed-up is the median of the per-round ratios, with their minimum and
maximum. When that range holds 1.0 (some rounds found ``after`` no faster,
others faster), or there are fewer than ``MIN_ROUNDS`` rounds to see a
spread at all, the difference is reported as below measurement noise.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MIN_ROUNDS", "MIN_SAMPLE_SECONDS", "Speedup", "summarize", "measure_speedup"]

MIN_ROUNDS = 3
MIN_SAMPLE_SECONDS = 0.02
_MAX_REPEATS = 1000


@dataclass(frozen=True)
class Speedup:
    """A measured speed-up.

    Attributes:
        median, low, high: median, minimum and maximum of the per-round
            ratios (seconds before / seconds after).
        rounds: timed rounds.
        seconds: (median seconds of ``before``, of ``after``) per call.
        noise: True when the ratios' range holds 1.0 or ``rounds`` < ``MIN_ROUNDS``.
    """

    median: float
    low: float
    high: float
    rounds: int
    seconds: tuple[float, float]
    noise: bool

    def __str__(self) -> str:
        spread = f"per-round ratios {self.low:.2f}x to {self.high:.2f}x"
        if self.noise:
            return f"below measurement noise ({spread} over {self.rounds} alternating rounds)"
        return f"{self.median:.2f}x ({spread}, median of {self.rounds} alternating rounds)"

    def to_dict(self) -> dict:
        """The report.json form."""
        return {"median": self.median, "min": self.low, "max": self.high, "rounds": self.rounds,
                "below_noise": self.noise}  # fmt: skip


def summarize(before: list[float], after: list[float]) -> Speedup:
    """The speed-up of per-round seconds ``before`` [n] and ``after`` [n] (the same rounds).

    Raises:
        ValueError: lists of different lengths, empty, or a time that is not positive.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"summarize needs one time of each per round, got {len(before)} and {len(after)}")
    if not all(t > 0 and math.isfinite(t) for t in [*before, *after]):
        raise ValueError(f"times must be positive and finite, got {before} and {after}")
    ratios = [b / a for b, a in zip(before, after)]
    low, high = min(ratios), max(ratios)
    noise = len(ratios) < MIN_ROUNDS or low <= 1.0 <= high
    seconds = (statistics.median(before), statistics.median(after))
    return Speedup(statistics.median(ratios), low, high, len(ratios), seconds, noise)


def measure_speedup(
    before: Callable[[], object], after: Callable[[], object], rounds: int, clock: Callable[[], float] | None = None
) -> Speedup:
    """Time ``before`` and ``after`` in ``rounds`` alternating rounds (see the module docstring).

    ``clock``: seconds, monotonic (default ``time.perf_counter``).
    """
    clock = time.perf_counter if clock is None else clock
    before(), after()  # warm-up
    start = clock()
    before()
    once = clock() - start
    repeats = 1 if once >= MIN_SAMPLE_SECONDS else min(_MAX_REPEATS, math.ceil(MIN_SAMPLE_SECONDS / max(once, 1e-9)))
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            f = (before, after)[i]
            start = clock()
            for _ in range(repeats):
                f()
            times[i].append((clock() - start) / repeats)
    return summarize(*times)
