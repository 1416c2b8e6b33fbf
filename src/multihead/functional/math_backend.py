"""The ``math`` backend: explicit scores and softmax, exact weights.

This is the specification path of ``multihead.functional.attention``: every
other backend is tested against it. It materialises the (B, H, T, S) score
matrix, so it can return the attention weights, at the cost of memory that
grows with T x S. Scores are scaled, soft-capped (``softcap``), then
ALiBi and the float bias are added, then hidden keys are excluded. With
``sinks`` each row gets one more column, the head's sink logit, before the
softmax, which is dropped afterwards. A ``WeightSelection`` is cut out of the full weights at
the end (this path computes every weight anyway).

Half-precision inputs (float16, bfloat16) are computed in float32 and the
results cast back, so large scores cannot overflow (q = k = 300 with D = 64
gives scores of 5.8e6, far above float16's 65504).
"""

from __future__ import annotations

import torch

from .alibi import request_alibi
from .request import AttentionRequest
from .softmax import masked_softmax, sink_softmax
from .weights import select_weights

__all__ = ["math_attention"]

_HALF = (torch.float16, torch.bfloat16)


def math_attention(req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compute attention explicitly.

    GQA folds the H // G query heads of each group into the query axis, so
    keys and values are read once per group and never expanded::

        q (B, H, T, D) -> (B, G, R*T, D)   with R = H // G,
        query head h = g*R + r uses key/value head g = h // R.

    Returns:
        (out [B, H, T, Dv] in the input dtype,
         weights [B, H, T, S] post-softmax and pre-dropout ([B, h, r, S] for
         a selection, detached), or None when not requested).
    """
    B, H, G, T, S, Dv = req.shape
    R = H // G
    D = req.q.shape[-1]
    compute = torch.float32 if req.q.dtype in _HALF else req.q.dtype
    q, k, v = (t.to(compute) for t in (req.q, req.k, req.v))

    qg = q.reshape(B, G, R * T, D)  # (B, H, T, D) -> (B, G, R*T, D)
    scores = (qg @ k.transpose(-1, -2)) * req.scale  # (B, G, R*T, S)
    scores = scores.view(B, H, T, S)  # (B, G, R*T, S) -> (B, H, T, S)
    if req.softcap is not None:  # Gemma 2: capped before the bias and the mask
        scores = torch.tanh(scores / req.softcap) * req.softcap
    if req.alibi_slopes is not None:
        scores = scores + request_alibi(req).to(compute)  # (1, H, T, S)
    if req.bias is not None:
        scores = scores + req.bias.to(compute)

    # Hidden keys excluded with where, empty rows all zeros (see masked_softmax).
    if req.sinks is None:
        probs = masked_softmax(scores, req.visible())  # (B, H, T, S)
    else:  # one more column, the head's sink logit, always visible; dropped after the softmax
        probs = sink_softmax(scores, req.visible(), req.sinks.to(compute))  # (B, H, T, S), rows sum <= 1

    weights = probs if req.return_weights else None
    if req.dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=req.dropout_p, training=True)

    out = probs.reshape(B, G, R * T, S) @ v  # (B, G, R*T, Dv)
    out = out.view(B, H, T, Dv).to(req.q.dtype)  # (B, G, R*T, Dv) -> (B, H, T, Dv)
    if weights is not None:
        if req.weights_detached:
            weights = select_weights(weights.detach(), req.weight_heads, req.weight_rows)
        weights = weights.to(req.q.dtype)
    return out, weights
