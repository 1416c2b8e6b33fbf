"""``attention(q, k, v, ...)``: the one entry point every module calls."""

from __future__ import annotations

import torch

from .backends import select_backend
from .math_backend import math_attention
from .nonfinite import split_nonfinite
from .request import make_request
from .weights import WeightSelection

__all__ = ["attention"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    return_weights: bool | WeightSelection = False,
    backend: str = "auto",
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with GQA, exact masking and named backends.

    softmax(cap(q kᵀ · scale) + alibi + bias, hiding masked keys) v, per query head h with
    key/value head h // (H // G)::

        H = 4 query heads, G = 2 key/value heads
        q heads:   0  1  2  3
                    \\/    \\/
        kv heads:   0     1          (repeat_interleave order, not tile)

    Args:
        q: [B, H, T, D] queries.
        k: [B, G, S, D] keys, G dividing H (G = H: MHA, G = 1: MQA).
        v: [B, G, S, Dv] values.
        attn_mask: None; bool (True = may attend); or floating, added to the
            scores (-inf entries count as hidden). Shape (T, S), or 4-D
            broadcastable to (B, H, T, S). 3-D masks are refused because
            (B, T, S) and (H, T, S) would be indistinguishable.
        is_causal: hide keys after each query; combined with ``attn_mask``
            by logical AND on "may attend".
        causal_alignment: ``"top_left"`` or ``"bottom_right"`` when T != S
            (see ``multihead.functional.masks``); decoding is bottom-right.
        scale: score multiplier, default 1 / sqrt(D).
        dropout_p: dropout on the weights, applied only when ``training``;
            with 0 no random numbers are drawn.
        training: whether dropout is active.
        return_weights: also return the exact post-softmax weights
            (before dropout). True: all of them, [B, H, T, S], carrying
            gradients where an input requires grad. A ``WeightSelection``:
            those of some query heads and rows only, [B, h, r, S], detached.
            ``sdpa`` keeps its fused kernel for the output and rebuilds the
            weights from the kernel's log-sum-exp, only where asked
            (``functional.lse_backend``); ``math`` forms every weight.
        backend: ``"auto"`` (the first of ``AUTO_ORDER`` that serves the
            call: the fused ``sdpa`` kernel unless the request needs another
            path, e.g. weights with gradients or dropout with weights ->
            ``math``; soft-capping -> ``flex`` on CUDA, ``math`` on CPU),
            ``"math"``, ``"sdpa"`` or ``"flex"`` (``functional.flex_backend``).
        alibi_slopes: (H,) ALiBi slopes (``alibi_slopes(H)``), or None: head
            h adds -m_h·|i + offset - j| to its scores, queries placed among
            the keys as ``causal_alignment`` places them (bottom-right:
            query i of T sits at key S - T + i, as when decoding with a cache).
        softcap: None, or c > 0: scaled scores x become c·tanh(x / c)
            before ALiBi, the bias and masking (Gemma 2's logit
            soft-capping). ``sdpa`` cannot serve it.
        sinks: None, or [H] learned sink logits (gpt-oss): one more column of
            each row's softmax holding s_h, mixing no value, dropped after
            the softmax; rows of the weights sum to less than 1 and a row
            that may see no key gets output 0 (``functional.sinks``).

    Returns:
        out [B, H, T, Dv], or (out, weights) when ``return_weights``.

    Guarantees (all backends): a query that may attend to nothing gets output
    0, weights 0 and zero gradients; keys/values it may not see (even NaN)
    do not change its output, while a NaN it may see stays visible in it
    (``multihead.functional.nonfinite``); float16/bfloat16 scores are
    accumulated in float32.

    Raises:
        TypeError: non-tensors, non-floating q/k/v, integer masks.
        ValueError: shapes, dtypes, devices, mask shapes, scale, dropout_p,
            causal_alignment, unknown backend, a backend that cannot serve
            the call (with every reason), a selection outside the call's
            heads or rows, sinks that are not [H] on q's device.
    """
    req = make_request(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=scale,
        dropout_p=dropout_p,
        training=training,
        return_weights=return_weights,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
    )
    chosen = select_backend(backend, req)
    req, fixup = split_nonfinite(req)
    B, H, G, T, S, Dv = req.shape
    if B == 0 or T == 0 or S == 0 or H == 0:
        # Nothing for a kernel to do: the explicit path returns the empty or
        # all-zero result (with zero gradients) whatever the backend.
        out, weights = math_attention(req)
    else:
        out, weights = chosen.forward(req)
    if fixup is not None:
        out, weights = fixup(out, weights)
    return (out, weights) if req.return_weights else out
