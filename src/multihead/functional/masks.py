"""Mask builders. Every boolean mask here means True = "may attend".

Shapes: T query length, S key length, B batch. Builders return masks that
broadcast against attention scores of shape (B, H, T, S):

* ``causal_mask`` and ``sliding_window_mask`` -> (T, S)
* the padding builders -> (B, 1, 1, S)
* ``document_mask`` (packed sequences) -> (B, 1, T, S)
* ``prefix_lm_mask`` -> (T, S), or (B, 1, T, S) for one prefix per row

Causal alignment when T != S (``x`` = may attend), T = 2, S = 4::

    top_left            bottom_right
    q0  x . . .         q0  x x x .
    q1  x x . .         q1  x x x x

``top_left`` lines query i up with key i (training on a fresh sequence);
``bottom_right`` lines the last query up with the last key (decoding with a
KV cache, where the T new queries come after S - T cached keys). With
``bottom_right`` and T > S the first T - S queries see no key at all; the
attention functions return zeros for such rows.
"""

from __future__ import annotations

import torch

from .._checks import non_negative_int

ALIGNMENTS = ("top_left", "bottom_right")

__all__ = [
    "ALIGNMENTS",
    "causal_mask",
    "sliding_window_mask",
    "padding_mask_from_lengths",
    "padding_mask_from_keep",
    "padding_mask_from_ignore",
    "check_alignment",
    "merge_masks",
    "document_mask",
    "prefix_lm_mask",
]


def check_alignment(alignment: str) -> str:
    """Return ``alignment`` if it is a known causal alignment.

    Raises:
        ValueError: naming the valid alignments.
    """
    if alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {ALIGNMENTS}, got {alignment!r}"
        )
    return alignment


def _offset(T: int, S: int, alignment: str) -> int:
    """Key index that query 0 may see up to (inclusive)."""
    return 0 if check_alignment(alignment) == "top_left" else S - T


def causal_mask(
    T: int,
    S: int | None = None,
    *,
    alignment: str = "top_left",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Causal mask: query i may attend to key j iff j <= i + offset.

    Args:
        T: query length.
        S: key length (defaults to T).
        alignment: ``"top_left"`` (offset 0) or ``"bottom_right"``
            (offset S - T); see the module docstring for a picture.
        device: where to build the mask.

    Returns:
        bool [T, S], True = may attend.

    Raises:
        ValueError: negative lengths or an unknown alignment.
    """
    T = non_negative_int("T", T)
    S = T if S is None else non_negative_int("S", S)
    offset = _offset(T, S, alignment)
    i = torch.arange(T, device=device).unsqueeze(1)  # (T, 1)
    j = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    return j <= i + offset


def sliding_window_mask(
    T: int,
    S: int | None = None,
    *,
    window: int,
    alignment: str = "top_left",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Causal mask that also hides keys more than ``window - 1`` steps back.

    Query i (at aligned position p = i + offset) may attend to key j iff
    p - window < j <= p, i.e. to itself and the ``window - 1`` keys before it
    (Mistral/Longformer-style local attention).

    Returns:
        bool [T, S], True = may attend.

    Raises:
        ValueError: window < 1, negative lengths or an unknown alignment.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    T = non_negative_int("T", T)
    S = T if S is None else non_negative_int("S", S)
    offset = _offset(T, S, alignment)
    pos = torch.arange(T, device=device).unsqueeze(1) + offset  # (T, 1)
    j = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    return (j <= pos) & (j > pos - window)


def padding_mask_from_lengths(
    lengths: torch.Tensor | list[int], S: int, *, left: bool = False
) -> torch.Tensor:
    """Padding mask from the number of real keys in each batch row.

    Args:
        lengths: [B] ints, each in [0, S].
        S: padded key length.
        left: True when padding sits at the start of each row (left-padded
            prompts for batched generation), False when it sits at the end.

    Returns:
        bool [B, 1, 1, S], True = real key (may attend).

    Raises:
        ValueError: a length outside [0, S] (checked in eager mode only;
            inside ``torch.compile`` the values are not read) or lengths
            not 1-D.
    """
    S = non_negative_int("S", S)
    if isinstance(lengths, (list, tuple)) and len(lengths) == 0:
        lengths = torch.zeros(0, dtype=torch.long)  # [] would become float32
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer tensor, got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    # The range check reads the values (a host sync): eager only.
    if not torch.compiler.is_compiling() and lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > S):
        raise ValueError(f"lengths must lie in [0, {S}], got {lengths.tolist()}")
    j = torch.arange(S, device=lengths.device).unsqueeze(0)  # (1, S)
    n = lengths.unsqueeze(1)  # (B, 1)
    keep = j >= S - n if left else j < n  # (B, S)
    return keep[:, None, None, :]  # (B, S) -> (B, 1, 1, S)


def _check_padding(name: str, mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got dtype {mask.dtype}")
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape (B, S), got {tuple(mask.shape)}")
    return mask


def padding_mask_from_keep(keep: torch.Tensor) -> torch.Tensor:
    """Padding mask from a (B, S) bool tensor where True marks a real key.

    This is the polarity of Hugging Face's ``attention_mask`` (1 = keep).

    Returns:
        bool [B, 1, 1, S], True = may attend.
    """
    return _check_padding("keep", keep)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)


def padding_mask_from_ignore(ignore: torch.Tensor) -> torch.Tensor:
    """Padding mask from a (B, S) bool tensor where True marks padding.

    This is the polarity of ``torch.nn.MultiheadAttention``'s
    ``key_padding_mask`` (True = ignore); the result is inverted to
    multihead's convention.

    Returns:
        bool [B, 1, 1, S], True = may attend.
    """
    return ~_check_padding("ignore", ignore)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)


def merge_masks(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Combine two masks on "may attend", never by adding two -inf planes.

    bool & bool -> logical AND; bool & float -> the float mask with -inf
    where the bool mask is False; float & float -> their sum (a sum that
    overflows to -inf still means "hidden"). Shapes broadcast.
    """
    if a is None or b is None:
        return b if a is None else a
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        return torch.where(b, a, torch.full((), float("-inf"), dtype=a.dtype, device=a.device))
    return a + b


def document_mask(document_ids: torch.Tensor, key_document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Packed sequences: a query may attend only to keys of its own document.

    Pass ``is_causal=True`` as well for causal packing (each document then
    sees only its own past). The ``flex`` backend skips the key blocks of
    other documents.

    Args:
        document_ids: (B, T) integer document index of each query.
        key_document_ids: (B, S) of each key; default ``document_ids`` (self-attention).

    Returns:
        bool [B, 1, T, S], True = same document (may attend).

    Raises:
        TypeError / ValueError: non-integer or non-2-D ids, batch sizes that differ.
    """
    key_document_ids = document_ids if key_document_ids is None else key_document_ids
    for name, ids in (("document_ids", document_ids), ("key_document_ids", key_document_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer torch.Tensor (B, T), got {getattr(ids, 'dtype', type(ids))}")
        if ids.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T), got {tuple(ids.shape)}")
    if document_ids.shape[0] != key_document_ids.shape[0]:
        raise ValueError(
            f"document_ids {tuple(document_ids.shape)} and key_document_ids "
            f"{tuple(key_document_ids.shape)} have different batch sizes"
        )
    return (document_ids[:, :, None] == key_document_ids[:, None, :])[:, None]  # (B, T, S) -> (B, 1, T, S)


def prefix_lm_mask(
    T: int,
    prefix: int | torch.Tensor,
    S: int | None = None,
    *,
    alignment: str = "top_left",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Prefix-LM: every query sees the first ``prefix`` keys, and the rest causally.

    Query i (at aligned position p = i + offset) may attend to key j iff
    j < prefix or j <= p. Pass it as ``attn_mask`` with ``is_causal=False``
    (causality is inside it).

    Args:
        T, S: query and key lengths (S defaults to T).
        prefix: int, or (B,) integer tensor of one prefix length per batch row.
        alignment: as ``causal_mask``.

    Returns:
        bool [T, S] for an int prefix, [B, 1, T, S] for a tensor; True = may attend.

    Raises:
        ValueError: a negative prefix, negative lengths, an unknown alignment.
    """
    causal = causal_mask(T, S, alignment=alignment, device=device)  # (T, S)
    j = torch.arange(causal.shape[1], device=causal.device)
    if isinstance(prefix, torch.Tensor):
        if prefix.dim() != 1 or prefix.dtype.is_floating_point or prefix.dtype == torch.bool:
            raise ValueError(f"prefix must be an int or a 1-D integer tensor (B,), got shape {tuple(prefix.shape)} dtype {prefix.dtype}")
        shared = j[None, :] < prefix.to(causal.device)[:, None]  # (B, S)
        return causal[None, None] | shared[:, None, None, :]  # (B, 1, T, S)
    prefix = non_negative_int("prefix", prefix)
    return causal | (j < prefix)[None, :]
