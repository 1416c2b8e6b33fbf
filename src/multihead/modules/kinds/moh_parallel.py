"""The tensor-parallel cut of a Mixture-of-Head layer (``MoHAttention.tensor_parallel_part``).

One rank's part holds query heads lo..hi-1 (a contiguous block) with their
q/k/v rows of ``qkv_proj`` [(H + 2G)·D, C] and their columns of ``out_proj``
[C, H·D]; the router stays whole, and ``window`` = (lo, hi) tells the part
which gates are its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..head_selection import check_head_selection, head_rows

__all__ = ["moh_part"]


def moh_part(layer, heads: list[int]):
    """A copy of ``layer`` (an ``MoHAttention``) holding only query heads ``heads``; see its
    ``tensor_parallel_part``."""
    H, G, D = layer.shared_heads + layer.num_candidates, layer.num_kv_heads, layer.head_dim
    if layer.window != (0, H):
        raise ValueError(f"this MoH layer is already the part of heads {layer.window}; split the whole layer")
    keep_q, keep_kv = check_head_selection(heads, None, H, G)
    lo, hi = keep_q[0], keep_q[-1] + 1
    if keep_q != list(range(lo, hi)):
        raise ValueError(f"MoH splits into contiguous blocks of heads, got heads={keep_q}")
    if layer.router == "query_norm" and 0 < layer.routed_heads < layer.num_candidates:
        raise ValueError("the query_norm router ranks every head's query norm, which a part of the heads does "
                         "not hold: 'moh' with router='query_norm' cannot be split by heads")  # fmt: skip
    kept, layer.last_balance_loss = layer.last_balance_loss, None  # a graph's tensor: not copied
    try:
        new = copy.deepcopy(layer)
    finally:
        layer.last_balance_loss = kept
    new._attention_observers.clear()
    new._head_hooks.clear()
    device = layer.out_proj.weight.device
    q_rows, kv_rows = head_rows(keep_q, D, device), head_rows(keep_kv, D, device)
    rows = torch.cat([q_rows, H * D + kv_rows, (H + G) * D + kv_rows])  # qkv_proj rows: [q | k | v]
    new.qkv_proj = _linear_part(layer.qkv_proj, rows, None)
    new.out_proj = _linear_part(layer.out_proj, None, q_rows)
    new.num_heads, new.num_kv_heads = len(keep_q), len(keep_kv)
    new.window, new.aux_share = (lo, hi), len(keep_q) / H
    return new


def _linear_part(linear: nn.Linear, rows: torch.Tensor | None, columns: torch.Tensor | None) -> nn.Linear:
    """A Linear holding ``rows`` of ``linear``'s output (bias too) or ``columns`` of its input (bias whole)."""
    weight = linear.weight.detach()
    weight = weight[rows] if rows is not None else weight[:, columns]
    bias = None if linear.bias is None else linear.bias.detach()
    if bias is not None and rows is not None:
        bias = bias[rows]
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        new.weight.requires_grad_(linear.weight.requires_grad)
        if bias is not None:
            new.bias.copy_(bias)
            new.bias.requires_grad_(linear.bias.requires_grad)
    return new
