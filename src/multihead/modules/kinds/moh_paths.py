"""The two paths of Mixture-of-Head attention: dense (every head, then gated)
and sparse (only chosen (token, head) pairs); ``MoHAttention.mix_heads``
chooses one.

Sparse path (default): keys and values are projected for every token and
head (a key may be read by any query), but the attention core of the routed
heads runs only over the (b, t) query rows that chose them::

    routed head e:  rows of the tokens that chose e, in token order
                    (B, E, M, D)  <- gather q[:, hs + e, t]; M = most rows any
                                     (batch row, head) got; shorter lists are
                                     padded with tokens that did not choose e
    attention(rows, k, v) in ONE call over all routed heads; causal, padding
    and user masks rebuilt per gathered row from its original position t
    (row at t sees keys j <= t + offset)
    scatter gate · out back to (B, E, T, D); unchosen pairs and padding stay 0

so the attention-core FLOPs and time scale with (hs + hr) / H (plus the
padding to M). The shared heads run as one ordinary call. Causal rows
longer than one block (``moh_causal.BLOCK`` positions) are gathered block by
block and run as a maskless prefix (every key before the block) plus the
diagonal block, merged by log-sum-exp (``moh_causal``): the hidden upper
triangle is never computed and no (rows, S) mask is built. Rows with an
attention mask, dropout in training, non-finite q/k/v, ``backend="math"``,
a device without a kernel that returns the log-sum-exp, or inside
``torch.compile`` take the explicit per-row mask above instead. The heads
are written into one (B, T, H, Dv) buffer that ``merge_heads`` reshapes
without a copy. The dense path (``path="dense"``: every head computed, then
multiplied by its gate, as the official code does) is kept for equality
tests; both agree to 1e-10 in float64.
"""

from __future__ import annotations

import torch

from ...functional import attention, merge_masks
from .moh_causal import BLOCK, block_causal_rows, block_plan, kernels_for

__all__ = ["dense_heads", "sparse_heads", "check_mask", "head_slice", "kv_for", "row_mask"]


def dense_heads(q, k, v, gates, mask, core, want_weights):
    """Every head on every token, then gated: (B, T, H, D) and gated weights [B, H, T, S] or None."""
    res = attention(q, k, v, attn_mask=mask, return_weights=want_weights, **core)
    out, weights = res if want_weights else (res, None)
    g = gates.transpose(1, 2).unsqueeze(-1)  # (B, T, H) -> (B, H, T, 1)
    if weights is not None:
        weights = weights * g
    return (out * g).transpose(1, 2), weights  # (B, H, T, D) -> (B, T, H, D)


def sparse_heads(q, k, v, gates, chosen, mask, core, *, shared_heads: int):
    """Shared heads in one call; the routed heads over only the rows that chose them.

    Returns (B, T, H, Dv), contiguous: the heads are written in place into
    one buffer, so ``merge_heads`` reshapes it without a copy.
    """
    B, H, T, D = q.shape
    S, G, hs, Dv = k.shape[2], k.shape[1], shared_heads, v.shape[-1]
    E = H - hs
    r = H // G  # query heads per key/value head
    out = q.new_zeros(B, T, H, Dv)
    if hs:
        ks, vs = kv_for(k, v, 0, hs, r)
        o = attention(q[:, :hs], ks, vs, attn_mask=head_slice(mask, 0, hs), **core)  # (B, hs, T, Dv)
        out[:, :, :hs] = (o * gates[..., :hs].transpose(1, 2).unsqueeze(-1)).transpose(1, 2)  # (B, T, hs, Dv)
    ks, vs = kv_for(k, v, hs, H, r)
    qr = q[:, hs:]  # (B, E, T, D)
    offset = 0 if core["causal_alignment"] == "top_left" else S - T
    blocked = core["is_causal"] and _use_blocks(qr, ks, vs, mask, core, offset)
    # rows per routed head (block by block when blocked), padded to the most any (batch row, head) got
    tok, valid, sizes = block_plan(chosen, BLOCK if blocked else T)
    b, e = torch.arange(B, device=q.device).view(B, 1, 1), torch.arange(E, device=q.device).view(1, E, 1)
    rows = qr[b, e, tok]  # (B, E, T, D) -> (B, E, N, D): rows[b, e, n] = qr[b, e, tok[b, e, n]]
    if blocked:
        if ks.shape[1] != E:  # grouped keys: one key/value head per routed query head
            ks, vs = (t.repeat_interleave(E // t.shape[1], dim=1) for t in (ks, vs))
        elif len(sizes) >= 4:  # every block re-reads its prefix: strided keys (the fused projection's) cost more
            ks, vs = ks.contiguous(), vs.contiguous()
        o = block_causal_rows(rows, qr, ks, vs, tok, sizes, BLOCK, offset)  # (B, E, N, Dv)
    else:
        rows_mask = row_mask(head_slice(mask, hs, H), tok, S, offset if core["is_causal"] else None)
        o = attention(rows, ks, vs, attn_mask=rows_mask, **{**core, "is_causal": False})  # (B, E, N, Dv)
    gate = gates[..., hs:].transpose(1, 2).gather(2, tok).unsqueeze(-1)  # (B, T, E) -> (B, E, N, 1)
    # padding rows sit on tokens that did not choose the head: writing 0 there is a no-op
    vals = torch.where(valid.unsqueeze(-1), o * gate, 0.0)
    return out.index_put_((b, tok, e + hs), vals)  # out[b, tok[b, e, n], hs + e] = vals[b, e, n]


def _use_blocks(q, k, v, mask, core, offset) -> bool:
    """Whether the causal routed rows can run as prefix + causal diagonal blocks (``moh_causal``):
    more than one block, no other mask, no dropout, a kernel with log-sum-exp
    for the device, finite inputs (the kernels have no NaN rule) and eager mode."""
    T, S = q.shape[2], k.shape[2]
    if T <= BLOCK or mask is not None or core["backend"] not in ("auto", "sdpa") or kernels_for(q) is None:
        return False
    if (core["training"] and core["dropout_p"] > 0) or offset < 0 or S < T + offset:
        return False
    if torch.compiler.is_compiling():
        return False
    with torch.no_grad():
        return bool(torch.isfinite(q.sum() + k.sum() + v.sum()))


def check_mask(mask: object, B: int, H: int, T: int, S: int) -> None:
    """Validate an attn_mask as ``functional.attention`` does (its rows are gathered here)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added), got dtype {mask.dtype}")
    accepted = f"accepted: (T, S) = ({T}, {S}) or 4-D broadcastable to (B, H, T, S) = ({B}, {H}, {T}, {S})"
    if mask.dim() == 2 and tuple(mask.shape) == (T, S):
        return
    if mask.dim() == 4 and all(g in (1, w) for g, w in zip(mask.shape, (B, H, T, S))):
        return
    raise ValueError(f"attn_mask has shape {tuple(mask.shape)}; {accepted}")


def head_slice(mask: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """The part of a (T, S) or 4-D mask that applies to heads lo..hi-1."""
    if mask is None or mask.dim() != 4 or mask.shape[1] == 1:
        return mask
    return mask[:, lo:hi]


def kv_for(k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [B, G', S, D] serving query heads lo..hi-1 (r query heads per key/value head)."""
    if lo % r == 0 and hi % r == 0:
        return k[:, lo // r : hi // r], v[:, lo // r : hi // r]  # whole groups: keep GQA
    idx = torch.arange(lo, hi, device=k.device) // r  # a group is cut: one key/value head per query head
    return k[:, idx], v[:, idx]


def row_mask(mask: torch.Tensor | None, tok: torch.Tensor, S: int, offset: int | None):
    """Mask broadcastable to [B, E, M, S] for the gathered query rows ``tok`` [B, E, M].

    The user/padding mask rows are gathered at the original positions; with
    ``offset`` (causal) a row at position t may see keys j <= t + offset.
    """
    B, E, M = tok.shape
    out = None
    if mask is not None:
        m4 = mask if mask.dim() == 4 else mask[None, None]  # (T, S) -> (1, 1, T, S)
        if m4.shape[2] > 1:  # rows differ by query position: gather them
            m4 = m4.expand(B, E, -1, S).gather(2, tok.unsqueeze(-1).expand(B, E, M, S))  # (B, E, M, S)
        out = m4
    if offset is not None:
        keys = torch.arange(S, device=tok.device)
        out = merge_masks(out, keys <= (tok + offset).unsqueeze(-1))  # (B, E, M, S)
    return out
