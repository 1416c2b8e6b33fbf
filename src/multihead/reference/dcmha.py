"""DCMHA and Talking-Heads attention in NumPy float64: the specification.

Dynamically composable multi-head attention (Xiao et al., ICML 2024,
"Improving Transformers with Dynamically Composable Multi-Head Attention")
mixes the N per-head scores of every (query t, key s) pair across heads,
once on the scaled logits before the softmax and once on the probabilities
after it. For a tensor A[n, t, s] the composition ("Compose") is::

    A'[:, t, s] = A[:, t, s] @ M[t, s]          (a row vector over heads)
    M[t, s] = I + W_static + diag(qdd_t + kdd_s) + qw1_tᵀ qw2_t + kw1_sᵀ kw2_s

with query-side weights taken at the query token t and key-side weights at
the key token s. The dynamic weights come from the token states x by
:func:`dynamic_weights`. Talking-Heads attention (Shazeer et al., 2020) is
the static special case: M = P_l before the softmax and M = P_w after it,
without the identity.

The pipeline, for logits S[n, t, s] = (q_{n,t} / sqrt(d)) · k_{n,s}::

    L  = Compose_pre(S)            (slots 0 = query-wise, 1 = key-wise)
    L  = L + float mask;  hidden (t, s) removed
    P  = softmax_s(L)              (rows with nothing visible: 0)
    P' = Compose_post(P)           (slots 2 = query-wise, 3 = key-wise)
    P' = 0 where hidden            (a no-op for masks shared by all heads)
    O  = P' · v
"""

import math

import numpy as np

from .attention import causal_mask

__all__ = ["dynamic_weights", "compose", "dcmha_attention", "talking_heads_attention"]


def _gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def dynamic_weights(x, dw1, qkw, dd, slot, eps=1e-6):
    """Dynamic composition weights of one slot for every token.

    For each token x_t (paper Eq. 5-6, DCFormer's DynamicWeightProjection)::

        h   = GELU(x_t · dw1[:, c, :])                 (K,)
        W   = h · qkw[c]                               (2R, N)
        w1  = W[:R] / sqrt(mean_n W[:R]² + eps)        rows RMS-normalised
        w2  = W[R:]
        dd  = tanh(x_t · dd[:, c, :])                  (N,)

    Args:
        x: [B, L, C] token states.
        dw1: [C, 4, K]; qkw: [4, K, 2R, N]; dd: [C, 4, N].
        slot: c in 0..3 (0 pre/query, 1 pre/key, 2 post/query, 3 post/key).

    Returns:
        (w1 [B, L, R, N], w2 [B, L, R, N], dd [B, L, N]).
    """
    x, dw1, qkw, dd = (np.asarray(a, dtype=np.float64) for a in (x, dw1, qkw, dd))
    R = qkw.shape[2] // 2
    h = _gelu(x @ dw1[:, slot, :])  # (B, L, K)
    W = np.einsum("blk,krn->blrn", h, qkw[slot])  # (B, L, 2R, N)
    w1, w2 = W[:, :, :R], W[:, :, R:]
    w1 = w1 / np.sqrt(np.mean(w1**2, axis=-1, keepdims=True) + eps)
    gate = np.tanh(x @ dd[:, slot, :])  # (B, L, N)
    return w1, w2, gate


def compose(A, q_side=None, k_side=None, static=None, residual=True):
    """Compose A [B, N, T, S] across heads, pair by pair.

    M[t, s] = residual·I + static + diag(qdd_t + kdd_s) + qw1_tᵀ qw2_t + kw1_sᵀ kw2_s
    and A'[b, :, t, s] = A[b, :, t, s] @ M[t, s].

    Args:
        A: [B, N, T, S].
        q_side: (w1 [B, T, R, N], w2 [B, T, R, N], dd [B, T, N]) or None.
        k_side: (w1 [B, S, R, N], w2 [B, S, R, N], dd [B, S, N]) or None.
        static: [N, N] or None.
        residual: add the identity.

    Returns:
        [B, N, T, S].
    """
    A = np.asarray(A, dtype=np.float64)
    B, N, T, S = A.shape
    out = np.zeros_like(A)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                M = np.eye(N) if residual else np.zeros((N, N))
                if static is not None:
                    M = M + static
                if q_side is not None:
                    w1, w2, gate = (a[b, t] for a in q_side)
                    M = M + np.diag(gate) + w1.T @ w2
                if k_side is not None:
                    w1, w2, gate = (a[b, s] for a in k_side)
                    M = M + np.diag(gate) + w1.T @ w2
                out[b, :, t, s] = A[b, :, t, s] @ M
    return out


def _visible(mask, B, N, T, S, is_causal, causal_alignment):
    allowed = np.ones((B, N, T, S), dtype=bool)
    bias = np.zeros((B, N, T, S))
    if mask is not None:
        mask = np.asarray(mask)
        mask = mask[None, None] if mask.ndim == 2 else mask
        mask = np.broadcast_to(mask, (B, N, T, S))
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            allowed &= ~np.isneginf(mask)
            bias = np.where(np.isneginf(mask), 0.0, mask)
    if is_causal:
        allowed &= causal_mask(T, S, causal_alignment)
    return allowed, bias


def _attend(q, k, v, pre, post, mask, is_causal, causal_alignment):
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, N, T, D = q.shape
    S = k.shape[2]
    allowed, bias = _visible(mask, B, N, T, S, is_causal, causal_alignment)
    logits = np.einsum("bntd,bnsd->bnts", q / math.sqrt(D), k)  # (B, N, T, S)
    L = pre(logits) + bias
    L = np.where(allowed, L, -np.inf)
    row_max = L.max(axis=-1, keepdims=True) if S else np.zeros((B, N, T, 1))
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = np.where(allowed, np.exp(L - row_max), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    P = np.divide(e, total, out=np.zeros_like(e), where=total != 0)
    P2 = np.where(allowed, post(P), 0.0)
    return np.einsum("bnts,bnsd->bntd", P2, v), P2


def dcmha_attention(
    x_q,
    x_k,
    q,
    k,
    v,
    dw1,
    qkw,
    dd,
    pre_static=None,
    post_static=None,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
):
    """DCMHA core on projected heads; the dynamic weights come from x_q and x_k.

    Args:
        x_q: [B, T, C] query token states; x_k: [B, S, C] key token states.
        q: [B, N, T, d]; k: [B, N, S, d]; v: [B, N, S, dv] (already projected).
        dw1, qkw, dd: dynamic-weight parameters (see :func:`dynamic_weights`).
        pre_static, post_static: [N, N] static composition matrices or None.
        mask: bool (True = may attend) or float (added after pre-Compose),
            [T, S] or 4-D broadcastable to [B, N, T, S].
        is_causal, causal_alignment: as in ``reference.attention``.

    Returns:
        (out [B, N, T, dv], weights [B, N, T, S]): the weights are the
        post-composed probabilities P' that multiply the values.
    """
    qs = [dynamic_weights(x_q, dw1, qkw, dd, c) for c in (0, 2)]
    ks = [dynamic_weights(x_k, dw1, qkw, dd, c) for c in (1, 3)]
    return _attend(
        q,
        k,
        v,
        lambda A: compose(A, qs[0], ks[0], pre_static),
        lambda A: compose(A, qs[1], ks[1], post_static),
        mask,
        is_causal,
        causal_alignment,
    )


def talking_heads_attention(q, k, v, P_l, P_w, mask=None, is_causal=False, causal_alignment="top_left"):
    """Talking-Heads attention: L' = L·P_l across heads, P' = softmax(L')·P_w.

    Args:
        q: [B, N, T, d]; k: [B, N, S, d]; v: [B, N, S, dv].
        P_l, P_w: [N, N] head-mixing matrices (no identity is added).

    Returns:
        (out [B, N, T, dv], weights P' [B, N, T, S]).
    """
    return _attend(
        q,
        k,
        v,
        lambda A: compose(A, static=np.asarray(P_l, dtype=np.float64), residual=False),
        lambda A: compose(A, static=np.asarray(P_w, dtype=np.float64), residual=False),
        mask,
        is_causal,
        causal_alignment,
    )
