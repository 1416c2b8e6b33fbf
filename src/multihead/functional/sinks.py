"""Learned attention sinks (gpt-oss) on the fused kernel.

A sink is one logit s_h per query head: an extra column of every row's
softmax that mixes no value, dropped after the softmax::

    p_j = exp(x_j) / (exp(s_h) + Σ_j' exp(x_j'))     x = q kᵀ · scale + bias, visible keys
    out = Σ_j p_j v_j                                 rows of p sum to 1 - p_sink < 1

A row that may see no key puts all its probability on the sink: weights 0,
output 0 (a layer's output is then its ``out_proj`` bias alone).

The ``math`` path adds the column explicitly (``softmax.sink_softmax``). The
``sdpa`` path keeps the fused kernel: with its output o = softmax(x) v and its
log-sum-exp lse = log Σ_j exp(x_j) (``lse_backend.fused_out_lse``)::

    out = o · exp(lse - logaddexp(lse, s_h))          (= o · sigmoid(lse - s_h))

and exact weights are the rebuilt softmax times the same factor.

Backward (``_SinkAttention``, a custom autograd Function): the gradient of
``out`` reaches q, k, v and the sink logits through lse as well as through o,
which the kernel's own backward does not give. The backward therefore runs
the same attention once more with autograd, the sink written as one more key
(``augmented_attention``): q gets one more channel holding s_h, the keys a
zero channel, and an extra key (0, ..., 0, 1/scale) with a zero value, so its
score is s_h for every query of head h and it is visible to every row. This
is torch's fused ``scaled_dot_product_attention`` with a float mask of
[B|1, H|1, T, S + 1] (memory of the mask, not of the weights per batch and
head). ``torch.autograd.gradcheck`` checks it against finite differences of
the forward in float64 (tests/functional/test_sinks.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from .lse_backend import fused_out_lse, lse_weights
from .math_backend import math_attention
from .request import AttentionRequest
from .weights import pick

__all__ = ["sink_attention", "augmented_attention", "sink_factor"]

_HALF = (torch.float16, torch.bfloat16)


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """exp(lse - logaddexp(lse, s_h)) [B, H, T, 1] in lse's dtype: the share of each row
    that the keys keep (lse [B, H, T], sinks [H])."""
    s = sinks.detach().to(lse.dtype)[None, :, None]  # (H,) -> (1, H, 1)
    return torch.exp(lse - torch.logaddexp(lse, s)).unsqueeze(-1)


class _SinkAttention(torch.autograd.Function):
    """out [B, H, T, Dv] of attention with sinks from the fused kernel, and lse [B, H, T]
    (no gradient); backward through ``augmented_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, req: AttentionRequest):
        out, lse = fused_out_lse(req)
        keep = sink_factor(lse, sinks)  # (B, H, T, 1)
        ctx.req = req
        ctx.save_for_backward(q, k, v, sinks)
        ctx.mark_non_differentiable(lse)
        return (out.to(keep.dtype) * keep).to(out.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs)]
            out = augmented_attention(ctx.req, *leaves)
            wanted = [t for t, n in zip(leaves, needs) if n]
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (*(next(grads) if n else None for n in needs), None)


def augmented_attention(req: AttentionRequest, q, k, v, sinks) -> torch.Tensor:
    """Attention with sinks as torch's fused kernel over one more key (the module docstring).

    Args:
        req: the call (its mask, causality, scale); q, k, v, sinks: its tensors
            (the autograd leaves of the backward).

    Returns:
        out [B, H, T, Dv] in q's dtype, differentiable in q, k, v and sinks.
    """
    if req.scale == 0.0:  # the sink key cannot carry s_h / scale: the explicit path
        plain = replace(req, q=q, k=k, v=v, sinks=sinks, return_weights=False, weight_heads=None, weight_rows=None)
        return math_attention(plain)[0]
    B, H, G, T, S, Dv = req.shape
    D = q.shape[-1]
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    dev = q.device
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    s = sinks.to(compute)[None, :, None, None].expand(B, H, T, 1)  # (H,) -> (B, H, T, 1)
    qx = torch.cat([qc, s], dim=-1)  # (B, H, T, D + 1): the last channel holds s_h
    sink_key = torch.zeros(B, G, 1, D + 1, dtype=compute, device=dev)
    sink_key[..., D] = 1.0 / req.scale  # its score: scale · s_h / scale = s_h
    kx = torch.cat([F.pad(kc, (0, 1)), sink_key], dim=2)  # (B, G, S + 1, D + 1)
    vx = torch.cat([vc, torch.zeros(B, G, 1, Dv, dtype=compute, device=dev)], dim=2)  # (B, G, S + 1, Dv)
    allowed, bias = req.visible(), req.bias
    parts = [t for t in (allowed, bias) if t is not None]
    Bm, Hm = (max([1, *(t.shape[i] for t in parts)]) for i in (0, 1))
    mask = torch.zeros(Bm, Hm, T, S + 1, dtype=compute, device=dev)  # the sink column stays 0: always visible
    if bias is not None:
        mask[..., :S] += bias.to(compute)
    if allowed is not None:
        mask[..., :S].masked_fill_(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=req.scale, enable_gqa=G != H)
    return out.to(q.dtype)


def sink_attention(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``sdpa`` backend's call with ``req.sinks``.

    Returns:
        (out [B, H, T, Dv] with gradients in q, k, v and the sinks, weights
        [B, h, r, S] detached (rows sum to 1 - p_sink) or None).
    """
    out, lse = _SinkAttention.apply(req.q, req.k, req.v, req.sinks, req)
    if not req.return_weights:
        return out, None
    keep = pick(sink_factor(lse, req.sinks), req.weight_heads, req.weight_rows)  # (B, h, r, 1)
    weights = lse_weights(req, lse)
    return out, (weights.to(keep.dtype) * keep).to(weights.dtype)
