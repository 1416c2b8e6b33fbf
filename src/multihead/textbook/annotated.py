"""Multi-head attention exactly as in the Annotated Transformer (harvardnlp, 2022 revision).

Reference: ``harvardnlp/annotated-transformer`` commit ``debc9fd7``, file
``the_annotated_transformer.py`` (``clones``, ``subsequent_mask``, ``attention``,
``MultiHeadedAttention``); semantics in ``docs/variants.md`` (row ``annotated_transformer``).

Kept from the official code, on purpose:

* ``self.linears`` holds four ``nn.Linear(d_model, d_model)`` made by deep-copying ONE
  layer (``clones``), so all four start identical and a seed reproduces the official
  parameters: one ``nn.Linear`` initialisation consumes the random stream, not four.
* Mask convention: 1/True = keep, 0/False = masked; the mask gets a head axis with
  ``mask.unsqueeze(1)``; masked scores are REPLACED by -1e9 (``masked_fill``), so a fully
  masked query row attends uniformly to all keys instead of giving NaN.
* ``self.attn`` stores the post-dropout probabilities of the last forward (with dropout's
  1/(1-p) rescaling in training mode), still attached to the autograd graph.

Deviations:

* The fill value is ``max(-1e9, torch.finfo(dtype).min)``: -1e9 overflows float16 (recent
  torch raises in ``masked_fill``); for float32/float64/bfloat16 it is -1e9 as official.
* User errors raise ValueError/TypeError naming the values instead of ``assert``.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .._checks import divisible, dropout_probability, positive_int

__all__ = ["MultiHeadedAttention", "subsequent_mask", "clones", "attention"]

#: The official replacement score for masked positions.
MASK_FILL = -1e9


def clones(module: nn.Module, N: int) -> nn.ModuleList:  # noqa: N803 (official name)
    """Produces ``N`` identical layers by deep-copying ``module`` (the official helper).

    Args:
        module: the layer to copy; it is not itself part of the result.
        N: number of copies.

    Returns:
        An ``nn.ModuleList`` of N independent deep copies with equal initial parameters.
    """
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def subsequent_mask(size: int) -> torch.Tensor:
    """Causal mask of the decoder.

    Args:
        size: sequence length.

    Returns:
        Bool tensor [1, size, size], True where key index <= query index (may attend).
    """
    size = positive_int("size", size)
    attn_shape = (1, size, size)
    future = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)  # [1, size, size]
    return future == 0


def _fill_value(dtype: torch.dtype) -> float:
    """-1e9, or the most negative finite value of ``dtype`` where -1e9 does not fit (float16)."""
    return max(MASK_FILL, torch.finfo(dtype).min)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention of the Annotated Transformer.

    Args:
        query: [..., Tq, d_k].
        key: [..., Tk, d_k].
        value: [..., Tk, d_v].
        mask: broadcastable to [..., Tq, Tk]; positions where ``mask == 0`` are replaced by
            -1e9 (the most negative finite value in float16).
        dropout: optional module applied to the probabilities.

    Returns:
        (output [..., Tq, d_v], probabilities [..., Tq, Tk] after dropout).
    """
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(mask == 0, _fill_value(scores.dtype))
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn  # [..., Tq, d_v], [..., Tq, Tk]


class MultiHeadedAttention(nn.Module):
    """Multi-head attention of the Annotated Transformer.

    Parameters: ``linears.0`` query, ``linears.1`` key, ``linears.2`` value, ``linears.3``
    output projection, each ``nn.Linear(d_model, d_model)`` with bias and identical at
    initialisation (deep copies of one layer). Head j uses projection rows
    j*d_k ... (j+1)*d_k - 1; the output projection reads heads concatenated head-major.

    Attributes:
        d_k: per-head size, d_model // h.
        h: number of heads.
        linears: the four projections.
        attn: post-dropout attention probabilities [B, h, Tq, Tk] of the last forward, or
            None before the first call.
        dropout: dropout on the probabilities (active in training mode only).

    Args:
        h: number of heads; must divide d_model.
        d_model: model width.
        dropout: dropout probability on the attention probabilities.

    Raises:
        ValueError: if d_model % h != 0 or a size is not positive.
    """

    def __init__(self, h: int, d_model: int, dropout: float = 0.1):
        super().__init__()
        h = positive_int("h", h)
        d_model = positive_int("d_model", d_model)
        dropout = dropout_probability(dropout)
        divisible(d_model, h, "d_model", "h")
        # We assume d_v always equals d_k
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn: torch.Tensor | None = None
        self.dropout = nn.Dropout(p=dropout)

    @property
    def d_model(self) -> int:
        """Model width h * d_k."""
        return self.h * self.d_k

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Multi-head attention; sets ``self.attn``.

        Args:
            query: [B, Tq, d_model].
            key: [B, Tk, d_model].
            value: [B, Tk, d_model].
            mask: 1/True = keep, 0/False = masked; [B, 1, Tk] (padding), [B, Tq, Tk] or
                [1, Tq, Tk] (e.g. ``subsequent_mask``); a head axis is inserted at dim 1.

        Returns:
            Output [B, Tq, d_model].
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must have shape [B, T, d_model={self.d_model}], got {tuple(t.shape)}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key and value must share [B, Tk], got key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if mask is not None:
            # Same mask applied to all h heads: [B, Tq|1, Tk] -> [B, 1, Tq|1, Tk]
            mask = mask.unsqueeze(1)
        nbatches = query.size(0)

        # 1) Do all the linear projections in batch from d_model => h x d_k
        # (B, T, d_model) -> (B, T, h, d_k) -> (B, h, T, d_k)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]

        # 2) Apply attention on all the projected vectors in batch.
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)  # [B, h, Tq, d_k]

        # 3) "Concat" using a view and apply a final linear.
        # (B, h, Tq, d_k) -> (B, Tq, h, d_k) -> (B, Tq, h * d_k)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)  # [B, Tq, d_model]
