"""Crash-safe training checkpoints: model, optimizer, RNG and data position.

Layout inside a run directory::

    checkpoints/
      step-000200/
        model.safetensors   the GPT (``multihead.models.checkpoint`` format: loads
                            with ``load_checkpoint``, ``multihead generate --checkpoint``)
        config.json         its GPTConfig, a copy written by ``save_checkpoint``
        state.safetensors   optimizer tensors ``optim.<param index>.<name>`` and RNG
                            states ``rng.cpu.<rank>`` / ``rng.cuda.<rank>`` (uint8), with
                            the rest as JSON in the header (see below)
      step-000400/ ...
      latest                {"format": "multihead.train-latest", "step": 400,
                             "directory": "step-000400"}

Every file is written atomically (``multihead.io``), and
``latest`` is replaced only after the step directory is complete, so a kill -9
at any moment leaves ``latest`` naming a complete checkpoint. After ``latest``
moves, the two newest checkpoints at or below its step are kept and every other
step directory is deleted (also those above it, left by a run killed after its
last pointer update and then resumed from an earlier step).

The header of ``state.safetensors`` holds ``format`` ("multihead.train-state"),
``version`` and ``state``, a JSON object::

    step          optimizer steps completed (the data position: step s reads
                  Batches.get(s, ...), so resuming at s reads what s would have read)
    tokens_seen   tokens trained on so far
    elapsed_s     training time so far (seconds)
    world_size    processes of the run
    config        the TrainConfig
    optimizer     {"param_groups": [...], "scalars": {index: {name: value}}}
    sha256        {tensor name: hex digest} of every tensor in the file

No pickle anywhere: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..io import (
    parse_json_object,
    read_json_file,
    read_safetensors_header,
    read_tensors,
    save_safetensors,
    tensor_sha256,
    write_text_atomic,
)
from ..models.checkpoint import load_checkpoint, save_checkpoint
from ..models.gpt import GPT
from .config import TrainConfig

__all__ = [
    "TrainingState",
    "checkpoint_dir",
    "save_training_checkpoint",
    "latest_checkpoint",
    "load_training_state",
    "checkpoint_config",
    "load_model_weights",
    "check_optimizer_shapes",
    "optimizer_to_tensors",
    "optimizer_from_tensors",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_NAME = "state.safetensors"
STATE_FORMAT = "multihead.train-state"
LATEST_FORMAT = "multihead.train-latest"
VERSION = "1"
KEEP = 2  # checkpoints kept after each save
_STEP_DIR = re.compile(r"step-(\d{6,})")
_OPTIM_KEY = re.compile(r"optim\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)")
_RNG_KEY = re.compile(r"rng\.(cpu|cuda)\.(\d+)")
_MAX_STATE_JSON = 16 << 20


@dataclass
class TrainingState:
    """What :func:`load_training_state` read from one checkpoint.

    Attributes:
        directory: the step directory.
        step: optimizer steps completed.
        tokens_seen, elapsed_s, world_size: see the module docstring.
        config: the run's TrainConfig when the checkpoint was written.
        optimizer: a state dict for ``torch.optim.Optimizer.load_state_dict``.
        rng: "cpu.<rank>" / "cuda.<rank>" -> uint8 generator state.
    """

    directory: Path
    step: int
    tokens_seen: int
    elapsed_s: float
    world_size: int
    config: TrainConfig
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """``<run_dir>/checkpoints/step-<step, 6 digits>``."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


# ------------------------------------------------------------------ optimizer state
def optimizer_to_tensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors and JSON.

    Returns:
        (``{"optim.<index>.<name>": tensor}``, ``{"param_groups": [...],
        "scalars": {"<index>": {name: value}}}``); tuples become lists.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{name}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], source: str) -> dict[str, Any]:
    """The inverse of :func:`optimizer_to_tensors` (lists in param groups become tuples).

    Raises:
        ValueError: malformed metadata or tensor names (the message names ``source``).
    """
    groups, scalars = meta.get("param_groups"), meta.get("scalars", {})
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise ValueError(f"{source}: the optimizer param_groups are not a list of groups with 'params' lists")
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        raise ValueError(f"{source}: the optimizer scalars are not an object of objects")
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        match = _OPTIM_KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{source}: unexpected tensor name {key!r} (expected optim.<index>.<name>)")
        state.setdefault(int(match[1]), {})[match[2]] = value
    for index, entries in scalars.items():
        if not index.isdigit():
            raise ValueError(f"{source}: optimizer scalars for a non-integer parameter index {index!r}")
        state.setdefault(int(index), {}).update(entries)
    param_groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": param_groups}


# ------------------------------------------------------------------ writing
def save_training_checkpoint(
    run_dir: str | os.PathLike,
    *,
    step: int,
    model: GPT,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any],
    config: TrainConfig,
    rng: dict[str, torch.Tensor],
    tokens_seen: int,
    elapsed_s: float,
    world_size: int,
) -> Path:
    """Write checkpoint ``step``, move ``latest`` to it, delete old checkpoints.

    Args:
        run_dir: the run directory.
        step: optimizer steps completed.
        model: the GPT (not a DDP wrapper).
        model_state: the full weights to write instead of ``model.state_dict()``
            (a sharded model's, gathered by ``multihead.train.shard``).
        optimizer_state: ``optimizer.state_dict()`` of the unsharded model
            (parameters by index), or its equal gathered from a sharded one.
        config: the run's TrainConfig.
        rng: "cpu.<rank>" / "cuda.<rank>" -> uint8 generator states.
        tokens_seen, elapsed_s, world_size: progress so far.

    Returns:
        the step directory.
    """
    directory = checkpoint_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, directory, state_dict=model_state)
    tensors, optimizer_meta = optimizer_to_tensors(optimizer_state)
    for name, state in rng.items():
        tensors[f"rng.{name}"] = state.detach().to("cpu").contiguous()
    document = {
        "step": step,
        "tokens_seen": tokens_seen,
        "elapsed_s": elapsed_s,
        "world_size": world_size,
        "config": config.to_dict(),
        "optimizer": optimizer_meta,
        "sha256": {k: tensor_sha256(v) for k, v in tensors.items()},
    }
    metadata = {"format": STATE_FORMAT, "version": VERSION, "state": json.dumps(document, sort_keys=True)}
    save_safetensors(tensors, directory / STATE_NAME, metadata)
    pointer = {"format": LATEST_FORMAT, "step": step, "directory": directory.name}
    write_text_atomic(directory.parent / LATEST, json.dumps(pointer) + "\n")  # only now is step the latest
    _prune(directory.parent, step)
    return directory


def _step_dirs(checkpoints: Path) -> dict[int, Path]:
    found = {}
    for entry in checkpoints.iterdir() if checkpoints.is_dir() else ():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match[1])] = entry
    return found


def _prune(checkpoints: Path, latest: int) -> None:
    """Keep the KEEP newest step directories at or below ``latest``; delete the rest."""
    found = _step_dirs(checkpoints)
    keep = sorted((s for s in found if s <= latest), reverse=True)[:KEEP]
    for step, path in found.items():
        if step not in keep:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ reading
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
    match = _STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    if pointer.get("format") != LATEST_FORMAT or match is None or int(match[1]) != step:
        raise ValueError(f"{pointer_path} is not a checkpoint pointer: {pointer!r}")
    directory = checkpoints / name
    if not (directory / STATE_NAME).is_file():
        raise ValueError(f"{pointer_path} names {directory}, which holds no {STATE_NAME}")
    return directory


def load_training_state(directory: str | os.PathLike) -> TrainingState:
    """Read ``state.safetensors`` of a step directory (the model is read by
    :func:`load_model_weights`).

    Raises:
        FileNotFoundError: no state file.
        ValueError: a corrupt or hostile file (header, JSON, checksums,
            tensor names, an invalid config).
    """
    directory = Path(directory)
    path = directory / STATE_NAME
    with open(path, "rb") as f:
        header, document, config = _read_state_header(f, path)
        tensors = read_tensors(f, header, document["sha256"])
    elapsed = document.get("elapsed_s")
    rng, optim = {}, {}
    for name, tensor in tensors.items():
        match = _RNG_KEY.fullmatch(name)
        if match is not None:
            rng[f"{match[1]}.{match[2]}"] = tensor
        else:
            optim[name] = tensor
    optimizer_meta = document.get("optimizer")
    if not isinstance(optimizer_meta, dict):
        raise ValueError(f"{path}: no optimizer entry in its state")
    return TrainingState(
        directory=directory,
        step=document["step"],
        tokens_seen=document["tokens_seen"],
        elapsed_s=float(elapsed),
        world_size=document["world_size"],
        config=config,
        optimizer=optimizer_from_tensors(optim, optimizer_meta, str(path)),
        rng=rng,
    )


def checkpoint_config(directory: str | os.PathLike) -> tuple[int, TrainConfig]:
    """(step, TrainConfig) of a step directory, from the header of its state
    file alone (no tensor is read).

    Raises:
        FileNotFoundError: no state file.
        ValueError: a corrupt header (see :func:`load_training_state`).
    """
    path = Path(directory) / STATE_NAME
    with open(path, "rb") as f:
        _, document, config = _read_state_header(f, path)
    return document["step"], config


def _read_state_header(f, path: Path):
    """(safetensors header, state document, TrainConfig), checked; ``f`` is left after the header."""
    header = read_safetensors_header(f, path)
    meta = header.metadata
    if meta.get("format") != STATE_FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a training state (format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"expected {STATE_FORMAT!r} version {VERSION})"
        )
    text = meta.get("state", "")
    if len(text) > _MAX_STATE_JSON:
        raise ValueError(f"{path}: its state JSON is {len(text)} characters (at most {_MAX_STATE_JSON})")
    document = parse_json_object(text, f"{path}: the state in its header")
    sums = document.get("sha256")
    if not isinstance(sums, dict) or set(sums) != set(header.tensors):
        raise ValueError(f"{path}: the sha256 entry does not list exactly the tensors of the file")
    for key in ("step", "tokens_seen", "world_size"):
        value = document.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: {key} must be a non-negative int, got {value!r}")
    elapsed = document.get("elapsed_s")
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)):
        raise ValueError(f"{path}: elapsed_s must be a number, got {elapsed!r}")
    try:
        config = TrainConfig.from_dict(document.get("config"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: invalid training config: {e}") from None
    return header, document, config


def load_model_weights(model: GPT, directory: str | os.PathLike) -> None:
    """Copy the weights of ``<directory>/model.safetensors`` into ``model``.

    Raises:
        ValueError: the checkpoint's GPTConfig differs from ``model.config``,
            or a corrupt file (see ``multihead.models.checkpoint.load_checkpoint``).
    """
    saved = load_checkpoint(directory, config=model.config)
    with torch.no_grad():
        model.load_state_dict(saved.state_dict())


def check_optimizer_shapes(optimizer_state: dict[str, Any], params: list[torch.Tensor], source: str) -> None:
    """Refuse optimizer tensors whose shapes do not fit the parameters.

    Raises:
        ValueError: an index beyond the parameters, or a non-scalar tensor of
            another shape than its parameter (naming both).
    """
    for index, entries in optimizer_state["state"].items():
        if index >= len(params):
            raise ValueError(f"{source}: optimizer state for parameter {index}, the model has {len(params)}")
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(
                    f"{source}: optim.{index}.{name} has shape {tuple(value.shape)}, "
                    f"parameter {index} has {tuple(params[index].shape)}"
                )
