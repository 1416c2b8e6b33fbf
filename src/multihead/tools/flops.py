"""Cost of an attention kind at any size, without allocating its weights.

    attention_cost("gqa", embed_dim=4096, num_heads=32, num_kv_heads=8, T=2048)

builds the kind on the meta device and asks its ``cost`` method
(conventions in ``multihead.modules.cost``).
"""

from __future__ import annotations

import torch

from ..modules.cost import AttentionCost
from ..modules.registry import build_attention

__all__ = ["attention_cost"]


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
