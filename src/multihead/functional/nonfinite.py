"""Non-finite keys and values: hidden ones change nothing, visible ones show.

A NaN or inf in a key or value that a query may not see must not change
that query's output, but ``weights @ values`` computes 0 * NaN = NaN, and
fused kernels add -inf to NaN scores. A NaN that a query *may* see must stay
visible in that query's output, never silently zeroed (torch's CPU flash
kernel returns 0 for a query row holding NaN, so queries are covered too).

The rule, applied by replacing non-finite q/k/v entries with zeros for the
backend and patching the output afterwards:

* a query row that may see a key with a non-finite entry, or that has a
  non-finite entry itself and may see some key -> the whole row (output and
  weights) is NaN;
* a query row that may see a value with a non-finite entry -> that feature
  is NaN, or +inf/-inf when every such value there is +inf/-inf (IEEE sums
  of positive weights).

Two ways to the same numbers:

* eager: one reduction over q, k and v decides (a host sync); only when a
  non-finite number is present is the patch computed, so the common path
  pays one pass over the inputs. On a GPU this is also the faster policy:
  computing the patch every call cost 3x the synced forward on an H100
  (``benchmarks/cuda_syncs.py``, docs/benchmarks.md);
* inside ``torch.compile`` (``torch.compiler.is_compiling()``): no host
  sync and no data-dependent branch. The inputs are always sanitised and
  the patch masks always computed; with finite inputs the ``where`` keeps
  every entry and the masks are all False, so the result equals the eager
  one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from .request import AttentionRequest
from .weights import pick

__all__ = ["split_nonfinite"]

Fixup = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, "torch.Tensor | None"]]


def _all_finite(req: AttentionRequest) -> bool:
    """Whether q, k and v hold only finite numbers (eager only: syncs)."""
    acc = torch.float64 if req.k.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        total = req.q.sum(dtype=acc) + req.k.sum(dtype=acc) + req.v.sum(dtype=acc)
        if bool(torch.isfinite(total)):
            return True
        # The sum may overflow with finite entries; look element-wise.
        return all(bool(torch.isfinite(t).all()) for t in (req.q, req.k, req.v))


def _seen(
    flags: tuple[torch.Tensor, ...], req: AttentionRequest
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Which query rows may see a key whose row of a flag tensor is set.

    Args:
        flags: bool tensors [B, G, S, X_i], one row per key.

    Returns:
        (one hit per flag tensor, broadcastable to [B, G, R, T, X_i]: query
        (b, g*R + r, t) may see a key with flag x; sees_any broadcastable to
        [B, G, R, T, 1], or None when every query sees every key). R = H // G.

    Without a mask, with a per-key (padding) mask and with causality the
    hits are reductions over S (any, or the first flagged key against each
    query's last visible key) that inductor fuses without storing per-key
    flags; a mask that differs between query rows needs (mask @ flags).
    """
    B, H, G, T, S, _ = req.shape
    allowed = req.allowed
    if allowed is not None and (allowed.shape[1] != 1 or allowed.shape[2] != 1):
        return _seen_through_mask(flags, req)
    keep = None
    if allowed is not None:
        keep = allowed[:, :, 0, :, None]  # (B|1, 1, 1, S) -> (B|1, 1, S, 1): per key, shared by heads and rows
        flags = tuple(f & keep for f in flags)
    if req.causal_is_trivial:
        hits = tuple(f.any(dim=-2)[:, :, None, None, :] for f in flags)  # (B, G, X) -> (B, G, 1, 1, X)
        sees_any = None if keep is None else keep.any(dim=-2)[:, :, None, None]  # -> (B|1, 1, 1, 1, 1)
        return hits, sees_any
    # Causal: query t sees keys 0 .. min(t + offset, S - 1) (none when
    # t + offset < 0), so it sees a flag iff the first flagged key is at most that.
    offset = 0 if req.causal_alignment == "top_left" else S - T
    seen_to = (torch.arange(T, device=req.q.device) + offset).clamp(max=S - 1)[:, None]  # (T, 1)
    key = torch.arange(S, device=req.q.device)[:, None]  # (S, 1)

    def first(f: torch.Tensor) -> torch.Tensor:
        return torch.where(f, key, S).amin(dim=-2)  # (..., S, X) -> (..., X); S = none

    hits = tuple((first(f)[:, :, None, :] <= seen_to)[:, :, None] for f in flags)  # (B, G, 1, T, X)
    if keep is None:
        return hits, seen_to >= 0  # (T, 1)
    return hits, (first(keep)[:, :, None, :] <= seen_to)[:, :, None]  # (B|1, 1, 1, T, 1)


def _seen_through_mask(
    flags: tuple[torch.Tensor, ...], req: AttentionRequest
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``_seen`` for a mask that differs between heads or query rows."""
    B, H, G, T, S, _ = req.shape
    R = H // G
    visible = req.visible().expand(B, H, T, S)
    vis = visible.to(torch.float32).reshape(B, G, R * T, S)  # (B, H, T, S) -> (B, G, R*T, S)
    # Counts of visible flagged keys; sums of zeros and ones are > 0 iff one is set.
    sizes = [f.shape[-1] for f in flags]
    counts = vis @ torch.cat(flags, dim=-1).to(torch.float32)  # (B, G, R*T, sum X_i)
    hit = (counts > 0).view(B, G, R, T, sum(sizes))  # (B, G, R*T, X) -> (B, G, R, T, X)
    sees_any = visible.any(dim=-1, keepdim=True).view(B, G, R, T, 1)  # (B, H, T, 1) -> (B, G, R, T, 1)
    return tuple(hit.split(sizes, dim=-1)), sees_any


def _sanitise(req: AttentionRequest) -> tuple[AttentionRequest, Fixup]:
    """Finite q/k/v for the backend and the patch restoring non-finite effects."""
    B, H, G, T, S, Dv = req.shape
    R = H // G
    q_ok, k_ok, v_ok = torch.isfinite(req.q), torch.isfinite(req.k), torch.isfinite(req.v)
    safe = replace(
        req,
        q=torch.where(q_ok, req.q, torch.zeros((), dtype=req.q.dtype, device=req.q.device)),
        k=torch.where(k_ok, req.k, torch.zeros((), dtype=req.k.dtype, device=req.k.device)),
        v=torch.where(v_ok, req.v, torch.zeros((), dtype=req.v.dtype, device=req.v.device)),
    )
    with torch.no_grad():
        v_nan = torch.isnan(req.v)
        up = v_nan | torch.isposinf(req.v)  # a visible one makes the feature NaN or +inf
        down = v_nan | torch.isneginf(req.v)  # a visible one makes the feature NaN or -inf
        k_bad = (~k_ok).any(dim=-1, keepdim=True)  # (B, G, S, 1)
        (key_hit, up_hit, down_hit), sees_any = _seen((k_bad, up, down), req)
        q_bad = (~q_ok).any(dim=-1, keepdim=True).view(B, G, R, T, 1)  # (B, H, T, 1) -> (B, G, R, T, 1)
        row_nan = key_hit | (q_bad if sees_any is None else q_bad & sees_any)  # (B, G, R, T, 1)
        nan_hit = (up_hit & down_hit) | row_nan  # visible NaN, or both infinities, or a bad key/query
        pos_hit, neg_hit = up_hit & ~down_hit, down_hit & ~up_hit

    def fixup(out: torch.Tensor, weights: torch.Tensor | None):
        o = out.unflatten(1, (G, R))  # (B, H, T, Dv) -> (B, G, R, T, Dv)
        o = o.masked_fill(pos_hit, float("inf")).masked_fill(neg_hit, float("-inf"))
        out = o.masked_fill(nan_hit, float("nan")).flatten(1, 2)  # (B, G, R, T, Dv) -> (B, H, T, Dv)
        if weights is not None and req.weights_detached:  # a selection: [B, h, r, S]
            rows_nan = row_nan.expand(B, G, R, T, 1).flatten(1, 2)  # (B, G, R, T, 1) -> (B, H, T, 1)
            weights = weights.masked_fill(pick(rows_nan, req.weight_heads, req.weight_rows), float("nan"))
        elif weights is not None:
            w = weights.unflatten(1, (G, R))  # (B, H, T, S) -> (B, G, R, T, S)
            weights = w.masked_fill(row_nan, float("nan")).flatten(1, 2)  # -> (B, H, T, S)
        return out, weights

    return safe, fixup


def sync_free(req: AttentionRequest) -> bool:
    """Whether the patch is computed without looking at the data first (no host
    sync): inside ``torch.compile`` only (see the module docstring for why not on
    a GPU in eager mode)."""
    return torch.compiler.is_compiling()


def split_nonfinite(req: AttentionRequest) -> tuple[AttentionRequest, Fixup | None]:
    """Return a request with finite q/k/v and a function that restores
    the non-finite effects on the output.

    In eager mode the function is None when every entry is finite (the
    request is returned as it is); where ``sync_free`` it is always
    returned, and is the identity on finite inputs.
    """
    if req.k.numel() == 0 or req.q.numel() == 0:
        return req, None
    if not sync_free(req) and _all_finite(req):
        return req, None
    return _sanitise(req)
