"""Tiny training runs for tests: a byte model on a short repetitive text, one thread."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import torch
import torch.nn.functional as F

from multihead.models.checkpoint import load_checkpoint
from multihead.models.gpt import GPT
from multihead.train import TrainConfig
from multihead.train.batches import read_tokens, val_batches
from multihead.train.loop import VAL_SEED


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


def assert_follows(got, want):
    """Two 6-step runs' metrics.jsonl records (evaluated at steps 3 and 6)
    agree step by step to float32 rounding (different sums)."""
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4, 5, 6]
    for key in ("train_loss", "grad_norm", "lr"):
        torch.testing.assert_close(torch.tensor([m[key] for m in got]), torch.tensor([m[key] for m in want]))
    val = [[m["val_loss"] for m in rows if "val_loss" in m] for rows in (got, want)]
    assert len(val[0]) == 2  # steps 3 and 6
    torch.testing.assert_close(torch.tensor(val[0]), torch.tensor(val[1]))


def assert_heads_follow(got, want):
    """Two runs' metrics.jsonl records hold --track-heads scores at the same steps,
    equal to float32 rounding (the models follow each other to that)."""
    steps = [[m["step"] for m in rows if "heads" in m] for rows in (got, want)]
    assert steps[0] == steps[1] and steps[0]
    pairs = [(a["heads"]["scores"], b["heads"]["scores"]) for a, b in zip(got, want, strict=True) if "heads" in b]
    for a, b in pairs:
        assert set(a) == set(b)
        for role in b:
            torch.testing.assert_close(torch.tensor(a[role]), torch.tensor(b[role]), atol=1e-5, rtol=1e-4)


def latest(run: Path) -> GPT:
    """The eval-mode model of the checkpoint a run's ``checkpoints/latest`` names."""
    pointer = json.loads((run / "checkpoints" / "latest").read_text())
    return load_checkpoint(run / "checkpoints" / pointer["directory"]).eval()


def run_val_loss(model: GPT, run: Path) -> float:
    """Mean cross-entropy over the run's fixed validation batches, written out here."""
    config = json.loads((run / "config.json").read_text())
    sets = val_batches(read_tokens(run / "data" / "val.bin"), batch_size=config["batch_size"],
                       context_length=config["context_length"], num_batches=config["eval_batches"], seed=VAL_SEED)  # fmt: skip
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in sets]
    return float(sum(losses)) / sum(y.numel() for _, y in sets)


WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()


def word_text(path: Path) -> Path:
    """Write 600 seeded lines of 10 words from ``WORDS`` to ``path`` (a small training text)."""
    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(600)) + "\n")
    return path


def signal_during_steps(monkeypatch, steps: dict[int, list[int]]) -> None:
    """Raise the listed signals in this process during those optimizer steps (1-based)."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        for sig in steps.get(calls[0], []):
            signal.raise_signal(sig)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
