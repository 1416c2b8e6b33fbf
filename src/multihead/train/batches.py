"""Token files and the batches a training step reads from them.

Token file (``.bin``), little-endian, written atomically::

    bytes 0..7    magic b"MHTOKENS"
    bytes 8..11   uint32 format version (1)
    bytes 12..15  uint32 bytes per token: 2 (uint16, every id < 65536) or 4 (uint32)
    bytes 16..23  uint64 number of tokens N
    bytes 24..31  zero
    bytes 32..    the N ids, a flat uint16 or uint32 array

The header lets :func:`read_tokens` tell uint16 from uint32 and refuse a
truncated file; the ids themselves are a flat array (``np.memmap`` at offset 32).

Batches: step ``s`` draws ``batch_size`` start offsets from
``np.random.default_rng([seed, s])``, so any step can be recomputed from
(seed, step) alone and a resumed run reads exactly what it would have read.
The global batch is cut first by rank, then by micro-batch::

    global offsets  [o0 o1 o2 o3 o4 o5 o6 o7]       batch_size 8
    world_size 2    rank 0: [o0 o1 o2 o3]    rank 1: [o4 o5 o6 o7]
    grad_accum 2    micro 0: [o0 o1]  micro 1: [o2 o3]  |  [o4 o5]  [o6 o7]

    row i:  x = tokens[o_i : o_i + T],  y = tokens[o_i + 1 : o_i + T + 1]
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from multihead.io import write_atomic

__all__ = ["write_tokens", "read_tokens", "Batches", "val_batches"]

MAGIC = b"MHTOKENS"
VERSION = 1
HEADER_BYTES = 32
_HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, count, padding
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def write_tokens(ids: Sequence[int] | np.ndarray, path: str | os.PathLike) -> Path:
    """Write ``ids`` [N] to ``path`` as a token file (uint16 when every id < 65536).

    Args:
        ids: token ids, integers in [0, 2**32).
        path: the ``.bin`` file; replaced atomically (a reader or a crash sees
            the old file or the new one, never a part).

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: no ids, a negative id or one >= 2**32, or ids that are not 1-D.
        TypeError: ids that are not integers.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"no token ids to write to {path}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= 2**32:
        raise ValueError(f"token ids must lie in [0, 2**32), got min {low}, max {high}")
    itemsize = 2 if high < 2**16 else 4
    data = arr.astype(_DTYPES[itemsize], copy=False)
    header = _HEADER.pack(MAGIC, VERSION, itemsize, data.size)

    def write(staged: Path) -> None:
        with open(staged, "wb") as f:
            f.write(header)
            data.tofile(f)

    return write_atomic(path, write)


def read_tokens(path: str | os.PathLike) -> np.memmap:
    """The ids of a token file, [N] uint16 or uint32, memory-mapped read-only.

    Raises:
        OSError: the file cannot be opened.
        ValueError: not a token file (magic, version, token size), or its size
            does not match its header (a truncated or padded file).
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        size = os.fstat(f.fileno()).st_size
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise ValueError(f"{path}: not a multihead token file (no {MAGIC!r} header)")
    _, version, itemsize, count = _HEADER.unpack(head)
    if version != VERSION or itemsize not in _DTYPES:
        raise ValueError(f"{path}: token file version {version}, {itemsize} bytes per token; reads version 1, 2 or 4")
    if count == 0 or size != HEADER_BYTES + count * itemsize:
        raise ValueError(
            f"{path}: header says {count} tokens of {itemsize} bytes "
            f"({HEADER_BYTES + count * itemsize} bytes in all), the file has {size} bytes"
        )
    return np.memmap(path, dtype=_DTYPES[itemsize], mode="r", offset=HEADER_BYTES, shape=(count,))


class Batches:
    """Random windows of a token array, recomputable from (seed, step).

    Args:
        tokens: token ids [N], any integer array (a memmap from :func:`read_tokens`).
        batch_size: sequences per optimizer step, over all ranks and micro-batches.
        context_length: tokens per sequence, T.
        seed: with the step, the only source of randomness (>= 0).

    Raises:
        ValueError: non-positive sizes, a negative seed, tokens not 1-D, or
            fewer than ``context_length + 1`` tokens.
    """

    def __init__(self, tokens: np.ndarray, *, batch_size: int, context_length: int, seed: int) -> None:
        self.batch_size = _positive_int("batch_size", batch_size)
        self.context_length = _positive_int("context_length", context_length)
        self.seed = _positive_int("seed", seed, minimum=0)
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        if tokens.size < self.context_length + 1:
            raise ValueError(
                f"batch larger than the data: context_length={self.context_length} needs at least "
                f"{self.context_length + 1} tokens, the data has {tokens.size}"
            )
        self.tokens = tokens

    def offsets(self, step: int) -> np.ndarray:
        """Start positions of step ``step``'s global batch, [batch_size] int64 in [0, N - T - 1]."""
        step = _positive_int("step", step, minimum=0)
        rng = np.random.default_rng([self.seed, step])
        high = self.tokens.size - self.context_length  # exclusive: o + T <= N - 1 keeps y in range
        return rng.integers(0, high, size=self.batch_size, dtype=np.int64)

    def get(
        self, step: int, *, micro: int = 0, grad_accum: int = 1, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s micro-batch ``micro`` of step ``step``.

        Args:
            step: optimizer step (>= 0).
            micro: micro-batch index in [0, grad_accum).
            grad_accum: micro-batches per optimizer step.
            rank: this process in [0, world_size).
            world_size: data-parallel processes.

        Returns:
            ``(x, y)``: int64 tensors [b, T] with b = batch_size // (world_size * grad_accum),
            and y[:, t] == x[:, t + 1] for t < T - 1 (y is x shifted by one token).

        Raises:
            ValueError: batch_size not divisible by world_size * grad_accum, or
                rank / micro out of range.
        """
        grad_accum = _positive_int("grad_accum", grad_accum)
        world_size = _positive_int("world_size", world_size)
        rank = _positive_int("rank", rank, minimum=0)
        micro = _positive_int("micro", micro, minimum=0)
        if self.batch_size % (world_size * grad_accum):
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by world_size * grad_accum = "
                f"{world_size} * {grad_accum} = {world_size * grad_accum}"
            )
        if rank >= world_size:
            raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
        if micro >= grad_accum:
            raise ValueError(f"micro={micro} is out of range for grad_accum={grad_accum}")
        b = self.batch_size // (world_size * grad_accum)
        start = (rank * grad_accum + micro) * b  # rank's slice of the global batch, then the micro slice in it
        return self._windows(self.offsets(step)[start : start + b])

    def _windows(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = offsets[:, None] + np.arange(self.context_length + 1)  # (b, 1) + (T + 1,) -> (b, T + 1)
        rows = torch.from_numpy(self.tokens[index].astype(np.int64))  # (b, T + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (b, T) each

    def __repr__(self) -> str:
        return (
            f"Batches(tokens={self.tokens.size}, batch_size={self.batch_size}, "
            f"context_length={self.context_length}, seed={self.seed})"
        )


def val_batches(
    tokens: np.ndarray, *, batch_size: int, context_length: int, num_batches: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches, the same on every call.

    Batch ``i`` is step ``i`` of ``Batches(tokens, batch_size=..., context_length=..., seed=seed)``.

    Returns:
        ``num_batches`` pairs ``(x, y)`` of int64 tensors [batch_size, T].

    Raises:
        ValueError: as :class:`Batches`, or ``num_batches`` < 1.
    """
    num_batches = _positive_int("num_batches", num_batches)
    batches = Batches(tokens, batch_size=batch_size, context_length=context_length, seed=seed)
    return [batches.get(i) for i in range(num_batches)]
