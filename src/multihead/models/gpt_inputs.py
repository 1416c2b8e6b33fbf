"""What ``GPT.forward`` checks and derives before the model runs.

    check_token_ids(idx, vocab)           idx [B, T]: dtype, shape, ids in range -> (B, T)
    check_caches(kv_caches, blocks, B, T) one per block, equal lengths, room for T -> cached length
    graph_step_inputs(kv_caches, blocks, ...)  one token over ``GraphKVCache``s -> (key mask [B, S_max], position [1, 1])
    check_parameter_dtypes(model)         one floating dtype for every parameter (TypeError naming them)
    token_positions(mask, position_ids)   the padding mask [B, S] (True = real token)
                                          and the positions [B, T] or [1, T]
    next_token_loss(logits, targets, labels)  the loss of ``model(idx, targets)`` / ``labels=``

Two conventions for the language-model loss, nanoGPT's and Hugging Face's::

    idx      t0 t1 t2 t3
    targets  t1 t2 t3 t4      the token after each position (not shifted inside); -1 ignored
    labels   t0 t1 t2 t3      the inputs themselves: shifted inside (logits[:, :-1] vs labels[:, 1:]); -100 ignored

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

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..modules.graph_cache import supports_graph_steps

__all__ = [
    "LMOutput", "check_caches", "check_logits_to_keep", "check_parameter_dtypes", "check_token_ids", "loss_of",
    "next_token_loss", "positions_from_mask", "scored_tokens", "token_positions", "graph_step_inputs",
    "known_token_ids",
]  # fmt: skip

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


_KNOWN_IDS: ContextVar[bool] = ContextVar("known_token_ids", default=False)


@contextmanager
def known_token_ids() -> Iterator[None]:
    """Inside: ``check_token_ids`` checks dtype and shape but not the id range
    (no host read). For ids already checked or produced by the model itself
    (``generate``'s steps: an argmax or a draw over the vocabulary is in range)."""
    token = _KNOWN_IDS.set(True)
    try:
        yield
    finally:
        _KNOWN_IDS.reset(token)


def check_token_ids(idx: object, vocab_size: int) -> tuple[int, int]:
    """(B, T) of token ids ``idx`` [B, T].

    Raises:
        TypeError: not a tensor, or not int64/int32.
        ValueError: not 2-D with T >= 1, or (eager, outside ``known_token_ids``)
            ids outside [0, vocab_size).
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _ID_DTYPES:
        raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype} (use torch.int64 or torch.int32)")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must be (B, T) with T >= 1, got {tuple(idx.shape)}")
    if _eager() and idx.numel() and not _KNOWN_IDS.get() and (int(idx.min()) < 0 or int(idx.max()) >= vocab_size):
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


def graph_step_inputs(
    kv_caches: list, blocks: Any, attention_mask: object, position_ids: object, B: int, T: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key mask [B, S_max] bool, positions [1, 1]) of a one-token call over
    one ``GraphKVCache`` per block (``modules.graph_cache``): the slots up to
    the caches' shared ``position``, and that position.

    Raises:
        ValueError: a wrong number of caches, caches that are not
            ``GraphKVCache``s sharing one position, T != 1 or another batch
            size, an ``attention_mask`` or ``position_ids`` (the caches place
            the token), or (eager) a block whose attention cannot decode
            over them (``supports_graph_steps``).
    """
    if len(kv_caches) != len(blocks):
        raise ValueError(f"need one KV cache per block: {len(blocks)}, got {len(kv_caches)}")
    given = [name for name, value in (("attention_mask", attention_mask), ("position_ids", position_ids))
             if value is not None]  # fmt: skip
    if given:
        raise ValueError(f"a forward over GraphKVCaches takes no {' or '.join(given)}: the caches' position "
                         "places the token and masks the empty slots")  # fmt: skip
    position = kv_caches[0].position
    for i, (cache, block) in enumerate(zip(kv_caches, blocks)):
        if _eager() and (not hasattr(cache, "visible_slots") or cache.position is not position):
            raise ValueError(f"KV cache of block {i}: every block needs a GraphKVCache sharing block 0's position")
        try:
            cache.check_append(B, T)
        except ValueError as err:
            raise ValueError(f"KV cache of block {i}: {err}") from None
        if _eager() and not supports_graph_steps(block.attn):
            raise ValueError(f"block {i}'s attention ({getattr(block.attn, 'kind', type(block.attn).__name__)}) "
                             "cannot decode over a GraphKVCache: it has rope, ALiBi, a window or a cache of its own")  # fmt: skip
    return kv_caches[0].visible_slots(B), position.view(1, 1)


def check_parameter_dtypes(model: torch.nn.Module) -> None:
    """Refuse a model whose floating parameters mix dtypes (say one block
    converted with ``.double()``): the layers would meet inputs of another
    dtype than their weights. Skipped inside ``torch.compile`` and
    ``torch.autocast`` (which casts per operation).

    Raises:
        TypeError: naming each dtype and a parameter of it.
    """
    if not _eager():
        return
    first: dict[torch.dtype, str] = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in first:
            first[p.dtype] = name
    if len(first) < 2 or torch.is_autocast_enabled(next(model.parameters()).device.type):
        return
    mixed = ", ".join(f"{dtype} ({name}, ...)" for dtype, name in first.items())
    raise TypeError(f"the model's parameters mix dtypes {mixed}: convert the whole model, e.g. model.to({next(iter(first))})")


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


# ------------------------------------------------------------------ the loss
TARGETS_IGNORE = -1  # nanoGPT's ignore_index
LABELS_IGNORE = -100  # Hugging Face's


class LMOutput(NamedTuple):
    """What ``GPT.forward`` returns when given ``targets`` or ``labels``.

    A pair, so nanoGPT's ``logits, loss = model(idx, targets)`` unpacks it;
    ``.logits`` and ``.loss`` read it as Hugging Face's outputs are read.
    (Indexing follows the pair: ``out[0]`` is the logits, where Hugging
    Face's ``out[0]`` is the loss.)

    Attributes:
        logits: [B, T, vocab_size].
        loss: 0-d mean cross-entropy over the positions not ignored.
    """

    logits: torch.Tensor
    loss: torch.Tensor


def _check_ids_like(name: str, ids: object, B: int, T: int, vocab_size: int, ignore: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype} (use torch.int64 or torch.int32)")
    if tuple(ids.shape) != (B, T):
        raise ValueError(f"{name} must be (B, T) = ({B}, {T}) like idx, got {tuple(ids.shape)}")
    if _eager() and ids.numel():
        bad = (ids != ignore) & ((ids < 0) | (ids >= vocab_size))
        if bool(bad.any()):
            raise ValueError(
                f"{name} must be token ids in [0, {vocab_size}) or {ignore} (ignored), got {int(ids[bad][0])}"
            )
    return ids.long()


def scored_tokens(targets: object, labels: object, B: int, T: int, vocab_size: int) -> torch.Tensor | None:
    """The token each of the T positions is scored on, [B, T] int64 with -100
    where ignored; None without targets or labels.

    nanoGPT's ``targets`` are taken as they are (-1 -> -100); Hugging Face's
    ``labels`` are shifted left by one, the last position ignored.

    Raises:
        TypeError: not an int64/int32 tensor.
        ValueError: both given, a shape other than [B, T], or (eager) ids
            outside [0, vocab_size) other than the ignored value.
    """
    if targets is None and labels is None:
        return None
    if targets is not None and labels is not None:
        raise ValueError("give targets (nanoGPT's, not shifted) or labels (Hugging Face's, shifted inside), not both")
    if targets is not None:
        want = _check_ids_like("targets", targets, B, T, vocab_size, TARGETS_IGNORE)
        return want.masked_fill(want == TARGETS_IGNORE, LABELS_IGNORE)
    want = _check_ids_like("labels", labels, B, T, vocab_size, LABELS_IGNORE)
    return F.pad(want[:, 1:], (0, 1), value=LABELS_IGNORE)  # (B, T): position t scored on labels[:, t + 1]


def next_token_loss(logits: torch.Tensor, targets: object = None, labels: object = None) -> torch.Tensor | None:
    """The mean next-token cross-entropy of ``logits`` [B, T, V] (0-d), or None without targets or labels.

    Args:
        targets: [B, T], the token after each position (nanoGPT's); -1 ignored.
        labels: [B, T], the input ids themselves (Hugging Face's): position
            t is scored on labels[:, t + 1]; -100 ignored.

    The mean runs over the positions not ignored, in float32 at least
    (float16/bfloat16 logits are upcast); a batch whose every position is
    ignored gives NaN, as torch's mean does.

    Raises:
        TypeError / ValueError: as ``scored_tokens``.
    """
    B, T, V = logits.shape
    want = scored_tokens(targets, labels, B, T, V)
    return None if want is None else loss_of(logits, want)


def loss_of(logits: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against ``scored_tokens`` [B, T] (-100 ignored)."""
    V = logits.shape[-1]
    scores = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return F.cross_entropy(scores.reshape(-1, V), want.reshape(-1), ignore_index=LABELS_IGNORE)


def check_logits_to_keep(value: object, scored: bool) -> None:
    """``logits_to_keep``: an int >= 0, and 0 when a loss is asked for (it needs every position).

    Raises:
        TypeError: not an int.
        ValueError: negative, or positive together with targets or labels.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"logits_to_keep must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (0 = every position), got {value}")
    if value and scored:
        raise ValueError(f"logits_to_keep={value} keeps part of the logits; the loss of targets or labels needs all")
