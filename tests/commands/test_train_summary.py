"""The lines ``multihead train`` prints at the end: no speed when no step was timed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from multihead.commands.train import summary


def result(tokens_per_s: float) -> SimpleNamespace:
    return SimpleNamespace(run_dir=Path("runs/x"), val_loss=2.0, steps=5, tokens_per_s=tokens_per_s)


def test_speed_is_printed_only_when_it_was_measured():
    config = SimpleNamespace(tokenizer="bytes")
    timed = summary(result(1500.0), config)
    assert "speed: 1,500 tokens/s (training steps, all processes)" in timed
    untimed = summary(result(0.0), config)
    assert not any(line.startswith("speed") for line in untimed) and "0 tokens/s" not in "\n".join(untimed)
    assert untimed == [line for line in timed if not line.startswith("speed")]  # the other lines stay
