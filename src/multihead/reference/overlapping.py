"""Multi-overlapped-head self-attention (MOHSA) in NumPy float64: the specification.

Zhang, Luo and Wang, "Improving Vision Transformers by Overlapping Heads in
Multi-Head Self-Attention", arXiv:2410.14874 (2024); official code
``ZTX-100/MOHSA``.

Notation (the paper's): C model width, H heads, dh the un-widened head width,
C' = H·dh, ov = ``overlap`` (an integer number of channels). Each of the
projected q, k, v (width C') is zero-padded by ov channels at both ends and
head i takes the window of padded channels [i·dh, (i+1)·dh + 2·ov), i.e. the
original channels [i·dh - ov, (i+1)·dh + ov) with zeros outside [0, C')::

    C' = 6, H = 3, dh = 2, ov = 1       (0 = zero padding)

    padded channels:   0 | c0 c1 | c2 c3 | c4 c5 | 0
    head 0:            0   c0 c1   c2
    head 1:                   c1   c2 c3   c4
    head 2:                          c3   c4 c5   0

Every head is dh + 2·ov wide; the score scale stays dh^(-1/2); the head
outputs (each dh + 2·ov wide) are concatenated head-major and the output
projection maps H·(dh + 2·ov) back to C. ov = 0 is plain multi-head attention.
"""

import math

import numpy as np

from multihead.reference.attention import attention

__all__ = ["overlapped_heads", "overlapping_attention"]


def overlapped_heads(X, num_heads, overlap):
    """Split projected channels into overlapping heads.

    X̃_i[..., j] = X[..., i·dh - ov + j] if 0 <= i·dh - ov + j < C', else 0,
    for j = 0 .. dh + 2·ov - 1.

    Args:
        X: [B, N, C'] one of the projected q, k or v, C' = H·dh.
        num_heads: H; must divide C'.
        overlap: ov >= 0 channels taken from each neighbour.

    Returns:
        float64 [B, H, N, dh + 2·ov].

    Raises:
        ValueError: X not 3-D, H <= 0 or not dividing C', or ov < 0.
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 3:
        raise ValueError(f"X must be (B, N, C'), got shape {X.shape}")
    if num_heads <= 0 or X.shape[-1] % num_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be positive and divide C'={X.shape[-1]}")
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0, got overlap={overlap}")
    B, N, Cp = X.shape
    H, ov = num_heads, overlap
    dh = Cp // H
    out = np.zeros((B, H, N, dh + 2 * ov))
    for i in range(H):
        for j in range(dh + 2 * ov):
            c = i * dh - ov + j  # original channel under padded position i·dh + j
            if 0 <= c < Cp:
                out[:, i, :, j] = X[:, :, c]
    return out


def overlapping_attention(
    x,
    context,
    W_q,
    W_k,
    W_v,
    W_o,
    num_heads,
    overlap,
    b_q=None,
    b_k=None,
    b_v=None,
    b_o=None,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
    return_weights=False,
):
    """MOHSA: attention over overlapping heads.

    For each head i::

        q̃_i, k̃_i, ṽ_i = overlapped_heads(x W_qᵀ + b_q), ... (context for k, v)
        A_i = softmax(q̃_i k̃_iᵀ · dh^(-1/2))          (masked as in reference.attention)
        O_i = A_i ṽ_i                                  (width dh + 2·ov)
        y   = concat_i(O_i) W_oᵀ + b_o

    Args:
        x: [B, T, C] queries' input.
        context: [B, S, C_kv] keys' and values' input (pass ``x`` for
            self-attention).
        W_q: [C', C]; W_k, W_v: [C', C_kv] (``nn.Linear`` layout).
        W_o: [C, H·(dh + 2·ov)].
        num_heads: H.
        overlap: ov >= 0.
        b_q, b_k, b_v: [C'] or None; b_o: [C] or None.
        mask, is_causal, causal_alignment: as in
            :func:`multihead.reference.attention.attention` (mask [T, S] or
            4-D broadcastable to [B, H, T, S]).
        return_weights: also return A [B, H, T, S].

    Returns:
        y [B, T, C], or (y, A [B, H, T, S]).
    """
    x, context = np.asarray(x, dtype=np.float64), np.asarray(context, dtype=np.float64)
    H, ov = num_heads, overlap

    def linear(inp, W, b):
        out = inp @ np.asarray(W, dtype=np.float64).T
        return out if b is None else out + np.asarray(b, dtype=np.float64)

    q = linear(x, W_q, b_q)  # (B, T, C')
    k = linear(context, W_k, b_k)  # (B, S, C')
    v = linear(context, W_v, b_v)  # (B, S, C')
    dh = q.shape[-1] // H
    q_t, k_t, v_t = (overlapped_heads(a, H, ov) for a in (q, k, v))  # (B, H, N, dh + 2ov)
    O, A = attention(
        q_t,
        k_t,
        v_t,
        mask=mask,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=1.0 / math.sqrt(dh),  # the un-widened head width
        return_weights=True,
    )
    B, _, T, Dw = O.shape
    O = O.transpose(0, 2, 1, 3).reshape(B, T, H * Dw)  # (B, H, T, Dw) -> (B, T, H*Dw), head-major
    y = linear(O, W_o, b_o)
    return (y, A) if return_weights else y
