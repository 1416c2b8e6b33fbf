"""The ``flex`` backend: ``torch.nn.attention.flex_attention``.

One compiled function serves every call: soft-capping, ALiBi and the float
bias go into its score function, the "may attend" mask into a block mask::

    score_mod(x, b, h, i, j) = cap·tanh(x / cap) - m_h·|i + offset - j| + bias[b, h, i, j]
    mask_mod(b, h, i, j)     = allowed[b, h, i, j] AND j <= i + offset (with causality)

x is the scaled score q_i·k_j·scale; offset places the queries among the
keys (0 top-left, S - T bottom-right). The block mask is built from the
request's mask whatever built it (padding, sliding windows,
``masks.document_mask`` for packed sequences, ``masks.prefix_lm_mask``), so
key blocks that no query of a block may see are skipped; a causal-only
block mask is kept per (T, S, offset, device). A row that may see no key
gives output 0 (flex_attention's own result), as on the other backends;
non-finite keys and values are handled before any backend runs
(``nonfinite``).

Compilation: the function is compiled once (``torch.compile``,
``dynamic=False``) and torch keeps one compiled graph per shape family (the
sizes, dtypes, which of softcap / ALiBi / bias / mask are present and the
softcap, scale and offset values); repeated calls of one family do not
compile again (past torch's recompile limit torch runs flex_attention
unfused, with the same numbers).

Where it cannot serve, the reasons say so and ``auto`` moves on: dropout
(flex_attention has none); float64; on CPU, calls inside a user's
``torch.compile`` (inductor cannot fuse the CPU template with the code
around it) and gradients (torch 2.13 compiles
flex_attention on CPU for inference only) and weights (its CPU kernel returns
no log-sum-exp); weights that must carry gradients; a float mask that
requires grad. On CUDA the weights asked for are rebuilt from the kernel's
log-sum-exp (``weights.rebuild_weights``, with the softcap and the ALiBi
bias), exactly as on the ``sdpa`` path.
"""

from __future__ import annotations

import torch

from .alibi import request_alibi
from .request import AttentionRequest
from .weights import rebuild_weights

__all__ = ["flex_attention_backend", "flex_not_supported"]

_COMPILED = None
_CAUSAL_MASKS: dict[tuple, object] = {}
_MAX_CACHED_MASKS = 16


def flex_not_supported(req: AttentionRequest) -> list[str]:
    """Reasons flex_attention cannot serve ``req`` (empty when it can)."""
    reasons = []
    device = req.q.device.type
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (req.q, req.k, req.v))
    if device not in ("cpu", "cuda"):
        reasons.append(f"flex_attention is compiled here for CPU and CUDA only, not {device!r}")
    if req.sinks is not None:
        reasons.append("sinks: the flex backend's score function has no sink column (math and sdpa serve sinks)")
    if req.dropout_p > 0.0:
        reasons.append(f"dropout in training (dropout_p={req.dropout_p}): flex_attention has no dropout")
    D, Dv = req.q.shape[-1], req.v.shape[-1]
    if device == "cuda" and min(D, Dv) < 16:  # torch's CUDA flex template (2.11-2.13)
        reasons.append(f"head widths below 16 on CUDA (D={D}, Dv={Dv}): flex_attention's CUDA kernel needs 16 or more")
    if req.q.dtype == torch.float64:  # CUDA: Triton failed to compile its float64 dots (H100, torch 2.11)
        reasons.append("float64: flex_attention's kernels take float32, float16 and bfloat16")
    if device == "cpu" and torch.compiler.is_compiling():
        reasons.append("inside torch.compile on CPU: inductor's CPU flex_attention template cannot be fused "
                       "with the code around it (torch 2.13); call it outside the compiled region")  # fmt: skip
    if device == "cpu" and grad:
        reasons.append("an input requires grad: on CPU torch compiles flex_attention for inference only (no backward)")
    if device == "cpu" and req.return_weights:
        reasons.append("weights on CPU: the CPU kernel of flex_attention returns no log-sum-exp to rebuild them from")
    if req.weights_need_grad:
        reasons.append("return_weights=True while an input requires grad: weights rebuilt from the log-sum-exp carry no gradient")
    if req.bias is not None and req.bias.requires_grad and torch.is_grad_enabled():
        reasons.append("a float attn_mask that requires grad: the score function reads it as a constant")
    return reasons


def _index(t: torch.Tensor, b, h, i, j) -> torch.Tensor:
    """t[b, h, i, j] of a tensor broadcastable to [B, H, T, S] (size-1 dims read index 0)."""
    picks = [x if n != 1 else 0 for x, n in zip((b, h, i, j), t.shape)]
    return t[picks[0], picks[1], picks[2], picks[3]]


def _flex_call(q, k, v, block_mask, bias, slopes, softcap, offset, scale, gqa, lse):
    """flex_attention with the score function of one call (traced inside the compiled function)."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(x, b, h, i, j):
        if softcap is not None:
            x = torch.tanh(x / softcap) * softcap
        if slopes is not None:
            x = x - slopes[h] * (i + offset - j).abs()
        if bias is not None:
            x = x + _index(bias, b, h, i, j)
        return x

    mod = None if softcap is None and slopes is None and bias is None else score_mod
    if lse:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                  return_aux=AuxRequest(lse=True))  # fmt: skip
        return out, aux.lse
    return flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale, enable_gqa=gqa), None


def compiled_flex():
    """The compiled ``_flex_call`` (built on first use, then reused)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_flex_call, dynamic=False, fullgraph=True)
    return _COMPILED


def block_mask_for(req: AttentionRequest):
    """The BlockMask of the request's visible keys (mask AND causality), or None."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, G, T, S, _ = req.shape
    offset = None if req.causal_is_trivial else req.alibi_offset
    allowed, device = req.allowed, req.q.device
    if allowed is None and offset is None:
        return None
    if allowed is None:
        key = (T, S, offset, str(device))
        if key not in _CAUSAL_MASKS:
            if len(_CAUSAL_MASKS) >= _MAX_CACHED_MASKS:
                _CAUSAL_MASKS.pop(next(iter(_CAUSAL_MASKS)))
            _CAUSAL_MASKS[key] = create_block_mask(
                lambda b, h, i, j: j <= i + offset, None, None, T, S, device=device
            )  # fmt: skip
        return _CAUSAL_MASKS[key]
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    dense = allowed.expand(Bm, Hm, T, S)

    def mask_mod(b, h, i, j):
        ok = _index(dense, b, h, i, j)
        return ok if offset is None else ok & (j <= i + offset)

    return create_block_mask(mask_mod, Bm if Bm > 1 else None, Hm if Hm > 1 else None, T, S, device=device)


def flex_attention_backend(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compute attention with the compiled flex_attention.

    Returns:
        (out [B, H, T, Dv], None), or (out, weights [B, h, r, S] detached)
        rebuilt from the kernel's log-sum-exp when weights are asked for (CUDA).
    """
    B, H, G, T, S, Dv = req.shape
    q, k, v = req.q, req.k, req.v
    if not torch.is_grad_enabled():  # flex_attention refuses CPU inputs that require grad, even without grad mode
        q, k, v = q.detach(), k.detach(), v.detach()
    bias = req.bias
    if bias is not None and q.dtype != torch.float64:
        bias = bias.float()
    out, lse = compiled_flex()(
        q, k, v, block_mask_for(req), bias, req.alibi_slopes, req.softcap, req.alibi_offset, req.scale,
        G != H, req.return_weights,
    )  # fmt: skip
    weights = flex_weights(req, lse) if req.return_weights else None
    return out, weights


def flex_weights(req: AttentionRequest, lse: torch.Tensor) -> torch.Tensor:
    """The weights asked for, [B, h, r, S] detached, from flex_attention's
    log-sum-exp lse [B, H, T] (natural log of the capped, biased scores)."""
    bias = req.bias
    if req.alibi_slopes is not None:
        alibi = request_alibi(req)
        bias = alibi if bias is None else bias + alibi.to(bias.dtype)
    _, _, _, T, S, _ = req.shape
    offset = None if req.causal_is_trivial else req.alibi_offset
    return rebuild_weights(
        req.q, req.k, lse, scale=req.scale, bias=bias, visible=req.allowed, heads=req.weight_heads,
        rows=req.weight_rows, causal_offset=offset, softcap=req.softcap,
    )  # fmt: skip
