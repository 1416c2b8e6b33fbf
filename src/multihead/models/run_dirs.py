"""Which checkpoint of a ``multihead train`` run directory is the latest.

    runs/tiny/
      checkpoints/latest          {"format": "multihead.train-latest", "step": 200, "directory": "step-000200"}
      checkpoints/step-000200/    model.safetensors (a GPT checkpoint), state.safetensors (training state)

``load_checkpoint("runs/tiny")`` and ``multihead generate --checkpoint runs/tiny``
both read the step directory ``latest`` names (``checkpoint_path``); the
training loop writes the pointer (``multihead.train.checkpoint``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..io import read_json_file

__all__ = ["CHECKPOINTS", "LATEST", "LATEST_FORMAT", "STATE_NAME", "STEP_DIR", "latest_checkpoint", "checkpoint_path"]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
LATEST_FORMAT = "multihead.train-latest"
STATE_NAME = "state.safetensors"
STEP_DIR = re.compile(r"step-(\d{6,})")


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The step directory ``<run_dir>/checkpoints/latest`` names, or None without one.

    Raises:
        ValueError: a ``latest`` file that is not a valid pointer, or one that
            names a missing directory.
    """
    checkpoints = Path(run_dir) / CHECKPOINTS
    pointer_path = checkpoints / LATEST
    if not pointer_path.is_file():
        return None
    pointer = read_json_file(pointer_path, 4096)
    name, step = pointer.get("directory"), pointer.get("step")
    match = STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    if pointer.get("format") != LATEST_FORMAT or match is None or int(match[1]) != step:
        raise ValueError(f"{pointer_path} is not a checkpoint pointer: {pointer!r}")
    directory = checkpoints / name
    if not (directory / STATE_NAME).is_file():
        raise ValueError(f"{pointer_path} names {directory}, which holds no {STATE_NAME}")
    return directory


def checkpoint_path(path: str | os.PathLike) -> str | os.PathLike:
    """The latest step directory of a run directory (one holding ``checkpoints/``); any other path as given.

    Raises:
        FileNotFoundError: a run directory with no complete checkpoint yet.
        ValueError: a broken ``checkpoints/latest`` pointer.
    """
    if not (Path(path) / CHECKPOINTS).is_dir():
        return path
    step_dir = latest_checkpoint(path)
    if step_dir is None:
        raise FileNotFoundError(
            f"{os.fspath(path)} is a training run with no complete checkpoint yet "
            f"({Path(path) / CHECKPOINTS / LATEST} does not exist)"
        )
    return step_dir
