"""The layers of the encoder-decoder Transformer (``models.transformer``) and its decoding cache.

    EncoderLayer   x [B, S, C] -> self-attention (source padding masked) -> feed-forward
    DecoderLayer   y [B, T, C] -> causal self-attention -> cross-attention over memory
                   [B, S, C] -> feed-forward
    DecoderCache   one self-attention cache per decoder layer, and the cross-attention
                   caches of the memory once the first step filled them

Each sublayer is wrapped in a residual connection, pre-norm ``x + drop(f(norm(x)))``
or post-norm ``norm(x + drop(f(x)))`` (``norm_first``). The attention modules
are built by ``transformer.transformer_attention`` and passed in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.kv_cache import KVCache

__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "DecoderCache"]


class FeedForward(nn.Module):
    """linear2(dropout(relu(linear1(x)))): [B, T, C] -> [B, T, C]."""

    def __init__(self, embed_dim: int, ffn_dim: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear1 = nn.Linear(embed_dim, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(x))))


class _Residual(nn.Module):
    """Pre-norm ``x + drop(f(norm(x)))`` or post-norm ``norm(x + drop(f(x)))``."""

    def __init__(self, embed_dim: int, *, dropout: float, norm_first: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, f) -> torch.Tensor:
        if self.norm_first:
            return x + self.dropout(f(self.norm(x)))
        return self.norm(x + self.dropout(f(x)))


class EncoderLayer(nn.Module):
    """Self-attention (source padding masked) then feed-forward, each residual: [B, S, C] -> [B, S, C]."""

    def __init__(self, self_attn: nn.Module, embed_dim: int, ffn_dim: int, *, dropout: float,
                 norm_first: bool, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.ffn = FeedForward(embed_dim, ffn_dim, dropout=dropout)
        self.sublayers = nn.ModuleList(_Residual(embed_dim, dropout=dropout, norm_first=norm_first, eps=eps)
                                       for _ in range(2))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.sublayers[0](x, lambda h: self.self_attn(h, key_mask=key_mask))
        return self.sublayers[1](x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over memory, feed-forward: [B, T, C] -> [B, T, C]."""

    def __init__(self, self_attn: nn.Module, cross_attn: nn.Module, embed_dim: int, ffn_dim: int, *,
                 dropout: float, norm_first: bool, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.cross_attn = cross_attn
        self.ffn = FeedForward(embed_dim, ffn_dim, dropout=dropout)
        self.sublayers = nn.ModuleList(_Residual(embed_dim, dropout=dropout, norm_first=norm_first, eps=eps)
                                       for _ in range(3))

    def forward(self, x, memory, *, src_key_mask=None, tgt_key_mask=None, self_cache=None,
                cross_cache=None, return_weights=False):
        """One decoder layer.

        Args:
            x: [B, T, C] decoder states. memory: [B, S, C] encoder output.
            src_key_mask: [B, S] bool, True = real. tgt_key_mask: [B, S_self] bool.
            self_cache: the layer's ``KVCache`` (decoding) or None.
            cross_cache: the layer's cross-attention cache of ``memory`` (decoding), or None.
            return_weights: also return the cross-attention weights.

        Returns:
            (out [B, T, C], cross-attention weights [B, H, T, S] or None).
        """
        x = self.sublayers[0](x, lambda h: self.self_attn(
            h, key_mask=tgt_key_mask, is_causal=True, kv_cache=self_cache))
        kept = []

        def cross(h):
            out = self.cross_attn(h, memory, memory, key_mask=src_key_mask, kv_cache=cross_cache,
                                  return_weights=return_weights)
            if return_weights:
                out, w = out
                kept.append(w)
            return out

        x = self.sublayers[1](x, cross)
        return self.sublayers[2](x, self.ffn), (kept[0] if kept else None)


class DecoderCache:
    """Decoding state for ``Transformer.decode(..., kv_caches=...)``; from ``make_kv_caches``.

    Holds one self-attention ``KVCache`` per decoder layer (``cache[i]``) and, after
    the first call, one cross-attention cache per layer holding the keys/values of the
    memory it was called with (later calls must pass that same memory tensor). ``length`` is the number of
    target positions decoded so far; ``reset()`` forgets everything.
    """

    def __init__(self, self_attn: list[KVCache]) -> None:
        self.self_attn = list(self_attn)
        self.memory: torch.Tensor | None = None
        self.cross: list[KVCache] | None = None

    @property
    def length(self) -> int:
        return self.self_attn[0].length

    def reset(self) -> None:
        for cache in self.self_attn + (self.cross or []):
            cache.reset()
        self.memory, self.cross = None, None

    def __len__(self) -> int:
        return len(self.self_attn)

    def __getitem__(self, i: int) -> KVCache:
        return self.self_attn[i]
