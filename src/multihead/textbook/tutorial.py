"""The two multi-head forms of a common PyTorch tutorial, with its published bugs fixed.

Form 1 (``PerHeadMultiHeadAttention``) keeps one small ``AttentionHead`` module per head and
concatenates their outputs; form 2 (``SplitMultiHeadAttention``) projects once to d_model
and splits the result into heads. With the same weights both equal
``torch.nn.MultiheadAttention`` (no dropout).

Bugs in the published code, fixed here:

* ``torch.ModuleList`` does not exist (it is ``nn.ModuleList``).
* ``AttentionHead`` was declared ``(head_dim, embed_dim)`` but called as
  ``AttentionHead(embed_dim, head_dim)``, building ``nn.Linear(head_dim, embed_dim)``.
* Form 2 imported ``torch.nn.Functional`` (no such module; it is ``torch.nn.functional``)
  and used an undefined ``d_model`` in ``forward`` (it is ``self.d_model``).
* Form 2 applied ``torch.bmm`` (3-D only) to 4-D per-head tensors; ``matmul`` is used.
* Masked scores were filled with -inf, so a fully masked query row gave NaN outputs and
  NaN gradients; here masked positions are excluded with ``torch.where`` and a fully
  masked row outputs zeros with finite gradients.

Mask convention (both forms and ``scaled_dot_product``): True/1 = attend, False/0 = masked.
The mask must be bool or hold only 0 and 1; an additive float mask (0/-inf) is rejected
with ValueError, because reading it as keep/drop would invert it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import divisible, positive_int

__all__ = ["scaled_dot_product", "AttentionHead", "PerHeadMultiHeadAttention", "SplitMultiHeadAttention"]


def _as_keep_mask(mask: torch.Tensor) -> torch.Tensor:
    """Converts a bool or 0/1 mask to bool (True = keep); raises for anything else."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"mask must be bool or hold 0/1, got dtype {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        values = torch.unique(mask[bad])[:5].tolist()
        raise ValueError(
            f"mask must be bool or hold only 0 and 1 (1 = attend, 0 = masked), got values {values}; "
            "an additive mask (0 / -inf) is not accepted"
        )
    return mask != 0


def scaled_dot_product(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention for any number of leading dimensions.

    Published bugs fixed: ``torch.bmm`` rejected 4-D per-head tensors, and filling masked
    scores with -inf made fully masked rows NaN.

    Masked positions are excluded with ``torch.where``: their scores are replaced by the
    most negative finite value before the softmax and their probabilities set to exactly 0
    after it, so a query row with every key masked gives output 0 and finite gradients.

    Args:
        query: [..., Tq, d_k].
        key: [..., Tk, d_k].
        value: [..., Tk, d_v].
        mask: bool or 0/1 tensor broadcastable to [..., Tq, Tk]; True/1 = attend,
            False/0 = masked.

    Returns:
        Output [..., Tq, d_v].

    Raises:
        ValueError: if the mask holds values other than 0 and 1.
    """
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)  # [..., Tq, Tk]
    if mask is None:
        weights = torch.softmax(scores, dim=-1)  # [..., Tq, Tk]
    else:
        keep = _as_keep_mask(mask).to(scores.device)  # broadcastable to [..., Tq, Tk]
        lowest = torch.finfo(scores.dtype).min
        scores = torch.where(keep, scores, torch.full_like(scores, lowest))
        weights = torch.softmax(scores, dim=-1)  # [..., Tq, Tk]; uniform on fully masked rows
        weights = torch.where(keep, weights, torch.zeros_like(weights))  # masked -> exactly 0
    return torch.matmul(weights, value)  # [..., Tq, d_v]


def _check_tokens(name: str, t: object, width: int, width_name: str, rank: int | None = None) -> None:
    """Validates a token tensor [..., T, width] (exactly ``rank`` dims when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D [B, T, {width_name}], got shape {tuple(t.shape)}")
    if t.dim() < 2 or t.shape[-1] != width:
        raise ValueError(f"{name} must have shape [..., T, {width_name}={width}], got {tuple(t.shape)}")


class AttentionHead(nn.Module):
    """One attention head with its own query/key/value projections.

    Published bug fixed: the signature was declared ``(head_dim, embed_dim)`` while every
    caller passed ``(embed_dim, head_dim)``; here the signature is ``(embed_dim, head_dim)``.

    Layers ``q``, ``k``, ``v`` (created in that order) are ``nn.Linear(embed_dim, head_dim)``
    with bias.

    Args:
        embed_dim: input embedding size.
        head_dim: size of this head's queries, keys and values.
    """

    def __init__(self, embed_dim: int, head_dim: int):
        super().__init__()
        self.embed_dim = positive_int("embed_dim", embed_dim)
        self.head_dim = positive_int("head_dim", head_dim)
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Projects and attends.

        Args:
            query: [..., Tq, embed_dim].
            key: [..., Tk, embed_dim].
            value: [..., Tk, embed_dim].
            mask: bool or 0/1, broadcastable to [..., Tq, Tk]; True/1 = attend.

        Returns:
            Output [..., Tq, head_dim].
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            _check_tokens(name, t, self.embed_dim, "embed_dim")
        return scaled_dot_product(self.q(query), self.k(key), self.v(value), mask)


class PerHeadMultiHeadAttention(nn.Module):
    """Multi-head attention as a list of ``AttentionHead`` modules (the tutorial's form 1).

    Published bug fixed: it used ``torch.ModuleList`` (not a torch attribute; it is
    ``nn.ModuleList``) and swapped the ``AttentionHead`` arguments.

    ``self.heads`` holds ``num_heads`` AttentionHead(embed_dim, embed_dim // num_heads),
    head 0 created first; ``self.output`` = nn.Linear(embed_dim, embed_dim). Head j's
    ``q.weight`` equals rows j*head_dim ... (j+1)*head_dim - 1 of a fused query projection.

    Args:
        embed_dim: model width.
        num_heads: number of heads; must divide embed_dim.

    Raises:
        ValueError: if embed_dim % num_heads != 0 or a size is not positive.
    """

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.embed_dim = positive_int("embed_dim", embed_dim)
        self.num_heads = positive_int("num_heads", num_heads)
        divisible(embed_dim, num_heads, "embed_dim", "num_heads")
        self.head_dim = embed_dim // num_heads
        self.heads = nn.ModuleList([AttentionHead(embed_dim, self.head_dim) for _ in range(num_heads)])
        self.output = nn.Linear(embed_dim, embed_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs every head, concatenates, projects.

        Args:
            query: [B, Tq, embed_dim].
            key: [B, Tk, embed_dim].
            value: [B, Tk, embed_dim].
            mask: bool or 0/1, broadcastable to [B, Tq, Tk] (e.g. [B, 1, Tk] padding or
                [Tq, Tk] causal); True/1 = attend.

        Returns:
            Output [B, Tq, embed_dim].
        """
        if mask is not None:
            mask = _as_keep_mask(mask)  # validate and convert once, not once per head
        # num_heads x [B, Tq, head_dim] -> [B, Tq, embed_dim], head-major
        out = torch.cat([h(query, key, value, mask) for h in self.heads], dim=-1)
        return self.output(out)  # [B, Tq, embed_dim]


class SplitMultiHeadAttention(nn.Module):
    """Multi-head self-attention that projects once and splits into heads (form 2).

    Published bug fixed: ``forward`` used an undefined ``d_model`` (now ``self.d_model``),
    applied ``torch.bmm`` to 4-D tensors and imported the non-existent ``torch.nn.Functional``.

    Layers ``q_linear``, ``k_linear``, ``v_linear``, ``out_linear`` (created in that order)
    are ``nn.Linear(d_model, d_model)`` with bias.

    Args:
        d_model: model width.
        num_heads: number of heads; must divide d_model.

    Raises:
        ValueError: if d_model % num_heads != 0 or a size is not positive.
    """

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.num_heads = positive_int("num_heads", num_heads)
        divisible(d_model, num_heads, "d_model", "num_heads")
        self.dim_head = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.k_linear = nn.Linear(d_model, d_model)
        self.v_linear = nn.Linear(d_model, d_model)
        self.out_linear = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Multi-head self-attention.

        Args:
            x: tokens [B, T, d_model].
            mask: bool or 0/1; True/1 = attend. [T, T], [B, T, T] or [B, 1, T] (a head
                axis is inserted at dim 1), or 4-D [B, 1|H, T, T].

        Returns:
            Output [B, T, d_model].
        """
        _check_tokens("x", x, self.d_model, "d_model", rank=3)
        bs, seq_len, _ = x.shape
        # (B, T, d_model) -> (B, T, H, d_head)
        q = self.q_linear(x).view(bs, seq_len, self.num_heads, self.dim_head)
        k = self.k_linear(x).view(bs, seq_len, self.num_heads, self.dim_head)
        v = self.v_linear(x).view(bs, seq_len, self.num_heads, self.dim_head)
        # (B, T, H, d_head) -> (B, H, T, d_head)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if mask is not None:
            mask = _as_keep_mask(mask)
            if mask.dim() == 3:
                # (B, T|1, T) -> (B, 1, T|1, T): same mask for every head
                mask = mask.unsqueeze(1)
        output = scaled_dot_product(q, k, v, mask)  # [B, H, T, d_head]
        # (B, H, T, d_head) -> (B, T, H, d_head) -> (B, T, d_model)
        output = output.transpose(1, 2).contiguous().view(bs, seq_len, self.d_model)
        return self.out_linear(output)  # [B, T, d_model]
