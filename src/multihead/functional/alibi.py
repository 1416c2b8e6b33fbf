"""ALiBi: attention with linear biases (Press et al., arXiv 2108.12409), slopes as BLOOM builds them.

Head h (0-based) of H gets slope m_h; the score of query i and key j gets
-m_h·|i - j| added before the softmax. Under a causal mask this equals
BLOOM's +m_h·j up to a constant per row, which the softmax removes.

Slopes: with H a power of two, m_h = r^(h+1) where r = 2^(-8/H). Otherwise,
with P the largest power of two below H, the first P heads take the slopes of
P heads and the other H - P heads take the odd powers r'^1, r'^3, ... of the
2P-head ratio r' = 2^(-8/(2P)).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .._checks import positive_int
from .masks import check_alignment

__all__ = ["alibi_slopes", "alibi_bias", "request_alibi", "alibi_as_bias"]


def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The (num_heads,) ALiBi slopes, as BLOOM builds them for any head count."""
    num_heads = positive_int("num_heads", num_heads)
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 / power * h) for h in range(1, power + 1)]
    slopes += [2.0 ** (-8.0 / (2 * power) * h) for h in range(1, 2 * (num_heads - power), 2)]
    return torch.tensor(slopes, dtype=torch.float64).to(dtype=dtype, device=device)


def alibi_bias(slopes: torch.Tensor, T: int, S: int | None = None, *, alignment: str = "top_left") -> torch.Tensor:
    """The (H, T, S) float bias -slope·|i - j| for T queries over S keys.

    Args:
        slopes: (H,) from ``alibi_slopes``.
        alignment: where the queries sit among the keys, as ``causal_mask``
            places them: "top_left" (query i is key i) or "bottom_right" (the
            last query is the last key: decoding with a cache).
    """
    S = T if S is None else S
    offset = S - T if check_alignment(alignment) == "bottom_right" else 0
    i = torch.arange(T, device=slopes.device, dtype=slopes.dtype)[:, None] + offset  # (T, 1)
    j = torch.arange(S, device=slopes.device, dtype=slopes.dtype)[None, :]  # (1, S)
    return -slopes[:, None, None] * (i - j).abs()  # (H, 1, 1) * (T, S) -> (H, T, S)


def request_alibi(req) -> torch.Tensor:
    """The (1, H, T, S) ALiBi bias of an ``AttentionRequest`` in its slopes' dtype,
    queries placed by its causal alignment (``AttentionRequest.alibi_offset``)."""
    _, _, _, T, S, _ = req.shape
    return alibi_bias(req.alibi_slopes, T, S, alignment=req.causal_alignment)[None]  # (H, T, S) -> (1, H, T, S)


def alibi_as_bias(req):
    """The request with its ALiBi slopes folded into its float bias (for kernels
    that take an added mask); the request itself when it has no slopes."""
    if req.alibi_slopes is None:
        return req
    alibi = request_alibi(req)
    bias = alibi if req.bias is None else req.bias + alibi.to(req.bias.dtype)
    return replace(req, bias=bias, alibi_slopes=None)
