"""The blocks of ``models.gpt.GPT``: pre-LayerNorm attention, then an MLP.

    x [B, T, C] --ln_1--> attn (causal, key_mask, kv_cache) --dropout--> + x
                --ln_2--> mlp: fc (C -> M), GELU tanh, proj (M -> C), dropout --> + x

``block_attention(config, layer)`` builds block ``layer``'s attention from a
``GPTConfig``: its kind by name, its head counts (per layer after pruning),
its per-layer options and positions (rope / ALiBi for ``positions``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.registry import attention_class, build_attention
from .gpt_positions import position_options
from .head_layout import layer_head_options
from .layer_options import layer_options

__all__ = ["MLP", "Block", "block_attention"]


class MLP(nn.Module):
    """fc (C -> M), GELU with the tanh approximation, proj (M -> C), dropout; M = 4C by default."""

    def __init__(self, embed_dim: int, dropout: float = 0.0, hidden: int | None = None, **factory: Any) -> None:
        super().__init__()
        M = 4 * embed_dim if hidden is None else hidden
        self.fc = nn.Linear(embed_dim, M, **factory)
        self.proj = nn.Linear(M, embed_dim, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [B, T, C]."""
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


def block_attention(config: Any, layer: int = 0, **factory: Any) -> nn.Module:
    """The attention of block ``layer`` as ``config`` describes it (its head
    counts from ``layer_head_options``; its index for a kind that declares a
    ``layer_index_option``, unless the options set it), freshly initialised."""
    heads = layer_head_options(config, layer)
    given = layer_options(config.attention_options, config.layer_attention_options, layer)
    given = {**position_options(config.positions, given), **given}  # rope=True / alibi=True unless set
    index = attention_class(config.attention).layer_index_option
    if index is not None and index not in given:
        heads[index] = layer
    if "head_dim" in given:  # an explicit head_dim stays the layers' D
        heads.pop("head_dim", None)
    options: dict[str, Any] = {
        "qkv_bias": config.qkv_bias,
        "dropout": config.dropout,
        **given,
        **heads,
        **factory,
    }
    try:
        return build_attention(config.attention, embed_dim=config.embed_dim, **options)
    except (TypeError, ValueError) as e:  # name the per-layer entry the block was built with
        if not config.layer_attention_options:
            raise
        n = len(config.layer_attention_options)
        entry = config.layer_attention_options[layer % n]
        raise type(e)(f"block {layer} (layer_attention_options[{layer % n}] = {entry}): {e}") from None


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    ``layer`` picks the block's head counts when the config lists them per layer."""

    def __init__(self, config: Any, layer: int = 0, **factory: Any) -> None:
        super().__init__()
        C = config.embed_dim
        self.ln_1 = nn.LayerNorm(C, eps=config.layer_norm_eps, **factory)
        self.attn = block_attention(config, layer, **factory)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(C, eps=config.layer_norm_eps, **factory)
        self.mlp = MLP(C, config.dropout, config.mlp_dim, **factory)

    def forward(
        self, x: torch.Tensor, *, key_mask: torch.Tensor | None = None, kv_cache: Any = None
    ) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]; key_mask [B, S] (True = real key)."""
        a = self.attn(self.ln_1(x), is_causal=True, key_mask=key_mask, kv_cache=kv_cache)
        x = x + self.resid_dropout(a)
        return x + self.mlp(self.ln_2(x))
