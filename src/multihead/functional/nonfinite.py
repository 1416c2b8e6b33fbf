"""Non-finite keys and values: hidden ones change nothing, visible ones show.

A NaN or inf in a key or value that a query may not see must not change
that query's output, but ``weights @ values`` computes 0 * NaN = NaN, and
fused kernels add -inf to NaN scores. A NaN that a query *may* see must stay
visible in that query's output, never silently zeroed (torch's CPU flash
kernel returns 0 for a query row holding NaN, so queries are covered too).

Inputs are checked with one reduction (a host sync); only when a non-finite
number is present are queries, keys and values replaced by zeros for the
backend and the output patched afterwards, so the common path pays one pass
over q, k and v:

* a query row that may see a key with a non-finite entry, or that has a
  non-finite entry itself and may see some key -> the whole row (output and
  weights) is NaN;
* a query row that may see a value with a non-finite entry -> that feature
  is NaN, or +inf/-inf when every such value there is +inf/-inf (IEEE sums
  of positive weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from .request import AttentionRequest

__all__ = ["split_nonfinite"]

Fixup = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, "torch.Tensor | None"]]


def _all_finite(req: AttentionRequest) -> bool:
    acc = torch.float64 if req.k.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        total = req.q.sum(dtype=acc) + req.k.sum(dtype=acc) + req.v.sum(dtype=acc)
        if bool(torch.isfinite(total)):
            return True
        # The sum may overflow with finite entries; look element-wise.
        return all(bool(torch.isfinite(t).all()) for t in (req.q, req.k, req.v))


def split_nonfinite(req: AttentionRequest) -> tuple[AttentionRequest, Fixup | None]:
    """Return a request with finite q/k/v and a function that restores
    the non-finite effects on the output (None when all entries are finite)."""
    if req.k.numel() == 0 or _all_finite(req):
        return req, None
    B, H, G, T, S, Dv = req.shape
    R = H // G
    q_ok, k_ok, v_ok = torch.isfinite(req.q), torch.isfinite(req.k), torch.isfinite(req.v)
    safe = replace(
        req,
        q=torch.where(q_ok, req.q, torch.zeros((), dtype=req.q.dtype)),
        k=torch.where(k_ok, req.k, torch.zeros((), dtype=req.k.dtype)),
        v=torch.where(v_ok, req.v, torch.zeros((), dtype=req.v.dtype)),
    )
    with torch.no_grad():
        visible = req.visible()
        if visible is None:
            vis = torch.ones(B, H, T, S, device=req.q.device)
        else:
            vis = visible.expand(B, H, T, S).float()
        vis = vis.reshape(B, G, R * T, S)  # (B, H, T, S) -> (B, G, R*T, S)

        def hits(flags: torch.Tensor) -> torch.Tensor:
            # (B, G, S, X) flags -> (B, H, T, X): does a visible key carry one?
            return (vis @ flags.float()).view(B, H, T, flags.shape[-1]) > 0

        key_hit = hits((~k_ok).any(dim=-1, keepdim=True))  # (B, H, T, 1)
        sees_any = vis.sum(dim=-1).view(B, H, T, 1) > 0  # (B, H, T, 1)
        key_hit = key_hit | ((~q_ok).any(dim=-1, keepdim=True) & sees_any)
        nan_hit = hits(torch.isnan(req.v))  # (B, H, T, Dv)
        pos_hit = hits(torch.isposinf(req.v))
        neg_hit = hits(torch.isneginf(req.v))

    def fixup(out: torch.Tensor, weights: torch.Tensor | None):
        out = out.masked_fill(pos_hit, float("inf")).masked_fill(neg_hit, float("-inf"))
        out = out.masked_fill(nan_hit | (pos_hit & neg_hit) | key_hit, float("nan"))
        if weights is not None:
            weights = weights.masked_fill(key_hit, float("nan"))
        return out, weights

    return safe, fixup
