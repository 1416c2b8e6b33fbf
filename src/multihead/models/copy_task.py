"""The copy task of the Annotated Transformer: batches to train ``models.Transformer`` on.

    for b in copy_task_batches(400, 32, 10, 11, min_len=5):    # batches, B, longest L, V
        logits = model(b.src, b.tgt[:, :-1], src_key_mask=b.src_key_mask)      # (B, L+1, V)
        loss = F.cross_entropy(logits.reshape(-1, 11), b.tgt[:, 1:].reshape(-1), ignore_index=0)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from .._checks import positive_int

__all__ = ["CopyBatch", "copy_task_batches"]


class CopyBatch(NamedTuple):
    """One copy-task batch: ``src`` [B, L+1] = tokens, eos, pad...; ``tgt`` [B, L+2] = bos, tokens, eos, pad...;
    the padding masks are True at real tokens. Train on ``model(src, tgt[:, :-1])`` against ``tgt[:, 1:]``."""

    src: torch.Tensor
    tgt: torch.Tensor
    src_key_mask: torch.Tensor
    tgt_key_mask: torch.Tensor


def copy_task_batches(num_batches: int, batch_size: int, seq_len: int, vocab_size: int, *,
                      min_len: int | None = None, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2,
                      generator: torch.Generator | None = None) -> Iterator[CopyBatch]:
    """Synthetic copy task (the Annotated Transformer's ``data_gen``, with eos and padding).

    Each row copies ``n`` tokens drawn uniformly from ``max(pad, bos, eos) + 1 .. vocab_size - 1``
    (3..V-1 by default), ``n`` uniform in ``[min_len, seq_len]`` (``min_len`` defaults to
    ``seq_len``: every row full length, no padding).

    Yields:
        ``num_batches`` CopyBatch tuples.

    Raises:
        ValueError: sizes, or a vocabulary with no room for ordinary tokens.
    """
    for name, value in (("num_batches", num_batches), ("batch_size", batch_size), ("seq_len", seq_len)):
        positive_int(name, value)
    min_len = seq_len if min_len is None else positive_int("min_len", min_len)
    if min_len > seq_len:
        raise ValueError(f"min_len={min_len} must be <= seq_len={seq_len}")
    first = max(pad_id, bos_id, eos_id) + 1
    if positive_int("vocab_size", vocab_size) <= first:
        raise ValueError(f"vocab_size={vocab_size} leaves no ordinary tokens after special ids up to {first - 1}")
    for _ in range(num_batches):
        body = torch.randint(first, vocab_size, (batch_size, seq_len), generator=generator)
        lengths = torch.randint(min_len, seq_len + 1, (batch_size,), generator=generator)
        pos = torch.arange(seq_len + 1)[None, :]  # (1, L+1)
        src = torch.cat([body, torch.full((batch_size, 1), pad_id)], dim=1)  # (B, L) -> (B, L+1)
        src = torch.where(pos < lengths[:, None], src, pad_id)
        src[torch.arange(batch_size), lengths] = eos_id
        tgt = torch.cat([torch.full((batch_size, 1), bos_id), src], dim=1)  # (B, L+1) -> (B, L+2)
        yield CopyBatch(src, tgt, src != pad_id, tgt != pad_id)
