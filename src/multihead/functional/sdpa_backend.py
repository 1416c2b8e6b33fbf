"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention``.

What this module adds on top of the kernel, so it keeps multihead's
promises:

* causal alignment: the kernel's ``is_causal`` is top-left; bottom-right
  (decoding) is passed as an explicit mask;
* rows with nothing to attend to are given a harmless mask row and their
  output is set to zero afterwards, so no NaN reaches outputs or gradients
  (inside ``torch.compile`` this is done unconditionally, without reading
  the mask on the host);
* ALiBi is added to the float mask the kernel takes (so the weights rebuilt
  from its log-sum-exp stay exact); soft-capping is refused (not additive);
* GQA never expands keys/values: with a causal triangle the kernel's
  ``enable_gqa`` is used; otherwise the R = H // G query heads of a group are
  folded into the query axis, (B, H, T, D) -> (B, G, R*T, D), which on CPU is
  about 5x faster than ``enable_gqa`` for a decoding step (docs/benchmarks.md,
  ``benchmarks/cases/gqa_decode.py``).

A call that asks for weights runs the same kernel through the operator that
also returns its log-sum-exp, and the weights asked for are rebuilt from it
(``lse_backend``); where that cannot serve, the reasons say why and ``auto``
uses ``math``. A call with sinks corrects the same kernel's output by its
log-sum-exp (``sinks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import host_sync
from .alibi import alibi_as_bias
from .lse_backend import cuda_kernel_inputs, lse_attention, lse_not_supported
from .request import AttentionRequest
from .sinks import sink_attention

__all__ = ["sdpa_attention", "sdpa_not_supported"]


def sdpa_not_supported(req: AttentionRequest) -> list[str]:
    """Reasons the fused kernel cannot serve ``req`` (empty when it can)."""
    reasons = lse_not_supported(req) if req.return_weights or req.sinks is not None else []
    if req.softcap is not None:
        reasons.append(f"softcap={req.softcap}: the kernel adds a mask to the scores but cannot cap them (tanh)")
    if req.bias is not None and req.bias.dtype != req.q.dtype:
        # float16/bfloat16 inputs: the float32 mask is cast to q's dtype for the
        # kernel, where e.g. finfo(float32).min becomes -inf and hides a key
        # that the math path keeps.
        limit = torch.finfo(req.q.dtype).max
        if torch.compiler.is_compiling():
            # Reading the mask's values would be a host sync inside the graph.
            reasons.append(
                f"a float attn_mask with {req.q.dtype} inputs cannot be range-checked while compiling "
                "(the kernel's cast could turn large values into inf); use a bool mask or the math backend"
            )
        elif req.bias.numel() and bool(req.bias.abs().amax() > limit):
            reasons.append(
                f"attn_mask has values beyond {req.q.dtype}'s range (+-{limit:.5g}), "
                "which the kernel's cast would turn into inf; use -inf or a bool mask"
            )
    return reasons


def _fold_mask(mask: torch.Tensor, B: int, H: int, G: int, T: int, S: int) -> torch.Tensor:
    """(Bm, Hm, Tm, S) mask -> (Bm, Hm', R*T, S) matching folded queries."""
    R = H // G
    Bm, Hm = mask.shape[0], mask.shape[1]
    if Hm == 1:
        if mask.shape[2] == 1:
            return mask  # broadcasts over the folded query axis as it is
        mask = mask.expand(Bm, 1, T, S).unsqueeze(2)  # (Bm, 1, 1, T, S)
        return mask.expand(Bm, 1, R, T, S).reshape(Bm, 1, R * T, S)
    mask = mask.expand(Bm, H, T, S)
    return mask.reshape(Bm, G, R * T, S)  # (Bm, H, T, S) -> (Bm, G, R*T, S)


def sdpa_attention(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compute attention with ``F.scaled_dot_product_attention``.

    Returns:
        (out [B, H, T, Dv], None), or with weights asked for (out, weights
        rebuilt from the kernel's log-sum-exp: ``lse_backend``). ALiBi is
        passed to the kernel as part of its float mask.
    """
    req = alibi_as_bias(req)  # (1, H, T, S) added to the scores, as any float mask
    if req.sinks is not None:
        return sink_attention(req)
    if req.return_weights:
        return lse_attention(req)
    B, H, G, T, S, Dv = req.shape
    R = H // G
    q, k, v = req.q, req.k, req.v

    native_causal = (
        req.allowed is None
        and req.bias is None
        and not req.causal_is_trivial
        and (req.causal_alignment == "top_left" or T == S)
    )
    mask = None
    row_ok = None
    if not native_causal:
        visible = req.visible()
        if visible is not None:
            ok = visible.any(dim=-1, keepdim=True)  # (..., T, 1)
            # Eager code skips the fix-up when every row sees a key (a host read);
            # compiled code always applies it, a no-op on rows that see one.
            if host_sync.sync_free() or not bool(ok.all()):
                row_ok = ok
                visible = visible | ~ok  # any finite row; its output is zeroed below
        mask = visible
        if req.bias is not None:
            bias = req.bias.to(q.dtype)
            mask = bias if visible is None else bias.masked_fill(~visible, float("-inf"))

    kwargs = {}
    folded = G != H and not native_causal
    if G != H and not folded:
        kwargs["enable_gqa"] = True
    if folded:
        q = q.reshape(B, G, R * T, q.shape[-1])  # (B, H, T, D) -> (B, G, R*T, D)
        if mask is not None:
            mask = _fold_mask(mask, B, H, G, T, S)

    q, k, v = cuda_kernel_inputs(q, k, v)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=req.dropout_p,
        is_causal=native_causal,
        scale=req.scale,
        **kwargs,
    )
    if folded:
        out = out.reshape(B, H, T, Dv)  # (B, G, R*T, Dv) -> (B, H, T, Dv); the kernel's output may be strided
    if row_ok is not None:
        out = out.masked_fill(~row_ok, 0.0)
    return out, None
