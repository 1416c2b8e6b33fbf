"""Alternating timer and summary statistics.

Contenders are timed in the same process, round by round in a fixed order
(A, B, A, B, ...), after alternating warm-up rounds, so that slow drifts of
the machine (other processes, frequency, thermal) fall on all contenders
alike. Each round gives one time per contender; the per-round ratio
``X / baseline`` pairs measurements taken seconds apart, which is more
robust to drift than the ratio of two medians alone. Both are reported.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

__all__ = ["compare", "cuda_ms", "fmt_ms", "summarize", "threads", "time_alternating"]


@contextmanager
def threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)`` (None: unchanged)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def time_alternating(
    steps: dict[str, Callable[[], None]],
    *,
    warmup: int = 3,
    rounds: int = 20,
    number: int = 1,
    sync: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Time each step function, alternating contenders round by round.

    Args:
        steps: contender name -> zero-argument function doing one unit of
            work. The dict order is the order within every round.
        warmup: rounds run first (alternating too) and discarded.
        rounds: measured rounds.
        number: calls per measurement; the recorded time is divided by it.
        sync: called before reading the clock (e.g. ``torch.cuda.synchronize``
            for asynchronous devices); None on CPU.
        progress: called as ``progress(done, total)`` after each round.

    Returns:
        contender name -> ``rounds`` times in seconds per call
        (``time.perf_counter``), index i of every list from round i.

    The garbage collector is disabled while measuring (as ``timeit`` does)
    and run between rounds, so a collection never lands inside a step.
    """
    if rounds < 1 or warmup < 0 or number < 1:
        raise ValueError(f"need rounds >= 1, warmup >= 0, number >= 1; got {rounds}, {warmup}, {number}")
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    total = warmup + rounds
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(total):
            for name in names:
                step = steps[name]
                gc.collect()
                gc.disable()
                if sync is not None:
                    sync()
                t0 = clock()
                for _ in range(number):
                    step()
                if sync is not None:
                    sync()
                t1 = clock()
                if gc_was_enabled:
                    gc.enable()
                if r >= warmup:
                    times[name].append((t1 - t0) / number)
            if progress is not None:
                progress(r + 1, total)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def cuda_ms(fn: Callable[[], object], number: int) -> float:
    """Milliseconds per call of ``fn`` over ``number`` back-to-back calls, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(number):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / number


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def summarize(xs: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min, max and count of a sample."""
    if not xs:
        raise ValueError("empty sample")
    q1, q3 = _quartiles(xs)
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def compare(candidate: Sequence[float], baseline: Sequence[float]) -> dict[str, object]:
    """Ratios ``candidate / baseline`` (above 1: the candidate is slower).

    Returns:
        ``ratio_of_medians``: median(candidate) / median(baseline);
        ``per_round``: summary of the per-round ratios candidate[i] / baseline[i]
        (the two were measured in the same round, back to back).
    """
    if len(candidate) != len(baseline):
        raise ValueError(f"samples differ in length: {len(candidate)} vs {len(baseline)}")
    per_round = [c / b for c, b in zip(candidate, baseline)]
    ratio = statistics.median(candidate) / statistics.median(baseline)
    return {"ratio_of_medians": ratio, "per_round": summarize(per_round)}


def fmt_ms(seconds: float) -> str:
    """Seconds -> milliseconds with 3 significant digits or more."""
    ms = seconds * 1e3
    if ms == 0 or not math.isfinite(ms):
        return f"{ms}"
    digits = max(0, 2 - math.floor(math.log10(abs(ms))))
    return f"{ms:.{digits}f}"
