"""Tiny training runs for tests: a byte model on a short repetitive text, one thread."""

from __future__ import annotations

from pathlib import Path

from multihead.train import TrainConfig


def tiny_config(tmp_path: Path, text: str, **values) -> TrainConfig:
    """A ``TrainConfig`` of the "tiny" preset at context 16 on ``text`` (written to
    ``tmp_path/text.txt`` once), into ``tmp_path/run``, one thread, two
    validation batches; ``values`` set the rest."""
    data = tmp_path / "text.txt"
    tmp_path.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        data.write_text(text, encoding="utf-8")
    base = dict(data=str(data), preset="tiny", context_length=16, eval_batches=2, out=str(tmp_path / "run"), threads=1)
    return TrainConfig(**{**base, **values})
