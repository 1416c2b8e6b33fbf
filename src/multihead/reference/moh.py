"""Mixture-of-Head attention (MoH) in NumPy float64: the specification.

Peng Jin, Bo Zhu, Li Yuan, Shuicheng Yan, "MoH: Multi-Head Attention as
Mixture-of-Head Attention", arXiv:2410.11842 (2024). Every head is an
ordinary attention head; per token, a router weights each head's output
(zero for routed heads the token did not choose) before the output
projection::

    y[n] = W_o · concat_h( g[n, h] · o_h[n] ) + b_o

Notation (the paper's and the official code's): H heads, d head dim, C model
dim, hs shared heads (always active, heads 0..hs-1), hr routed heads chosen
per token (top-k) from the E = H - hs routed candidates (heads hs..H-1).
Loops are over tokens and heads, for reading, not speed.
"""

import numpy as np

from .attention import attention

__all__ = [
    "moh_learned_gates",
    "moh_query_norm_gates",
    "moh_load_balancing_loss",
    "moh_attention",
]


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _top(p, k):
    """Indices of the k largest entries of the vector p (largest first)."""
    return list(np.argsort(-p, kind="stable")[:k])


def moh_learned_gates(x, W_g, W_g0, W_g1, shared_heads, routed_heads):
    """Per-token head gates of the learned router (MoH-DiT / MoH-ViT).

    For one token x (length C), with E = H - hs::

        p      = softmax(W_g x)                          (E router probabilities)
        S      = top-hr indices of p
        g_r[e] = hr · p[e] · 1[e in S] / max(sum_{e' in S} p[e'], eps)
        g_s    = hs · softmax(W_g1 x)   (hs > 1),   [1]   (hs = 1)
        w      = 2 · softmax(W_g0 x)                     (hs > 0 and hr > 0)
        gates  = [w0 · g_s, w1 · g_r]   (hs > 0),   g_r   (hs = 0)

    With hr = 0 every head is shared (hs = H) and gates = g_s. eps is the
    machine epsilon of float64.

    Args:
        x: [B, N, C] tokens.
        W_g: [E, C] routed-head logits (None when hr = 0).
        W_g0: [2, C] shared-vs-routed logits (None unless hs > 0 and hr > 0).
        W_g1: [hs, C] shared-head logits (None unless hs > 1).
        shared_heads: hs; routed_heads: hr.

    Returns:
        (gates [B, N, H], p [B, N, E] or None, selected [B, N, E] bool or None);
        ``p`` and ``selected`` are None when hr = 0.
    """
    x = np.asarray(x, dtype=np.float64)
    B, N, _ = x.shape
    hs, hr = shared_heads, routed_heads
    eps = np.finfo(np.float64).eps
    E = 0 if W_g is None else np.asarray(W_g).shape[0]
    H = hs + E
    gates = np.zeros((B, N, H))
    p_all = np.zeros((B, N, E)) if hr > 0 else None
    sel_all = np.zeros((B, N, E), dtype=bool) if hr > 0 else None
    for b in range(B):
        for n in range(N):
            xt = x[b, n]
            if hs > 1:
                g_s = hs * _softmax(np.asarray(W_g1) @ xt)
            else:
                g_s = np.ones(hs)
            if hr == 0:
                gates[b, n] = g_s
                continue
            p = _softmax(np.asarray(W_g) @ xt)
            chosen = _top(p, hr)
            denom = max(p[chosen].sum(), eps)
            g_r = np.zeros(E)
            g_r[chosen] = hr * p[chosen] / denom
            p_all[b, n] = p
            sel_all[b, n, chosen] = True
            if hs > 0:
                w = 2 * _softmax(np.asarray(W_g0) @ xt)
                gates[b, n] = np.concatenate([w[0] * g_s, w[1] * g_r])
            else:
                gates[b, n] = g_r
    return gates, p_all, sel_all


def moh_query_norm_gates(q, shared_heads, routed_heads):
    """Binary gates of the parameter-free MoH-LLaMA3 router.

    For one token with per-head queries Q_h (before any rotary embedding)::

        n_e = ||Q_{hs+e}||_2                  (e = 0..E-1)
        z   = n / std(n, ddof=1)              (n itself when that std is 0)
        S   = top-hr indices of softmax(z)
        gates = [1 (hs times), onehot(S)]

    Softmax and division by a positive number are monotone, so S is the hr
    routed heads with the largest query norms.

    Args:
        q: [B, H, N, d] projected queries.

    Returns:
        (gates [B, N, H] of 0/1, selected [B, N, E] bool).
    """
    q = np.asarray(q, dtype=np.float64)
    B, H, N, _ = q.shape
    hs, hr = shared_heads, routed_heads
    E = H - hs
    gates = np.zeros((B, N, H))
    selected = np.zeros((B, N, E), dtype=bool)
    for b in range(B):
        for n in range(N):
            norms = np.array([np.sqrt(np.sum(q[b, hs + e, n] ** 2)) for e in range(E)])
            sigma = norms.std(ddof=1) if E > 1 else 0.0
            z = norms / sigma if sigma > 0 else norms
            chosen = _top(_softmax(z), hr) if E else []
            gates[b, n, :hs] = 1.0
            for e in chosen:
                gates[b, n, hs + e] = 1.0
                selected[b, n, e] = True
    return gates, selected


def moh_load_balancing_loss(p, selected):
    """The load-balance term of one layer.

    me_e = mean over the B·N tokens of p[:, e]; ce_e = the fraction of tokens
    that chose routed head e; l_aux = E · sum_e me_e · ce_e (1 when perfectly
    balanced). Training adds coefficient · (mean over layers of l_aux).

    Args:
        p: [B, N, E] router probabilities; selected: [B, N, E] bool.

    Returns:
        l_aux, a float.
    """
    p = np.asarray(p, dtype=np.float64)
    E = p.shape[-1]
    me = p.reshape(-1, E).mean(axis=0)
    ce = np.asarray(selected, dtype=np.float64).reshape(-1, E).mean(axis=0)
    return float(E * np.sum(me * ce))


def moh_attention(
    x,
    W_qkv,
    b_qkv,
    W_o,
    b_o,
    num_heads,
    shared_heads,
    routed_heads,
    *,
    W_g=None,
    W_g0=None,
    W_g1=None,
    router="learned",
    num_kv_heads=None,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
    return_weights=False,
):
    """MoH self-attention of tokens x: gated heads through the output projection.

    [q | k | v] = x W_qkvᵀ + b_qkv, head-major blocks of H, G, G heads of
    width d; o_h = softmax(q_h k_gᵀ / sqrt(d), masked) v_g with g the
    key/value head of query head h (see :func:`..attention.attention`);
    gates from :func:`moh_learned_gates` or :func:`moh_query_norm_gates`;
    y = W_o concat_h(gates[..., h] · o_h) + b_o.

    The weights that mix the values are gates[b, t, h] · A_h[b, t, s]: the
    softmax probabilities of head h scaled by that token's gate (rows of
    unselected routed heads are 0).

    Args:
        x: [B, N, C]; W_qkv: [(H + 2G)·d, C]; b_qkv: [(H + 2G)·d] or None;
        W_o: [C, H·d]; b_o: [C] or None.
        num_heads: H; shared_heads: hs; routed_heads: hr.
        W_g, W_g0, W_g1: the learned router (``router="learned"``).
        router: "learned" or "query_norm".
        num_kv_heads: G (default H).
        mask, is_causal, causal_alignment: as :func:`..attention.attention`.
        return_weights: also return the gated weights [B, H, N, N].

    Returns:
        y [B, N, C], or (y, weights).
    """
    x = np.asarray(x, dtype=np.float64)
    B, N, _ = x.shape
    H = num_heads
    G = H if num_kv_heads is None else num_kv_heads
    d = np.asarray(W_qkv).shape[0] // (H + 2 * G)
    qkv = x @ np.asarray(W_qkv, dtype=np.float64).T
    if b_qkv is not None:
        qkv = qkv + b_qkv
    q = qkv[..., : H * d].reshape(B, N, H, d).transpose(0, 2, 1, 3)  # (B, N, H·d) -> (B, H, N, d)
    k = qkv[..., H * d : (H + G) * d].reshape(B, N, G, d).transpose(0, 2, 1, 3)  # -> (B, G, N, d)
    v = qkv[..., (H + G) * d :].reshape(B, N, G, d).transpose(0, 2, 1, 3)  # -> (B, G, N, d)
    if router == "learned":
        gates, _, _ = moh_learned_gates(x, W_g, W_g0, W_g1, shared_heads, routed_heads)
    else:
        gates, _ = moh_query_norm_gates(q, shared_heads, routed_heads)
    o, A = attention(
        q, k, v, mask=mask, is_causal=is_causal, causal_alignment=causal_alignment, return_weights=True
    )  # (B, H, N, d), (B, H, N, N)
    mixed = np.zeros((B, N, H * d))
    weights = np.zeros_like(A)
    for b in range(B):
        for n in range(N):
            for h in range(H):
                mixed[b, n, h * d : (h + 1) * d] = gates[b, n, h] * o[b, h, n]
                weights[b, h, n] = gates[b, n, h] * A[b, h, n]
    y = mixed @ np.asarray(W_o, dtype=np.float64).T
    if b_o is not None:
        y = y + b_o
    return (y, weights) if return_weights else y
