"""The composed attention core of DCMHA and Talking-Heads, over blocks of queries.

``DCMHA.attend`` calls :func:`composed_attention` with its own settings
(rank, residual, static matrices, block size, dropout); see
``multihead.modules.kinds.dcmha`` for the semantics. Nothing here reads a
module.

    for each block of <= chunk queries t0 .. t1 (and the keys they may see):
        L  = (q·scale) kᵀ  -> compose(slots 0, 1) -> + float mask -> masked softmax = P
        P' = compose(P; slots 2, 3) -> hidden keys 0 -> dropout -> P' v
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...functional import masked_softmax
from ...functional.nonfinite import split_nonfinite
from ...functional.request import make_request

__all__ = ["compose", "composed_attention"]


def compose(A: torch.Tensor, qw, kw, static, *, rank: int, residual: bool) -> torch.Tensor:
    """A [B, H, c, s] -> A'; qw [B, c, 2R+1, H], kw [B, s, 2R+1, H] or None."""
    R = rank
    out = A if residual else None
    terms = []
    if static is not None:
        terms.append(torch.einsum("bnts,nm->bmts", A, static))
    if qw is not None:
        gate = qw[:, :, 2 * R].transpose(1, 2).unsqueeze(-1) + kw[:, :, 2 * R].transpose(1, 2).unsqueeze(-2)
        terms.append(A * gate)  # (B, H, c, 1) + (B, H, 1, s): diag(qdd_t + kdd_s)
        h = torch.einsum("bnts,btin->bits", A, qw[:, :, :R])  # (B, R, c, s)
        terms.append(torch.einsum("bits,btim->bmts", h, qw[:, :, R : 2 * R]))
        h = torch.einsum("bnts,bsin->bits", A, kw[:, :, :R])
        terms.append(torch.einsum("bits,bsim->bmts", h, kw[:, :, R : 2 * R]))
    for t in terms:
        out = t if out is None else out + t
    return out


def composed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qw: torch.Tensor | None,
    kw: torch.Tensor | None,
    *,
    rank: int,
    residual: bool,
    pre_static: torch.Tensor | None,
    post_static: torch.Tensor | None,
    chunk: int,
    dropout_p: float = 0.0,
    training: bool = False,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    return_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The composed attention core over blocks of queries.

    Args:
        q: [B, H, T, D]; k: [B, H, S, D]; v: [B, H, S, Dv].
        qw: [B, T, 2, 2R+1, H] query-side and kw: [B, S, 2, 2R+1, H]
            key-side weights from ``DCMHA.dynamic_weights`` (None: static).
        rank: R, the rank of the dynamic projections.
        residual: add the identity to both compositions.
        pre_static, post_static: [H, H] static matrices of the compositions
            before and after the softmax (None: no static term).
        chunk: queries per block (>= 1); the result does not depend on it.
        dropout_p, training: dropout on P' (only when training).
        attn_mask: bool (True = may attend) or float (added after
            pre-Compose), (T, S) or 4-D broadcastable to (B, H, T, S).

    Returns:
        (out [B, H, T, Dv], weights P' [B, H, T, S] or None).
    """
    req = make_request(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, causal_alignment=causal_alignment,
        scale=None, dropout_p=dropout_p, training=training, return_weights=return_weights,
    )  # fmt: skip
    req, fixup = split_nonfinite(req)
    B, H, _, T, S, Dv = req.shape
    offset = 0 if causal_alignment == "top_left" else S - T
    causal = not req.causal_is_trivial
    opts = {"rank": rank, "residual": residual}
    outs, weights = [], []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s1 = min(S, max(0, t1 + offset)) if causal else S  # later keys are hidden from every row
        qc = req.q[:, :, t0:t1] * req.scale  # the query is scaled before the product
        L = qc @ req.k[:, :, :s1].transpose(-1, -2)  # (B, H, c, s1)
        qwc = None if qw is None else qw[:, t0:t1]
        kwc = None if kw is None else kw[:, :s1]
        L = compose(L, None if qwc is None else qwc[:, :, 0], None if kwc is None else kwc[:, :, 0], pre_static, **opts)
        if req.bias is not None:
            L = L + _rows(req.bias, T, t0, t1, s1)
        visible = None if req.allowed is None else _rows(req.allowed, T, t0, t1, s1)
        if causal:
            i = torch.arange(t0, t1, device=q.device)[:, None]  # (c, 1)
            j = torch.arange(s1, device=q.device)[None, :]  # (1, s1)
            rows = j <= i + offset
            visible = rows if visible is None else visible & rows
        P = masked_softmax(L, visible)  # (B, H, c, s1); rows seeing nothing are zeros
        P = compose(P, None if qwc is None else qwc[:, :, 1], None if kwc is None else kwc[:, :, 1], post_static, **opts)
        if visible is not None:
            P = P.masked_fill(~visible, 0.0)
        if req.return_weights:
            weights.append(F.pad(P, (0, S - s1)))
        if req.dropout_p > 0.0:
            P = F.dropout(P, p=req.dropout_p, training=True)
        outs.append(P @ req.v[:, :, :s1])  # (B, H, c, Dv)
    if T == 0:
        out = q.new_zeros(B, H, 0, Dv)
        w = q.new_zeros(B, H, 0, S) if req.return_weights else None
    else:
        out = torch.cat(outs, dim=2)
        w = torch.cat(weights, dim=2) if req.return_weights else None
    if fixup is not None:
        out, w = fixup(out, w)
    return out, w


def _rows(mask: torch.Tensor, T: int, t0: int, t1: int, s1: int) -> torch.Tensor:
    """Rows t0:t1 and keys :s1 of a mask broadcastable to (B, H, T, S)."""
    if mask.shape[-2] == T:
        mask = mask[..., t0:t1, :]
    return mask[..., :s1]
