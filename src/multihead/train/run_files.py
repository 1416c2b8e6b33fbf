"""The files of a run directory besides checkpoints: config.json, the
tokenizer, the token files and metrics.jsonl (see ``multihead.train.loop``).

``config.json`` is written when a fresh run starts and then together with
each checkpoint (after it), so it always says what the checkpoint that
``latest`` names was trained with; a resumed run that has not yet written a
checkpoint leaves it as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from ..io import write_atomic, write_text_atomic
from .batches import Batches, read_tokens, write_tokens
from .config import TrainConfig
from .corpus import load_corpus
from .tokenizer import load_tokenizer_dir, train_tokenizer
from .world import World

__all__ = ["prepare_data", "batches_or_error", "write_config", "Metrics"]


def _link_file(source: Path, target: Path) -> None:
    """``target`` becomes a hard link to ``source`` (one copy on disk), replaced atomically;
    a copy where the file system has no hard links."""
    staged = target.with_name(f".{target.name}.{os.getpid()}.link")
    staged.unlink(missing_ok=True)
    try:
        os.link(source, staged)
    except OSError:
        write_atomic(target, lambda path: shutil.copyfile(source, path))
        return
    os.replace(staged, target)


def write_config(run_dir: Path, config: TrainConfig) -> None:
    """``run_dir/config.json``: the TrainConfig as indented JSON (atomic)."""
    write_text_atomic(run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")


def prepare_data(config: TrainConfig, run_dir: Path, world: World, resume: bool, data_from: Path | None = None):
    """(tokenizer, train tokens, val tokens); on a fresh run rank 0 builds them and
    writes config.json, the tokenizer and the token files, only once both splits
    are known to hold a batch (collective: every rank calls it). ``data_from``:
    a directory whose ``tokenizer/`` and ``data/*.bin`` this run takes instead
    (its token files become hard links to those, see ``train``)."""
    data = run_dir / "data"
    if world.main and not resume:
        if data_from is not None:
            tokenizer = load_tokenizer_dir(data_from / "tokenizer")
            splits = {name: read_tokens(data_from / "data" / f"{name}.bin") for name in ("train", "val")}
        else:
            corpus = load_corpus(config.data)
            if config.init_from is not None:
                from .pretrained import folder_tokenizer

                tokenizer = folder_tokenizer(config.init_from)
            else:
                tokenizer = train_tokenizer(config.tokenizer, corpus.train, config.vocab_size)
            splits = {
                name: np.asarray(tokenizer.encode(text)) for name, text in (("train", corpus.train), ("val", corpus.val))
            }
        for name, ids in splits.items():
            batches_or_error(ids, config, name)  # refuse before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, config)
        tokenizer.save(run_dir / "tokenizer")
        data.mkdir(exist_ok=True)
        for name, ids in splits.items():
            if data_from is None:
                write_tokens(ids, data / f"{name}.bin")
            else:
                _link_file(data_from / "data" / f"{name}.bin", data / f"{name}.bin")
    world.barrier()
    return load_tokenizer_dir(run_dir / "tokenizer"), read_tokens(data / "train.bin"), read_tokens(data / "val.bin")


def batches_or_error(tokens: np.ndarray, config: TrainConfig, split: str) -> Batches:
    """The batches of a split, or a UsageError naming the split and the data."""
    try:
        return Batches(tokens, batch_size=config.batch_size, context_length=config.context_length, seed=config.seed)
    except ValueError as e:
        raise UsageError(f"{split} split of data={config.data!r}: {e}") from None


class Metrics:
    """``metrics.jsonl``, appended and flushed line by line (rank 0 only); lines
    after step ``keep_through`` (a resumed run's checkpoint) are dropped first."""

    def __init__(self, path: Path, keep_through: int | None) -> None:
        self.path = path
        kept = []
        if keep_through is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= keep_through:
                    kept.append(line + "\n")
        write_text_atomic(path, "".join(kept))  # what an uninterrupted run has at this step
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
