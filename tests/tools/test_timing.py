"""A speed-up is reported with its spread, and as below measurement noise when the spread holds 1.0.

The clock is replaced by one that advances by known amounts, so every number below is computed by
hand from those amounts (no timing is asserted).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import timing
from multihead.tools.timing import MIN_ROUNDS, measure_speedup, summarize


def test_summary_is_the_median_ratio_with_its_range():
    s = summarize([2.0, 4.0, 6.0], [1.0, 1.0, 3.0])  # ratios 2, 4, 2
    assert (s.median, s.low, s.high, s.rounds, s.noise) == (2.0, 2.0, 4.0, 3, False)
    assert s.seconds == (4.0, 1.0)
    assert str(s) == "2.00x (per-round ratios 2.00x to 4.00x, median of 3 alternating rounds)"


def test_a_range_that_holds_one_is_noise():
    s = summarize([1.0, 1.2, 0.9, 2.0], [1.0, 1.0, 1.0, 1.0])  # ratios 1, 1.2, 0.9, 2: median 1.1
    assert s.noise and s.median == pytest.approx(1.1)
    assert str(s) == "below measurement noise (per-round ratios 0.90x to 2.00x over 4 alternating rounds)"
    few = summarize([3.0] * (MIN_ROUNDS - 1), [1.0] * (MIN_ROUNDS - 1))  # no spread can be seen
    assert few.noise and str(few).startswith("below measurement noise")
    with pytest.raises(ValueError, match="got 2 and 1"):
        summarize([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        summarize([1.0, 0.0], [1.0, 1.0])


def test_rounds_alternate_and_short_calls_are_repeated():
    now, calls = [0.0], []

    def call(name: str, seconds: float):
        def f():
            calls.append(name)
            now[0] += seconds

        return f

    s = measure_speedup(call("b", 0.005), call("a", 0.0025), rounds=4, clock=lambda: now[0])
    # warm-up b a, one probe of b (0.005 s < 0.02 s: 4 calls per sample), then b-first and a-first rounds
    assert calls[:3] == ["b", "a", "b"]
    samples = calls[3:]
    assert samples == ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4 + ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4
    assert s.median == pytest.approx(2.0) and s.low == pytest.approx(2.0) and not s.noise
    assert s.seconds == pytest.approx((0.005, 0.0025))


def test_prune_reports_an_equal_speed_as_noise(tmp_path, monkeypatch):
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), plain)
    now = [0.0]

    def clock() -> float:  # each reading 0.015 s after the last: every stretch is as long, whichever model runs
        now[0] += 0.015
        return now[0]

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock))
    out = tmp_path / "pruned"
    rc, stdout, err = quietly("prune", "--checkpoint", str(plain), "--method", "gradient", "--keep", "0.5",
                              "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    speed = json.loads((out / "report.json").read_text())["speedup"]
    assert speed == {"median": pytest.approx(1.0), "min": pytest.approx(1.0), "max": pytest.approx(1.0),
                     "rounds": 7, "below_noise": True}  # fmt: skip
    assert "speed-up: below measurement noise (per-round ratios 1.00x to 1.00x over 7 alternating rounds)" in stdout
