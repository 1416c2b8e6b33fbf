"""The router of a Mixture-of-Head layer (``MoHAttention.route``) and its load-balance loss.

Shapes: x [B, T, C] query tokens, q [B, H, T, D] their projected queries;
gates [B, T, H], chosen and p [B, T, E] (E = H - shared heads).
"""

from __future__ import annotations

import torch

__all__ = ["route", "balance_loss"]


def route(layer, x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``layer.route(x, q)`` for an ``MoHAttention`` ``layer``: (gates, chosen or None, p or None)."""
    hs, hr, E = layer.shared_heads, layer.routed_heads, layer.num_candidates
    B, T, _ = x.shape
    if layer.router == "query_norm":
        gates = x.new_ones(B, T, hs + E)
        if hr == 0 or hr == E:
            return gates, None, None
        norms = q[:, hs:].detach().norm(dim=-1).transpose(1, 2)  # (B, E, T) -> (B, T, E)
        chosen = torch.zeros_like(norms, dtype=torch.bool).scatter(-1, norms.topk(hr, dim=-1).indices, True)
        gates = torch.cat([gates[..., :hs], chosen.to(gates.dtype)], dim=-1)
        return gates, chosen, None
    # the router's linears in one matmul: logits of [routed_gate | mix_gate | shared_gate], those that exist
    gate_layers = [m for m in (layer.routed_gate, layer.mix_gate, layer.shared_gate) if m is not None]
    logits = {}
    if gate_layers:
        fused = torch.nn.functional.linear(x, torch.cat([m.weight for m in gate_layers]))  # (B, T, R)
        logits = dict(zip(gate_layers, fused.split([m.out_features for m in gate_layers], dim=-1)))
    if hs > 1:
        g_s = hs * torch.softmax(logits[layer.shared_gate], dim=-1)  # (B, T, hs)
    else:
        g_s = x.new_ones(B, T, hs)
    if hr == 0:
        return g_s, None, None
    p = torch.softmax(logits[layer.routed_gate], dim=-1)  # (B, T, E)
    top_p, top_i = p.topk(hr, dim=-1)
    chosen = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top_i, True)
    denom = top_p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).eps)
    g_r = hr * torch.where(chosen, p, 0.0) / denom
    if hs:
        w = 2 * torch.softmax(logits[layer.mix_gate], dim=-1)  # (B, T, 2)
        gates = torch.cat([w[..., :1] * g_s, w[..., 1:] * g_r], dim=-1)
    else:
        gates = g_r
    return gates, (None if hr == E else chosen), p


def balance_loss(p: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """l_aux = E · sum_e mean(p[..., e]) · mean(chosen[..., e]); p, chosen [B, T, E]."""
    E = p.shape[-1]
    me = p.reshape(-1, E).mean(0)
    ce = chosen.reshape(-1, E).to(p.dtype).mean(0)
    return E * (me * ce).sum()
