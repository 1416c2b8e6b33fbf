"""Weights from the fused kernel: its output plus its log-sum-exp.

When a call asks for weights, the ``sdpa`` backend still computes the output
with torch's fused kernel, called through the aten operator that also returns
the kernel's log-sum-exp lse [B, H, T] (natural log, of the scaled and
biased scores, float32 for half inputs); ``weights.rebuild_weights`` then
forms exp(q kᵀ · scale + bias - lse) for the heads and rows asked for. The
output and its gradients are the kernel's; the weights are detached.

Which operator, by device (the choice is torch's own, ``_fused_sdp_choice``,
the one ``F.scaled_dot_product_attention`` makes for the same call):

* CPU: ``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
  is_causal, attn_mask=, scale=)`` -> (out, lse [B, H, T]). It takes float
  masks of q's dtype (bool masks are passed as 0 / -inf), grouped key/value
  heads as they are, any float dtype (float64 included), and needs D == Dv
  (the narrower of q/k and v gets zero columns, which change no score).
  A row whose mask is all -inf gives out 0 and lse 0; multihead gives such a
  row a harmless mask and zeroes it afterwards, as the ``sdpa`` path does.
  It reads each row of q, k, v and the mask as contiguous memory: a last
  stride other than 1 gives wrong numbers, so such tensors are copied first.
* CUDA: ``_scaled_dot_product_flash_attention`` (no mask; head dim padded to
  a multiple of 8 as torch's front end does), ``_efficient_attention``
  (lse [B, H, T rounded up to 32]; the mask's rows padded to a multiple of
  16 elements) or ``_cudnn_attention`` (lse [B, H, T, 1]); grouped key/value
  heads are repeated to H. float64 has no fused CUDA kernel.

Where no such kernel serves the call the reasons are listed and ``auto``
uses the ``math`` path: dropout in training, weights that must carry
gradients (``return_weights=True`` while an input requires grad), a float
mask that requires grad, a CUDA call no fused kernel takes (float64, or
kernels turned off with ``torch.nn.attention.sdpa_kernel``), another device
type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import host_sync
from .request import AttentionRequest
from .weights import rebuild_weights

__all__ = ["lse_not_supported", "lse_attention", "fused_out_lse", "lse_weights"]

_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3  # torch.nn.attention.SDPBackend values of _fused_sdp_choice
_CUDA_KERNELS = {_FLASH: "flash", _EFFICIENT: "efficient", _CUDNN: "cudnn"}


def lse_not_supported(req: AttentionRequest) -> list[str]:
    """Reasons the fused kernel cannot give this call's output with its log-sum-exp."""
    reasons = []
    if req.dropout_p > 0.0:
        reasons.append(
            f"dropout in training (dropout_p={req.dropout_p}): the weights before dropout come from the math path"
        )
    if req.weights_need_grad:
        reasons.append(
            "return_weights=True while an input requires grad: weights rebuilt from the kernel's log-sum-exp "
            "carry no gradient (ask for a WeightSelection to get them detached)"
        )
    if req.bias is not None and req.bias.requires_grad and torch.is_grad_enabled():
        reasons.append("a float attn_mask that requires grad: the fused kernel has no gradient for it")
    device = req.q.device.type
    if device == "cuda":
        if req.q.dtype == torch.float64:
            reasons.append("float64 on CUDA: no fused kernel takes it")
        elif not reasons:
            q, k, v, mask, causal, _ = _kernel_inputs(req)
            try:
                choice = int(torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=causal, scale=req.scale))
            except RuntimeError:  # every kernel allowed (torch.nn.attention.sdpa_kernel) refused, math included
                choice = -1
            if choice not in _CUDA_KERNELS:
                reasons.append(f"no fused CUDA kernel takes this call (torch picks SDPBackend {choice}), so no log-sum-exp")
    elif device != "cpu":
        reasons.append(f"no fused kernel with a log-sum-exp on device type {device!r}")
    return reasons


def _kernel_inputs(req: AttentionRequest):
    """(q, k, v, mask, is_causal, row_ok) for the kernel call.

    mask: float of q's dtype broadcastable to [B, H, T, S] (-inf = hidden) or
    None; row_ok: bool [..., T, 1], False on rows that see no key (given a
    harmless row here, zeroed afterwards), or None when every row sees one.
    """
    B, H, G, T, S, Dv = req.shape
    q, k, v = req.q, req.k, req.v
    native_causal = (
        req.allowed is None
        and req.bias is None
        and not req.causal_is_trivial
        and (req.causal_alignment == "top_left" or T == S)
    )
    mask = row_ok = None
    if not native_causal:
        visible = req.visible()
        if visible is not None:
            ok = visible.any(dim=-1, keepdim=True)  # (..., T, 1)
            # Eager code looks (a host read); compiled code always applies the harmless row.
            if host_sync.sync_free() or not bool(ok.all()):
                row_ok = ok
                visible = visible | ~ok
        if req.bias is not None:
            mask = req.bias.to(q.dtype)
            if visible is not None:
                mask = mask.masked_fill(~visible, float("-inf"))
        elif visible is not None:
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    if q.device.type == "cuda" and G != H:
        k = k.repeat_interleave(H // G, dim=1)  # (B, G, S, D) -> (B, H, S, D): CUDA kernels take equal heads
        v = v.repeat_interleave(H // G, dim=1)
    q, k, v = cuda_kernel_inputs(*_unit_last_stride(q, k, v))
    (mask,) = _unit_last_stride(mask) if mask is not None else (None,)
    return q, k, v, mask, native_causal, row_ok


def cuda_kernel_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as CUDA's fused kernels read them right: a CUDA tensor that is not
    ``kernel_ready`` is copied (a view into a fused projection whose widths are not
    multiples of 8 elements gave wrong bfloat16 results on an H100). Aligned views pass
    as they are, so q, k and v cut from a fused projection at head widths of 8·k
    elements are not copied (a forward 10-17% faster on an H100,
    ``benchmarks/cuda_views.py``). CPU tensors are returned as they are, and so is
    everything inside ``torch.compile`` (a data pointer cannot be traced; inductor
    aligns its own kernels' inputs)."""
    if torch.compiler.is_compiling():
        return tensors
    return tuple(t if not t.is_cuda or kernel_ready(t) else t.clone(memory_format=torch.contiguous_format) for t in tensors)


def kernel_ready(t: torch.Tensor) -> bool:
    """Whether the fused kernels read ``t`` right as it is (``cuda_kernel_inputs``' rule, on
    any device): it starts at a multiple of 16 bytes and is contiguous, or is a view with a
    last stride of 1 whose other strides (of dimensions longer than 1) are multiples of 16 bytes."""
    if t.data_ptr() % 16:
        return False
    size = t.element_size()
    strides = (s * size % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t.is_contiguous() or (t.stride(-1) == 1 and all(strides))


def _unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with a last stride of 1: the kernels read each row as a run of
    memory (torch's front end checks this; calling the operator directly, multihead does)."""
    return tuple(t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in tensors)


def _aligned(mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> torch.Tensor | None:
    """A CUDA kernel's bias: rows padded to a multiple of 16 elements, expanded to [B, H, T, S]."""
    if mask is None:
        return None
    S = mask.shape[-1]
    if S % 16 or mask.stride(-1) != 1:
        padded = mask.new_zeros(*mask.shape[:-1], -(-S // 16) * 16)
        padded[..., :S] = mask
        mask = padded[..., :S]
    return mask.expand(shape)


def _cuda_kernel(q, k, v, mask, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, Dv], lse [B, H, T]) from the CUDA kernel torch picks."""
    B, H, T, D = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    choice = int(torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=causal, scale=scale))
    aten = torch.ops.aten
    if choice == _FLASH:
        width = -(-max(D, Dv) // 8) * 8  # equal head dims, a multiple of 8: zero columns change no score
        if (D, Dv) != (width, width):
            q, k, v = _unit_last_stride(*(F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v)))
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        out = out[..., :Dv]
    elif choice == _EFFICIENT:
        bias = _aligned(mask, (B, H, T, S))
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
    elif choice == _CUDNN:
        bias = _aligned(mask, (B, H, T, S))
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False, scale=scale)[:2]
    else:  # lse_not_supported refused this call before the backend ran
        raise RuntimeError(f"no fused CUDA kernel with a log-sum-exp for this call (SDPBackend {choice})")
    return out, lse.reshape(B, H, -1)[..., :T]  # efficient pads T to 32, cudnn adds a trailing 1


def lse_attention(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's output and the weights asked for, rebuilt from its log-sum-exp.

    Returns:
        (out [B, H, T, Dv] with the kernel's gradients, weights [B, h, r, S]
        detached: every head and row, or ``req.weight_heads`` x ``req.weight_rows``).
    """
    out, lse = fused_out_lse(req)
    return out, lse_weights(req, lse)


def lse_weights(req: AttentionRequest, lse: torch.Tensor) -> torch.Tensor:
    """The weights ``req`` asks for [B, h, r, S], rebuilt from the kernel's lse [B, H, T]."""
    bias = None if req.bias is None else req.bias.to(req.q.dtype)  # what the kernel added
    B, H, G, T, S, Dv = req.shape
    offset = None if req.causal_is_trivial else 0 if req.causal_alignment == "top_left" else S - T
    return rebuild_weights(
        req.q, req.k, lse, scale=req.scale, bias=bias, visible=req.allowed,
        heads=req.weight_heads, rows=req.weight_rows, causal_offset=offset,
    )  # fmt: skip


def fused_out_lse(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, Dv], lse [B, H, T]) of the fused kernel; out is 0 on rows that see no key."""
    q, k, v, mask, causal, row_ok = _kernel_inputs(req)
    if q.device.type == "cuda":
        out, lse = _cuda_kernel(q, k, v, mask, causal, req.scale)
    else:
        D, Dv = q.shape[-1], v.shape[-1]
        if D != Dv:  # the CPU kernel needs equal head dims: zero columns change no score and add no output
            q, k = (F.pad(t, (0, max(D, Dv) - D)) for t in (q, k))
            v = F.pad(v, (0, max(D, Dv) - Dv))
        q, k, v = cuda_kernel_inputs(*_unit_last_stride(q, k, v))  # F.pad keeps a layout whose last stride may not be 1
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = op(q, k, v, 0.0, causal, attn_mask=mask, scale=req.scale)
        out = out[..., :Dv]
    if row_ok is not None:
        out = out.masked_fill(~row_ok, 0.0)
    return out, lse
