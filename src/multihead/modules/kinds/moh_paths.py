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
padding to M). The shared heads run as one ordinary call. With
``is_causal`` the gathered rows carry an explicit per-row mask, so the
kernel cannot skip the hidden upper triangle as the fused causal kernel does
for the shared heads and the dense path: the causal saving is smaller. The
dense path (``path="dense"``: every head computed, then multiplied by its
gate, as the official code does) is kept for equality tests; both agree to
1e-10 in float64.
"""

from __future__ import annotations

import torch

from ...functional import attention, merge_masks

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
    """Shared heads in one call; the routed heads in one call over only the rows that chose them."""
    B, H, T, D = q.shape
    S, G, hs = k.shape[2], k.shape[1], shared_heads
    E = H - hs
    r = H // G  # query heads per key/value head
    parts = []
    if hs:
        ks, vs = kv_for(k, v, 0, hs, r)
        out = attention(q[:, :hs], ks, vs, attn_mask=head_slice(mask, 0, hs), **core)  # (B, hs, T, D)
        parts.append(out * gates[..., :hs].transpose(1, 2).unsqueeze(-1))  # (B, T, hs) -> (B, hs, T, 1)
    counts = chosen.sum(1)  # (B, E): rows that chose each routed head
    # rows per routed head, padded to the largest (batch row, head); inside
    # torch.compile to T (no host sync: the extra padding rows are zeroed below)
    M = T if torch.compiler.is_compiling() else int(counts.max())
    # per (b, e): the positions that chose e first, in token order, then the others (padding)
    order = torch.argsort((~chosen).to(torch.uint8), dim=1, stable=True)  # (B, T, E)
    tok = order[:, :M].transpose(1, 2)  # (B, M, E) -> (B, E, M), distinct within each (b, e)
    valid = torch.arange(M, device=q.device) < counts.unsqueeze(-1)  # (B, E, M); False = padding row
    at = tok.unsqueeze(-1).expand(B, E, M, D)
    rows = q[:, hs:].gather(2, at)  # (B, E, T, D) -> (B, E, M, D)
    ks, vs = kv_for(k, v, hs, H, r)
    offset = 0 if core["causal_alignment"] == "top_left" else S - T
    rows_mask = row_mask(head_slice(mask, hs, H), tok, S, offset if core["is_causal"] else None)
    out = attention(rows, ks, vs, attn_mask=rows_mask, **{**core, "is_causal": False})  # (B, E, M, D)
    gate = gates[..., hs:].transpose(1, 2).gather(2, tok).unsqueeze(-1)  # (B, T, E) -> (B, E, M, 1)
    # padding rows sit on tokens that did not choose the head: writing 0 there is a no-op
    vals = torch.where(valid.unsqueeze(-1), out * gate, 0.0)
    parts.append(q.new_zeros(B, E, T, D).scatter(2, at, vals))  # unchosen (token, head) pairs stay 0
    return torch.cat(parts, dim=1).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


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
