"""Differential attention V1 and V2 in NumPy float64: the specification.

V1: Ye, Dong, Xia, Sun, Zhu, Huang, Wei, "Differential Transformer"
(ICLR 2025, arXiv:2410.05258; code microsoft/unilm ``Diff-Transformer``,
``MultiheadDiffAttn``). Head i splits its query and key into two halves
of width d and subtracts the second softmax map from the first::

    [Q1; Q2] = X W_Q,  [K1; K2] = X W_K,  V = X W_V                (V is 2d wide)
    DiffAttn(X) = (softmax(Q1 K1ᵀ / sqrt(d)) - λ softmax(Q2 K2ᵀ / sqrt(d))) V
    λ = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init
    λ_init = 0.8 - 0.6 · exp(-0.3 · (l - 1))     layer l = 1 .. L (``depth`` = l - 1)
    head_i = (1 - λ_init) · LN(DiffAttn_i(X))    LN: RMSNorm over 2d, eps 1e-5, no gain
    MultiHead(X) = Concat(head_1 .. head_h) W_O

With G key/value heads (GQA) the sub-heads share keys as the official
``repeat_kv`` does: query sub-head j (head j // 2) reads key sub-head
j // (h / G), head i reads value head i // (h / G).

V2 (microsoft/unilm ``Diff-Transformer-V2``, ``MultiheadFlashDiffV2``): 2h
query heads of width d over G key/value heads (query head j reads j // (2h / G));
with o_j = softmax(q_j K_{g(j)}ᵀ / sqrt(d)) V_{g(j)}::

    u_i = o_{2i} - sigmoid(λ_i(x)) · o_{2i+1},   λ(x) = x W_λᵀ  (one value per token and head)
    MultiHead(X) = Concat(u_1 .. u_h) W_O

Everything here is float64 and written for reading, not speed: a loop over
heads, each softmax map formed on its own.
"""

import math

import numpy as np

from multihead.reference.attention import attention


def lambda_init(depth):
    """λ_init of the layer at ``depth`` = l - 1 (0 for the first layer)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def diff_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lam_init):
    """λ = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init (a float); the vectors are [d]."""
    dot1 = float(np.sum(np.asarray(lambda_q1, np.float64) * np.asarray(lambda_k1, np.float64)))
    dot2 = float(np.sum(np.asarray(lambda_q2, np.float64) * np.asarray(lambda_k2, np.float64)))
    return math.exp(dot1) - math.exp(dot2) + lam_init


def rms_norm(x, eps):
    """x / sqrt(mean(x², last axis) + eps), no gain."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def _softmax_map(q, k, mask, head, is_causal):
    """softmax(q kᵀ / sqrt(d)) [B, T, S] of one query head q [B, T, d] over keys k [B, S, d],
    with head ``head``'s rows of ``mask`` (masked keys get weight 0)."""
    if mask is not None and np.ndim(mask) == 4 and np.shape(mask)[1] > 1:
        mask = np.asarray(mask)[:, head : head + 1]  # (B, H, T, S) -> (B, 1, T, S)
    v = np.zeros(k.shape[:2] + (1,))  # the weights alone are needed
    _, w = attention(q[:, None], k[:, None], v[:, None], mask=mask, is_causal=is_causal, return_weights=True)
    return w[:, 0]


def differential_attention(q, k, v, lam, lam_init, mask=None, is_causal=False, eps=1e-5):
    """V1 heads before W_O.

    Args:
        q: [B, 2h, T, d] query sub-heads (2i, 2i+1 of head i).
        k: [B, 2G, S, d] key sub-heads; v: [B, G, S, 2d] value heads.
        lam: λ (a float); lam_init: λ_init.
        mask: bool (True = may attend) or float, (T, S) or (B|1, h|1, T, S).
        is_causal: hide keys after each query (top-left).
        eps: of the RMSNorm.

    Returns:
        (heads [B, h, T, 2d] = (1 - λ_init) LN((A1 - λ A2) V),
         weights [B, h, T, S] = A1 - λ A2).
    """
    h, G = q.shape[1] // 2, v.shape[1]
    n_rep = h // G
    heads, weights = [], []
    for i in range(h):
        a1 = _softmax_map(q[:, 2 * i], k[:, (2 * i) // n_rep], mask, i, is_causal)
        a2 = _softmax_map(q[:, 2 * i + 1], k[:, (2 * i + 1) // n_rep], mask, i, is_causal)
        w = a1 - lam * a2
        weights.append(w)
        heads.append((1 - lam_init) * rms_norm(w @ v[:, i // n_rep], eps))  # (B, T, S) @ (B, S, 2d)
    return np.stack(heads, axis=1), np.stack(weights, axis=1)


def differential_v2_attention(q, k, v, lam_logits, mask=None, is_causal=False):
    """V2 heads before W_O.

    Args:
        q: [B, 2h, T, d] query heads; k, v: [B, G, S, d], G dividing 2h.
        lam_logits: [B, T, h] λ(x) = x W_λᵀ of the queries' inputs.
        mask, is_causal: as :func:`differential_attention`.

    Returns:
        (heads [B, h, T, d] = u_i, weights [B, h, T, S] = A_2i - sigmoid(λ_i) A_2i+1).
    """
    h2, G = q.shape[1], k.shape[1]
    per_kv = h2 // G
    sig = 0.5 * (1.0 + np.tanh(0.5 * np.asarray(lam_logits, np.float64)))  # sigmoid, (B, T, h), overflow-free
    heads, weights = [], []
    for i in range(h2 // 2):
        j1, j2 = 2 * i, 2 * i + 1
        a1 = _softmax_map(q[:, j1], k[:, j1 // per_kv], mask, i, is_causal)
        a2 = _softmax_map(q[:, j2], k[:, j2 // per_kv], mask, i, is_causal)
        s = sig[:, :, i, None]  # (B, T, 1)
        weights.append(a1 - s * a2)
        heads.append(a1 @ v[:, j1 // per_kv] - s * (a2 @ v[:, j2 // per_kv]))  # (B, T, d)
    return np.stack(heads, axis=1), np.stack(weights, axis=1)
