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

Two ways to the same numbers (``host_sync``):

* eager: one sum over q, k and v decides (a host read; one sum of their
  buffer when they are views of a fused projection's output); only when a
  non-finite number is present is the patch computed, so the common path
  pays one pass over the inputs and two operations;
* inside ``torch.compile``: no host read and no data-dependent branch. The
  inputs are always sanitised and the patch always added; it is built from
  terms that are 0 for finite entries (a row's max and min times 0; the
  sums of the non-finite values a query sees), so with finite inputs it
  adds zeros and the result equals the eager one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from . import host_sync
from .request import AttentionRequest
from .weights import pick

__all__ = ["split_nonfinite"]

Fixup = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, "torch.Tensor | None"]]


def _inputs(req: AttentionRequest) -> tuple[torch.Tensor, ...]:
    """The tensors whose entries are q, k and v: their one base tensor when all
    three are views of it and it holds nothing else (a fused projection's
    output, [B, T, 3C], seen as three [B, H, T, D]), else q, k and v."""
    q, k, v = req.q, req.k, req.v
    base = q._base
    if base is not None and k._base is base and v._base is base and base.numel() == q.numel() + k.numel() + v.numel():
        return (base,)
    return q, k, v


def _all_finite(req: AttentionRequest) -> bool:
    """Whether q, k and v hold only finite numbers (eager only: syncs)."""
    acc = torch.float64 if req.k.dtype == torch.float64 else torch.float32
    tensors = _inputs(req)
    with torch.no_grad():
        total = tensors[0].sum(dtype=acc)
        for t in tensors[1:]:
            total = total + t.sum(dtype=acc)
        if math.isfinite(total.item()):  # the one read, and no kernel for the test
            return True
        # The sum may overflow with finite entries; look element-wise.
        return all(bool(torch.isfinite(t).all()) for t in tensors)


def _seen(
    terms: tuple[torch.Tensor, ...], req: AttentionRequest
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Sum each per-key term over the keys each query may see.

    Args:
        terms: [B, G, S, X_i], one row per key, each entry 0, +inf, -inf or
            NaN. Sums of such numbers are exact: 0 when every seen entry is
            0, NaN when one is NaN or both infinities meet, else the infinity.

    Returns:
        (one sum per term, broadcastable to [B, G, R, T, X_i]: what query
        (b, g*R + r, t) sees; sees_any, bool broadcastable to
        [B, G, R, T, 1], or None when every query sees some key). R = H // G.

    Without a mask, with a per-key (padding) mask and with causality these
    are sums or prefix sums over S, read at each query's last visible key;
    a mask that differs between query rows needs (mask @ flags).
    """
    B, H, G, T, S, _ = req.shape
    allowed = req.allowed
    if allowed is not None and (allowed.shape[1] != 1 or allowed.shape[2] != 1):
        return _seen_through_mask(terms, req)
    keep = None
    if allowed is not None:
        keep = allowed[:, :, 0, :, None]  # (B|1, 1, 1, S|1) -> (B|1, 1, S|1, 1): per key, shared by heads and rows
        keep = keep.expand(*keep.shape[:2], S, 1)  # a mask broadcast over the keys: prefix sums need all S
        terms = tuple(t.masked_fill(~keep, 0) for t in terms)
    if req.causal_is_trivial:
        sums = tuple(t.sum(dim=-2)[:, :, None, None, :] for t in terms)  # (B, G, X) -> (B, G, 1, 1, X)
        sees_any = None if keep is None else keep.any(dim=-2)[:, :, None, None]  # -> (B|1, 1, 1, 1, 1)
        return sums, sees_any
    # Causal: query t sees keys 0 .. min(t + offset, S - 1), none when t + offset < 0.
    offset = 0 if req.causal_alignment == "top_left" else S - T
    if offset >= 0 and offset + T <= S:  # a slice of the prefix sums: no index to build
        seen_some = None

        def prefix(t: torch.Tensor) -> torch.Tensor:  # (..., S, X) -> (..., T, X)
            if T == 1:  # one query (a decode step): one sum, no prefix sums
                return t[:, :, : offset + 1].sum(dim=-2, keepdim=True)
            return t.cumsum(dim=-2)[:, :, offset : offset + T]
    else:
        seen_to = torch.arange(offset, offset + T, device=req.q.device)  # (T,)
        index = seen_to.clamp(0, S - 1)
        seen_some = (seen_to >= 0)[:, None]  # (T, 1)

        def prefix(t: torch.Tensor) -> torch.Tensor:  # (..., S, X) -> (..., T, X)
            return t.cumsum(dim=-2).index_select(-2, index).masked_fill(~seen_some, 0)
    sums = tuple(prefix(t)[:, :, None] for t in terms)  # (B, G, 1, T, X)
    if keep is None:
        return sums, seen_some
    kept = prefix(keep.to(torch.int32)) > 0  # (B|1, 1, T, 1): some allowed key seen
    return sums, kept[:, :, None]  # (B|1, 1, 1, T, 1)


def _seen_through_mask(
    terms: tuple[torch.Tensor, ...], req: AttentionRequest
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``_seen`` for a mask that differs between heads or query rows: counts
    of the NaN, +inf and -inf entries each query sees (a product with 0/1
    visibility; 0 * inf would be NaN), turned back into sums."""
    B, H, G, T, S, _ = req.shape
    R = H // G
    visible = req.visible().expand(B, H, T, S)
    vis = visible.to(torch.float32).reshape(B, G, R * T, S)  # (B, H, T, S) -> (B, G, R*T, S)
    kinds = [(torch.isnan, float("nan")), (torch.isposinf, float("inf")), (torch.isneginf, float("-inf"))]
    sizes = [t.shape[-1] for t in terms]
    flags = torch.cat([is_kind(t) for t in terms for is_kind, _ in kinds], dim=-1)  # (B, G, S, 3 * sum X_i)
    counts = (vis @ flags.to(torch.float32)).view(B, G, R, T, -1)  # (B, G, R*T, 3X) -> (B, G, R, T, 3X)
    parts = iter(counts.split([x for x in sizes for _ in kinds], dim=-1))
    sums = []
    for t in terms:
        total = torch.zeros((), dtype=t.dtype, device=t.device)
        for _, value in kinds:
            total = total + torch.where(next(parts) > 0, value, 0.0).to(t.dtype)
        sums.append(total)
    sees_any = visible.any(dim=-1, keepdim=True).view(B, G, R, T, 1)  # (B, H, T, 1) -> (B, G, R, T, 1)
    return tuple(sums), sees_any


def _row_term(t: torch.Tensor) -> torch.Tensor:
    """[..., X] -> [..., 1]: NaN where the row holds a non-finite entry,
    else 0. Two read-only reductions: the row's max and min, each times 0
    (a NaN, +inf or -inf entry makes one of them non-finite; a sum could
    overflow on finite entries)."""
    return t.amax(dim=-1, keepdim=True) * 0 + t.amin(dim=-1, keepdim=True) * 0


def _sanitise(req: AttentionRequest) -> tuple[AttentionRequest, Fixup]:
    """Finite q/k/v for the backend and the patch restoring non-finite effects.

    The patch is arithmetic on terms that are 0 where an entry is finite and
    NaN (or the entry's infinity) where it is not, so that with finite
    inputs it adds zeros, and it is a fixed sequence of kernels whatever the
    data: a few reductions over q, k and v, and prefix sums over the keys.
    """
    B, H, G, T, S, Dv = req.shape
    R = H // G

    def finite(t: torch.Tensor) -> torch.Tensor:  # any finite stand-in works: the patch overrides what it changes
        return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)

    safe = replace(req, q=finite(req.q), k=finite(req.k), v=finite(req.v))
    with torch.no_grad():
        k_term = _row_term(req.k)  # (B, G, S, 1): NaN for a key with a non-finite entry, else 0
        v_term = req.v - safe.v  # (B, G, S, Dv): the non-finite entries, 0 elsewhere
        q_term = _row_term(req.q).view(B, G, R, T, 1)  # (B, H, T, 1) -> (B, G, R, T, 1)
        (key_sum, value_sum), sees_any = _seen((k_term, v_term), req)
        if sees_any is not None:  # a query that sees nothing keeps its 0 row
            q_term = q_term.masked_fill(~sees_any, 0)
        row_term = key_sum + q_term  # (B, G, R, T, 1): NaN for a row that sees a bad key or has a bad query
        out_term = row_term + value_sum  # (B, G, R, T, Dv)

    def fixup(out: torch.Tensor, weights: torch.Tensor | None):
        out = (out.unflatten(1, (G, R)) + out_term).flatten(1, 2)  # (B, G, R, T, Dv) -> (B, H, T, Dv)
        if weights is not None:
            rows = row_term.expand(B, G, R, T, 1).flatten(1, 2)  # (B, G, R, T, 1) -> (B, H, T, 1)
            if req.weights_detached:  # a selection: [B, h, r, S]
                rows = pick(rows, req.weight_heads, req.weight_rows)
            weights = weights + rows
        return out, weights

    return safe, fixup


def split_nonfinite(req: AttentionRequest) -> tuple[AttentionRequest, Fixup | None]:
    """Return a request with finite q/k/v and a function that restores
    the non-finite effects on the output.

    In eager mode the function is None when every entry is finite (the
    request is returned as it is); inside ``torch.compile``
    (``host_sync.sync_free``) it is always returned, and adds zeros on finite inputs.
    """
    if req.k.numel() == 0 or req.q.numel() == 0:
        return req, None
    if not host_sync.sync_free() and _all_finite(req):
        return req, None
    return _sanitise(req)
