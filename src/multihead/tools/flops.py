"""Cost of an attention kind at any size, without allocating its weights.

    attention_cost("gqa", embed_dim=4096, num_heads=32, num_kv_heads=8, T=2048)

builds the kind on the meta device and asks its ``cost`` method
(conventions in ``multihead.modules.cost``).

    kv_cache_size(model)     # KVCacheSize(1024, "float32"); str(...) == "1024 bytes/token (float32)"

is the one number every command prints for a whole model's KV cache: the
bytes one token of one sequence takes in every attention layer's cache
(``cost().kv_cache_bytes_per_token`` of each layer, with its own heads,
summed over the layers; a windowed layer's cache holds every position as a
global one's does), at the model's own dtype (its parameters'), with that
element type named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..modules.base import AttentionLayer
from ..modules.cost import AttentionCost
from ..modules.registry import build_attention

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
    """KV-cache bytes per token of one sequence, over all attention layers, at ``dtype`` (e.g. "float32")."""

    bytes_per_token: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.bytes_per_token} bytes/token ({self.dtype})"


def kv_cache_size(model: nn.Module, dtype: torch.dtype | None = None) -> KVCacheSize:
    """The KV cache of every attention layer in ``model``, per token, at ``dtype``.

    Args:
        model: any module holding multihead attention layers (GPT, BERT,
            SentenceEncoder, a single layer); a layer that caches nothing
            counts 0.
        dtype: the cache's element type (default: the model's parameters').

    Raises:
        ValueError: ``model`` holds no multihead attention layer.
    """
    layers, names = [], []
    for name, m in model.named_modules():
        if isinstance(m, AttentionLayer) and not any(name.startswith(f"{n}.") or n == "" for n in names):
            layers.append(m)  # outermost attention layers only: one inside another is counted by it
            names.append(name)
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no multihead attention layer")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    total = sum(layer.cost(1, bytes_per_element=size).kv_cache_bytes_per_token for layer in layers)
    return KVCacheSize(int(total), str(dtype).removeprefix("torch."))
