"""What ``GPT.forward`` checks and derives before the model runs.

    check_token_ids(idx, vocab)           idx [B, T]: dtype, shape, ids in range -> (B, T)
    check_caches(kv_caches, blocks, B, T) one per block, equal lengths, room for T -> cached length
    token_positions(mask, position_ids)   the padding mask [B, S] (True = real token)
                                          and the positions [B, T] or [1, T]

Left-padded batches count positions over real tokens only, as Hugging Face
does for batched generation, so a padded prompt gets the logits of the
unpadded one::

    attention_mask  0 0 1 1 1        (two pads, then the prompt)
    position_ids    0 0 0 1 2        cumsum(mask) - 1, pads set to 0

Checks that read the data (ids and positions in range: a host sync) run in
eager mode only and are skipped inside ``torch.compile``; shape and dtype
checks run everywhere.
"""

from __future__ import annotations

import torch

__all__ = ["check_caches", "check_token_ids", "positions_from_mask", "token_positions"]

_ID_DTYPES = (torch.int64, torch.int32)  # the index dtypes nn.Embedding accepts


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] counting real tokens only (Hugging Face's rule).

    Args:
        attention_mask: [B, S] bool, 1/True = real token.

    Returns:
        cumsum(mask) - 1 with pad positions set to 0, long [B, S].
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _eager() -> bool:
    return not torch.compiler.is_compiling()


def check_token_ids(idx: object, vocab_size: int) -> tuple[int, int]:
    """(B, T) of token ids ``idx`` [B, T].

    Raises:
        TypeError: not a tensor, or not int64/int32.
        ValueError: not 2-D with T >= 1, or (eager) ids outside [0, vocab_size).
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _ID_DTYPES:
        raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype} (use torch.int64 or torch.int32)")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must be (B, T) with T >= 1, got {tuple(idx.shape)}")
    if _eager() and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got min {int(idx.min())}, max {int(idx.max())}")
    B, T = idx.shape
    return B, T


def _check_position_ids(position_ids: object, B: int, T: int, context_length: int) -> torch.Tensor:
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype not in _ID_DTYPES:
        raise TypeError(
            f"position_ids must be integer positions, got dtype {position_ids.dtype} (use torch.int64 or torch.int32)"
        )
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, B) or position_ids.shape[1] != T:
        raise ValueError(f"position_ids must be (B, T) or (1, T) = ({B}, {T}), got {tuple(position_ids.shape)}")
    if _eager() and (int(position_ids.min()) < 0 or int(position_ids.max()) >= context_length):
        raise ValueError(
            f"position_ids must be in [0, {context_length}), got min {int(position_ids.min())}, "
            f"max {int(position_ids.max())}"
        )
    return position_ids


def token_positions(
    attention_mask: object,
    position_ids: object,
    *,
    B: int,
    T: int,
    past: int,
    context_length: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(key padding [B, S] bool or None, positions [B, T] or [1, T]) of T new tokens after ``past`` cached ones.

    Args:
        attention_mask: None or [B, S] with 1/True = real token, S = past + T.
        position_ids: None (from the mask, else past .. past + T - 1) or
            [B, T] / [1, T] int64/int32 in [0, context_length).

    Raises:
        TypeError: a mask or positions that are not tensors, positions of a
            float or other dtype.
        ValueError: S beyond ``context_length``, a mask not (B, S), positions
            of another shape or (eager) out of range.
    """
    S = past + T
    if S > context_length:
        raise ValueError(f"sequence of {S} tokens ({past} cached + {T} new) exceeds context_length={context_length}")
    key_padding = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must be (B, cached + T) = ({B}, {S}), got {tuple(attention_mask.shape)}")
        key_padding = attention_mask.to(device=device) != 0  # bool, True = real token
    if position_ids is not None:
        return key_padding, _check_position_ids(position_ids, B, T, context_length)
    if key_padding is not None:
        return key_padding, positions_from_mask(key_padding)[:, past:]  # (B, S) -> (B, T)
    return key_padding, torch.arange(past, S, device=device)[None, :]  # (1, T)


def check_caches(kv_caches: list, num_blocks: int, B: int, T: int) -> int:
    """Validate every cache before any is written; return the cached length.

    Raises:
        TypeError: a cache length that is not a Python int.
        ValueError: a wrong number of caches, caches of different lengths,
            or a cache that cannot take T more positions of batch B.
    """
    if len(kv_caches) != num_blocks:
        raise ValueError(f"need one KV cache per block: {num_blocks}, got {len(kv_caches)}")
    lengths = [cache.length for cache in kv_caches]
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"KV cache {i} length must be a Python int, got {type(length).__name__}")
    if any(length != lengths[0] for length in lengths):
        raise ValueError(f"every block's KV cache must hold the same length, got lengths {lengths}")
    for i, cache in enumerate(kv_caches):
        try:
            cache.check_append(B, T)
        except ValueError as err:
            raise ValueError(f"KV cache of block {i}: {err}") from None
    return lengths[0]
