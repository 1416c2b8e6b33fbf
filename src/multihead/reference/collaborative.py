"""Collaborative multi-head attention in NumPy float64: the specification.

Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of
Concatenate" (arXiv:2006.16362, 2020). All heads share one query projection
W_Q and one key projection W_K of width D̃ (the shared key/query width);
head h re-weights the shared channels with its mixing vector m_h::

    Q = X_from W_Q                      (T, D̃)      shared by all heads
    K = X_to W_K                        (S, D̃)
    score_h[i, j] = scale * ( Σ_c Q[i, c] m_h[c] K[j, c]  +  cb[j, h] )
    cb = X_to W_cb                      (S, H)        per-head key-content bias
    P_h = softmax_j(score_h + mask)
    O = concat_h(P_h V_h) W_O + b_O,    V = X_to W_V + b_V split head-major

The content bias replaces the query bias of standard attention (a query
bias b_Q,h adds b_Q,h · k_{h,j} to every score, a per-key term); there are
no other query/key biases (a key bias only shifts whole rows and cancels in
the softmax). ``scale`` defaults to 1 / sqrt(D̃ / H), the official code's
choice (D̃ / H is a float division).

Weights are in the paper's (in, out) layout: ``x @ W``.
"""

import math

import numpy as np

from multihead.reference.attention import _check_mask, causal_mask

__all__ = ["collaborative_attention", "collaborative_scores"]


def collaborative_scores(x_from, x_to, W_q, W_k, mixing, W_cb, scale=None):
    """Per-head scores before masking, written head by head.

    Args:
        x_from: [B, T, C] query-side inputs.
        x_to: [B, S, Ck] key-side inputs.
        W_q: [C, D̃] shared query projection.
        W_k: [Ck, D̃] shared key projection.
        mixing: [H, D̃] mixing vectors, row h is m_h.
        W_cb: [Ck, H] content-bias projection.
        scale: score multiplier (default 1 / sqrt(D̃ / H)).

    Returns:
        scores [B, H, T, S] = scale * (Q diag(m_h) Kᵀ + cb[:, h] broadcast over queries).
    """
    x_from, x_to, W_q, W_k, mixing, W_cb = (
        np.asarray(a, dtype=np.float64) for a in (x_from, x_to, W_q, W_k, mixing, W_cb)
    )
    H, Dt = mixing.shape
    if scale is None:
        scale = 1.0 / math.sqrt(Dt / H)
    Q = x_from @ W_q  # (B, T, D̃)
    K = x_to @ W_k  # (B, S, D̃)
    cb = x_to @ W_cb  # (B, S, H)
    B, T, _ = Q.shape
    S = K.shape[1]
    scores = np.zeros((B, H, T, S))
    for h in range(H):
        Qh = Q * mixing[h]  # (B, T, D̃): Q diag(m_h)
        content = np.einsum("btc,bsc->bts", Qh, K)  # (B, T, S)
        scores[:, h] = scale * (content + cb[:, None, :, h])
    return scores


def collaborative_attention(
    x_from,
    x_to,
    W_q,
    W_k,
    mixing,
    W_cb,
    W_v,
    b_v=None,
    W_o=None,
    b_o=None,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
    scale=None,
    return_weights=False,
):
    """Collaborative multi-head attention (scores above, values as in MHA).

    Masking follows :func:`multihead.reference.attention`: a bool mask says
    "may attend" (True), a float mask is added to the scaled scores (-inf
    hides), causality is AND-ed in; hidden positions are removed with
    ``np.where`` so their inputs (NaN included) cannot reach the output, and
    a query with nothing visible gets output 0 and weights 0.

    Args:
        x_from: [B, T, C]; x_to: [B, S, Ck] (pass x_from for self-attention).
        W_q, W_k, mixing, W_cb, scale: see :func:`collaborative_scores`.
        W_v: [Cv, H*Dv] value projection (applied to x_to), b_v: [H*Dv] or None.
        W_o: [H*Dv, C_out] output projection or None (return the concatenated
            heads), b_o: [C_out] or None.
        mask: None, bool or float, shape [T, S] or 4-D broadcastable to [B, H, T, S].
        is_causal, causal_alignment: causal mask ("top_left" / "bottom_right").
        return_weights: also return the weights P [B, H, T, S].

    Returns:
        out [B, T, C_out] (or [B, T, H*Dv] without W_o), or (out, P).
    """
    x_to = np.asarray(x_to, dtype=np.float64)
    W_v = np.asarray(W_v, dtype=np.float64)
    H = np.asarray(mixing).shape[0]
    scores = collaborative_scores(x_from, x_to, W_q, W_k, mixing, W_cb, scale)
    B, _, T, S = scores.shape
    allowed = np.ones((B, H, T, S), dtype=bool)
    if mask is not None:
        mask = _check_mask(mask, B, H, T, S)
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            allowed &= ~np.isneginf(mask)
            with np.errstate(invalid="ignore"):
                scores = scores + np.where(allowed, mask, 0.0)
    if is_causal:
        allowed &= causal_mask(T, S, causal_alignment)

    V = x_to @ W_v  # (B, S, H*Dv)
    if b_v is not None:
        V = V + np.asarray(b_v, dtype=np.float64)
    Dv = V.shape[-1] // H
    V = V.reshape(B, S, H, Dv).transpose(0, 2, 1, 3)  # (B, S, H*Dv) -> (B, H, S, Dv)

    P = np.zeros((B, H, T, S))
    O = np.zeros((B, H, T, Dv))
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            for h in range(H):
                for i in range(T):
                    keep = allowed[b, h, i]  # (S,)
                    if not keep.any():
                        continue  # nothing visible: zeros
                    s = scores[b, h, i, keep]
                    e = np.exp(s - s.max())
                    P[b, h, i, keep] = e / e.sum()
                    O[b, h, i] = P[b, h, i, keep] @ V[b, h, keep]
    out = O.transpose(0, 2, 1, 3).reshape(B, T, H * Dv)  # (B, H, T, Dv) -> (B, T, H*Dv)
    if W_o is not None:
        out = out @ np.asarray(W_o, dtype=np.float64)
        if b_o is not None:
            out = out + np.asarray(b_o, dtype=np.float64)
    return (out, P) if return_weights else out
