"""Cost of an attention kind at any size, without allocating its weights.

    attention_cost("gqa", embed_dim=4096, num_heads=32, num_kv_heads=8, T=2048)

builds the kind on the meta device and asks its ``cost`` method
(conventions in ``multihead.modules.cost``).

    kv_cache_size(model)     # KVCacheSize(1024, "float32"); str(...) == "1024 bytes/token (float32)"

is the one number every command prints for a whole model's KV cache: the
bytes one token of one sequence takes in every attention layer's cache
(``cost().kv_cache_bytes_per_token`` of each layer, with its own heads,
summed over the layers), at the model's own dtype (its parameters'), with that
element type named. A local layer's decoding cache (``window_cache``, what
``GPT.make_kv_caches`` builds for a layer with a window) holds at most its
window, so the bytes of a sequence depend on its length: ``kv_cache_size(model,
context=n)`` also gives the bytes of one sequence's caches at n positions, each layer counting
``window_cache.cached_positions(layer, n)`` positions (min(n, window) for a
local layer)::

    size = kv_cache_size(gpt2_small_5_local_1_global, context=1024)   # window 128, float32
    str(size)    # "73728 bytes/token (float32); 20447232 bytes per sequence at 1024 positions
                 #  (local layers hold their window)"
    size.bytes   # 20447232: 10 local blocks x 128 + 2 global x 1024 positions, 6144 bytes each
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..modules.base import AttentionLayer
from ..modules.cost import AttentionCost
from ..modules.registry import build_attention
from ..modules.window_cache import cached_positions

__all__ = ["attention_cost", "KVCacheSize", "kv_cache_size"]


def attention_cost(
    name: str,
    *,
    embed_dim: int,
    num_heads: int,
    T: int,
    S: int | None = None,
    batch: int = 1,
    causal: bool = False,
    bytes_per_element: int = 2,
    **options,
) -> AttentionCost:
    """FLOPs, parameters and KV-cache bytes of one layer of kind ``name``.

    Raises:
        ValueError: unknown kind or invalid options (as ``build_attention``).
    """
    with torch.device("meta"):
        module = build_attention(name, embed_dim=embed_dim, num_heads=num_heads, **options)
    return module.cost(T, S, batch=batch, causal=causal, bytes_per_element=bytes_per_element)


@dataclass(frozen=True)
class KVCacheSize:
    """KV-cache bytes of one sequence over all attention layers, at ``dtype`` (e.g. "float32").

    Attributes:
        bytes_per_token: every layer's bytes for one cached position.
        dtype: the element type's name.
        context: the positions ``bytes`` is counted at (None: not counted).
        bytes: one sequence's caches at ``context`` positions, local layers
            holding at most their window (None without a context).
    """

    bytes_per_token: int
    dtype: str
    context: int | None = None
    bytes: int | None = None

    def __str__(self) -> str:
        line = f"{self.bytes_per_token} bytes/token ({self.dtype})"
        if self.bytes is None or self.bytes == self.bytes_per_token * self.context:
            return line
        return f"{line}; {self.bytes} bytes per sequence at {self.context} positions (local layers hold their window)"


def kv_cache_size(model: nn.Module, dtype: torch.dtype | None = None, *, context: int | None = None) -> KVCacheSize:
    """The KV cache of every attention layer in ``model``, per token and at ``context`` positions, at ``dtype``.

    Args:
        model: any module holding multihead attention layers (GPT, BERT,
            SentenceEncoder, a single layer); a layer that caches nothing
            counts 0.
        dtype: the cache's element type (default: the model's parameters').
        context: positions of one sequence for ``bytes`` (None: not counted).

    Raises:
        ValueError: ``model`` holds no multihead attention layer, or a context below 1.
    """
    layers, names = [], []
    for name, m in model.named_modules():
        if isinstance(m, AttentionLayer) and not any(name.startswith(f"{n}.") or n == "" for n in names):
            layers.append(m)  # outermost attention layers only: one inside another is counted by it
            names.append(name)
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no multihead attention layer")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"context must be a positive int, got context={context!r}")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    per_layer = [int(layer.cost(1, bytes_per_element=size).kv_cache_bytes_per_token) for layer in layers]
    held = None if context is None else sum(b * cached_positions(m, context) for b, m in zip(per_layer, layers))
    return KVCacheSize(sum(per_layer), str(dtype).removeprefix("torch."), context, held)
