"""The lines ``multihead train`` prints at the end: no speed when no step was trained."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from multihead.commands.train import summary


def result(tokens_per_s: float, start: int) -> SimpleNamespace:
    return SimpleNamespace(run_dir=Path("runs/x"), val_loss=2.0, steps=5, start=start, tokens_per_s=tokens_per_s)


def test_speed_is_printed_only_when_steps_were_trained():
    config = SimpleNamespace(tokenizer="bytes")
    timed = summary(result(1500.0, start=0), config)
    assert "speed: 1,500 tokens/s (training steps, all processes)" in timed
    untimed = summary(result(0.0, start=5), config)  # a finished run resumed: nothing to train
    assert "speed: no step trained (the checkpoint was already at step 5)" in untimed
    assert "0 tokens/s" not in "\n".join(untimed)
    assert [line for line in untimed if not line.startswith("speed")] == [
        line for line in timed if not line.startswith("speed")
    ]  # the other lines stay
