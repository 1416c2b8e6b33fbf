"""The shared options ``sinks`` and ``window`` of every attention layer.

``sinks=True``: a learned logit per query head, ``layer.sinks`` [H] (zeros
at first), handed to ``functional.attention(sinks=...)`` by the default core:
one more softmax column that mixes no value, so a head may attend to
"nothing" (gpt-oss). Kinds whose core is not ``functional.attention`` refuse
it (``refused_options``).

``window=w``: key j is visible to query i only when j <= i and j > i - w (the
query and the w - 1 keys before it, gpt-oss / Mistral local layers), at the
queries' and keys' positions: 0 .. S - 1 for the keys and the causal
alignment's positions for the queries, or the positions a streaming cache
keeps (``streaming_cache``). It is a mask, merged with the call's own by AND,
so every kind takes it. It includes causality (j <= i) whatever ``is_causal``
says; a cross-attention call (``key`` given) is refused. Decoding, such a
layer needs only its last w positions: ``window_cache`` (``GPT.make_kv_caches``
builds one per local block).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from .window_cache import WindowKVCache

__all__ = ["check_window", "make_sinks", "local_mask", "kept_key_columns"]


def check_window(window: object) -> int | None:
    """The ``window`` option: None or an int >= 1.

    Raises:
        TypeError / ValueError: naming the value.
    """
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int >= 1 or None, got window={window!r}")
    if window < 1:
        raise ValueError(f"window must be an int >= 1 or None, got window={window}")
    return int(window)


def make_sinks(sinks: object, num_heads: int, factory: dict) -> nn.Parameter | None:
    """``layer.sinks``: a [H] parameter of zeros for ``sinks=True``, None for False.

    Raises:
        TypeError: a value other than a bool.
    """
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks must be a bool, got sinks={sinks!r}")
    return nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None


def local_mask(window: int | None, kv_cache, T: int, S: int, alignment: str, cross: bool, device) -> torch.Tensor | None:
    """bool [T, S] (True = may attend) of the layer's window and of a streaming
    cache's visible keys, or None when neither applies.

    Without a streaming cache, key j sits at position j and query i at
    i + offset (0 top-left, S - T bottom-right). A streaming cache gives the
    positions of the keys it keeps; the T queries are its last T keys.

    Raises:
        ValueError: a window on a cross-attention call.
    """
    visible_keys = getattr(kv_cache, "visible_keys", None) if kv_cache is not None and not cross else None
    if window is None and visible_keys is None:
        return None
    if cross and window is not None:
        raise ValueError(f"window={window} is for self-attention: a cross-attention call (key given) has no "
                         "query and key positions in common")  # fmt: skip
    if visible_keys is not None:
        k_pos = kv_cache.key_positions().to(device)  # (S,)
        q_pos = k_pos[S - T :]
        mask = visible_keys(q_pos, k_pos)
    else:
        k_pos = torch.arange(S, device=device)
        q_pos = torch.arange(T, device=device) + (0 if alignment == "top_left" else S - T)
        mask = None
    if window is not None:
        near = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)  # (T, S)
        mask = near if mask is None else mask & near
    return mask


def kept_key_columns(mask: torch.Tensor | None, kv_cache, S: int) -> torch.Tensor | None:
    """A mask over every position a ``WindowKVCache`` was written, [..., length],
    cut to its last S columns: the keys a call over that cache attends to (the
    last ones written, in order). Any other mask as it is."""
    if mask is None or not isinstance(kv_cache, WindowKVCache) or not isinstance(mask, torch.Tensor):
        return mask
    n = kv_cache.length
    return mask[..., n - S :] if mask.dim() >= 1 and mask.shape[-1] == n and S < n else mask
