"""What ``multihead convert`` and ``multihead prune`` read and write for a GPT.

``--checkpoint`` is a GPT checkpoint or a ``multihead train`` run directory
(``run_dir``). Calibration batches are windows of the run's training tokens
(or of ``--calibration-data`` text); the validation loss is the run's own,
on its fixed validation batches, as ``multihead train`` reports it. The
outputs (the model, the run's tokenizer.json, report.json) are written
into a staging folder and moved into place together (``staged_output``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..io import write_text_atomic
from .run_dir import run_checkpoint
from .staged_output import write_folder

__all__ = [
    "CALIBRATION_BATCH_SIZE", "CALIBRATION_SEED", "OUTPUT_FILES", "load_gpt", "calibration_windows", "validation", "tokenizer_json",
    "write_outputs",
]  # fmt: skip

CALIBRATION_BATCH_SIZE = 16
CALIBRATION_SEED = 99
OUTPUT_FILES = ("config.json", "model.safetensors", "report.json", "tokenizer.json")  # what convert and prune write


def load_gpt(checkpoint: str):
    """(model, run directory or None, tokenizer or None, description).

    The tokenizer is a run's, or the tokenizer.json beside a checkpoint
    (``run_dir.run_checkpoint``; then the run directory is None)."""
    from ..models.checkpoint import load_checkpoint

    found = run_checkpoint(checkpoint)
    if found is None:
        return load_checkpoint(checkpoint).eval(), None, None, f"checkpoint {checkpoint}"
    step_dir, tokenizer, step = found
    if step is None:  # a checkpoint folder with its tokenizer.json: no run data to calibrate or validate on
        return load_checkpoint(step_dir).eval(), None, tokenizer, f"checkpoint {checkpoint}"
    return load_checkpoint(step_dir).eval(), Path(checkpoint), tokenizer, f"run {checkpoint}, step {step}"


def _encode(text: str, model, tokenizer, source: str) -> list[int]:
    if tokenizer is not None:
        return list(tokenizer.encode(text))
    if model.config.vocab_size == 256:
        return list(text.encode("utf-8"))
    raise ValueError(
        f"--calibration-data {source}: the checkpoint's vocabulary has {model.config.vocab_size} tokens, not 256 "
        "bytes, and only a training run brings a tokenizer to encode text with"
    )


def calibration_windows(model, run_dir: Path | None, tokenizer, data: str | None, count: int) -> list[torch.Tensor]:
    """``count`` token batches [CALIBRATION_BATCH_SIZE, T] of training data."""
    import numpy as np

    from ..train.batches import Batches, read_tokens

    if data is not None:
        from ..train.corpus import load_corpus

        tokens = np.asarray(_encode(load_corpus(data).train, model, tokenizer, data), dtype=np.int64)
        where = f"--calibration-data {data}"
    elif run_dir is not None:
        tokens, where = read_tokens(run_dir / "data" / "train.bin"), f"{run_dir / 'data' / 'train.bin'}"
    else:
        raise ValueError(
            "--method aligned or activation (and --recover-steps) needs calibration text: give --calibration-data "
            "shakespeare|FILE "
            "(or --checkpoint a training run, whose data/train.bin is used)"
        )
    T = model.config.context_length
    if tokens.size < T + 1:
        raise ValueError(f"{where}: {tokens.size} tokens, fewer than the context {T} + 1 a calibration window needs")
    batches = Batches(tokens, batch_size=CALIBRATION_BATCH_SIZE, context_length=T, seed=CALIBRATION_SEED)
    return [batches.get(i)[0] for i in range(count)]  # x of each (x, y): (B, T)


def validation(run_dir: Path):
    """(loss function of a model, description) on the run's fixed validation batches."""
    from ..io import read_json_file
    from ..train.batches import read_tokens, val_batches
    from ..train.config import TrainConfig
    from ..train.loop import VAL_SEED, validation_loss
    from ..train.world import World

    config = TrainConfig.from_dict(read_json_file(run_dir / "config.json"))
    sets = val_batches(
        read_tokens(run_dir / "data" / "val.bin"),
        batch_size=config.batch_size,
        context_length=config.context_length,
        num_batches=config.eval_batches,
        seed=VAL_SEED,
    )

    def loss(model) -> float:
        device = next(model.parameters()).device
        value = validation_loss(model, sets, config, World(), device, contextlib.nullcontext)
        model.eval()  # validation_loss leaves the model in training mode
        return value

    where = f"{config.eval_batches} batches x {config.batch_size} x {config.context_length} tokens of data/val.bin"
    return loss, where


def tokenizer_json(checkpoint: str, run_dir: Path | None) -> Path:
    """The tokenizer.json that came with ``--checkpoint``: a run's ``tokenizer/``
    file, or the one beside a checkpoint folder."""
    return run_dir / "tokenizer" / "tokenizer.json" if run_dir is not None else Path(checkpoint) / "tokenizer.json"


def write_outputs(folder: Path, save: Callable[[Path], object], report: dict, tokenizer_file: Path | None) -> None:
    """Write the model (``save(folder)``), a copy of ``tokenizer_file`` (a BPE
    run's or a Hugging Face folder's tokenizer.json) as tokenizer.json, and
    report.json into ``folder``, as a whole (``staged_output.write_folder``:
    a staging folder, moved into place at the end). A checkpoint
    folder with its tokenizer.json beside config.json is read whole by
    ``--checkpoint`` (``run_dir``)."""

    def write(staging: Path) -> None:
        save(staging)
        if tokenizer_file is not None:
            write_text_atomic(staging / "tokenizer.json", tokenizer_file.read_text(encoding="utf-8"))
        write_text_atomic(staging / "report.json", json.dumps(report, indent=2) + "\n")

    write_folder(folder, write, OUTPUT_FILES)
