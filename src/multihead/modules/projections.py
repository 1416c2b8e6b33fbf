"""Projections shared by the attention kinds: one fused q|k|v matrix, heads split.

    self-attention:   x (B, T, C) --qkv_proj--> (B, T, wq + wk + wv) --split--> q, k, v
    cross-attention:  query --rows[q]--> q;  key --rows[k|v]--> k, v (one matmul
                      when value is key, else key --rows[k]--> k, value --rows[v]--> v)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fused_qkv", "split_heads"]


def fused_qkv(
    qkv_proj: nn.Linear,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    widths: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project through one matrix whose output rows are [q | k | v].

    Args:
        qkv_proj: Linear with wq + wk + wv output rows.
        query: [B, T, C]; key: [B, S, C] or None (self-attention);
        value: [B, S, C] or None (the key tensor).
        widths: (wq, wk, wv).

    Returns:
        q [B, T, wq], k [B, S, wk], v [B, S, wv].
    """
    if key is None:
        return qkv_proj(query).split(list(widths), dim=-1)  # (B, T, wq + wk + wv) -> q, k, v
    W, b = qkv_proj.weight, qkv_proj.bias
    wq, wk, wv = widths

    def rows(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return W[lo:hi], None if b is None else b[lo:hi]

    q = F.linear(query, *rows(0, wq))
    if value is None or value is key:
        k, v = F.linear(key, *rows(wq, wq + wk + wv)).split([wk, wv], dim=-1)
    else:
        k, v = F.linear(key, *rows(wq, wq + wk)), F.linear(value, *rows(wq + wk, wq + wk + wv))
    return q, k, v


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, heads·D] -> [B, heads, L, D]."""
    B, L, width = x.shape
    return x.view(B, L, heads, width // heads).transpose(1, 2)  # (B, L, heads*D) -> (B, heads, L, D)
