"""Parity of multihead, torch.nn.MultiheadAttention and F.scaled_dot_product_attention.

All three run with the same weights on the same input; each is compared
with the NumPy float64 reference (``multihead.reference.attention``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..functional import causal_mask
from ..modules.compat import TorchMultiheadAttention

__all__ = ["parity_errors", "parity_table"]


def _numpy_reference(x: torch.Tensor, mha: nn.MultiheadAttention, causal: bool) -> np.ndarray:
    """Float64 NumPy computation of ``mha`` on ``x`` [B, T, C]."""
    B, T, C = x.shape
    H = mha.num_heads
    D = C // H
    xs = x.double().numpy()
    W = mha.in_proj_weight.detach().double().numpy()  # (3C, C)
    b = mha.in_proj_bias.detach().double().numpy()  # (3C,)
    q, k, v = np.split(xs @ W.T + b, 3, axis=-1)  # (B, T, C) each

    def heads(t: np.ndarray) -> np.ndarray:
        return t.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, T, C) -> (B, H, T, D)

    out = reference.attention(heads(q), heads(k), heads(v), is_causal=causal)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, H, T, D) -> (B, T, C)
    Wo = mha.out_proj.weight.detach().double().numpy()
    bo = mha.out_proj.bias.detach().double().numpy()
    return out @ Wo.T + bo


def _sdpa(x: torch.Tensor, mha: nn.MultiheadAttention, causal: bool) -> torch.Tensor:
    B, T, C = x.shape
    H = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, T, C) -> (B, H, T, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return mha.out_proj(out.transpose(1, 2).reshape(B, T, C))  # (B, H, T, D) -> (B, T, C)


def parity_errors(
    dtype: torch.dtype, causal: bool, *, B: int = 2, T: int = 16, C: int = 64, H: int = 8, seed: int = 0
) -> dict[str, float]:
    """Max |error| of each implementation against the float64 reference."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(C, H, batch_first=True, dtype=dtype).eval()
    nn.init.normal_(mha.in_proj_bias, std=0.1)
    ours = TorchMultiheadAttention.from_torch(mha).attention.eval()
    x = torch.randn(B, T, C, dtype=dtype)
    want = _numpy_reference(x, mha, causal)
    with torch.no_grad():
        hidden = None if not causal else ~causal_mask(T)  # torch polarity: True = hidden
        got = {
            "multihead": ours(x, is_causal=causal),
            "nn.MultiheadAttention": mha(x, x, x, attn_mask=hidden, is_causal=causal, need_weights=False)[0],
            "F.scaled_dot_product_attention": _sdpa(x, mha, causal),
        }
    return {name: float(np.abs(out.double().numpy() - want).max()) for name, out in got.items()}


def parity_table() -> list[str]:
    """Lines of a plain-text table: dtype x mask rows, one column per implementation."""
    names = ["multihead", "nn.MultiheadAttention", "F.scaled_dot_product_attention"]
    lines = [
        "Parity, same weights (B=2, T=16, embed 64, 8 heads):",
        "max |error| against the NumPy float64 reference",
        f"{'dtype':<9}{'mask':<8}" + "".join(f"{n:>32}" for n in names),
    ]
    for dtype in (torch.float32, torch.float64):
        for causal in (False, True):
            errs = parity_errors(dtype, causal)
            row = f"{str(dtype).replace('torch.', ''):<9}{'causal' if causal else 'none':<8}"
            lines.append(row + "".join(f"{errs[n]:>32.2e}" for n in names))
    return lines
