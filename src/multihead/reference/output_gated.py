"""Output-gated attention (Qiu et al. 2025, arXiv:2505.06708) in NumPy float64: the specification.

Qiu, Wang, Zheng, et al., "Gated Attention for Large Language Models:
Non-linearity, Sparsity, and Attention-Sink-Free" (code
``qiuzh20/gated_attention``; the full-attention layers of Qwen3-Next). The
paper's gate at position G1, after scaled dot-product attention and before
the output projection::

    Q = X W_Q,  K = X_kv W_K,  V = X_kv W_V                  (per head h, group g(h))
    Y_h  = softmax(Q_h K_g^T / sqrt(d_k) + mask) V_g          (n_q, d_k)
    Y'_h = Y_h ⊙ σ(X W_θ)_h                                  σ = sigmoid
    O    = concat(Y'_1, ..., Y'_H) W_O + b_O

with W_θ of d_model × H columns (headwise: one score per head, broadcast
over its d_k channels) or d_model × H·d_k columns (elementwise: one per
channel). Query head h reads key/value head g(h) = h // (H / G). The gate
depends on the query token only, so it changes nothing about which keys a
query sees; it scales what attention produced.

Matrices act on row vectors (X W), as in the paper. Everything here is
float64 and written for reading, not speed.
"""

import numpy as np

from multihead.reference.attention import attention

__all__ = ["sigmoid", "output_gate", "output_gated_attention"]


def sigmoid(x):
    """σ(x) = 1 / (1 + e^-x), overflow-free."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def output_gate(Y, X, W_theta, b_theta=None):
    """Y' = Y ⊙ σ(X W_θ + b_θ), head by head.

    Args:
        Y: [B, H, T, d] attention outputs of the H heads.
        X: [B, T, d_model] the queries' input (the gate's input).
        W_theta: [d_model, H] (headwise) or [d_model, H·d] (elementwise);
            column h (headwise) or h·d + i (elementwise) gates head h.
        b_theta: [H] or [H·d], or None.

    Returns:
        Y' [B, H, T, d].
    """
    Y, X, W_theta = (np.asarray(a, dtype=np.float64) for a in (Y, X, W_theta))
    B, H, T, d = Y.shape
    logits = X @ W_theta + (0.0 if b_theta is None else np.asarray(b_theta, dtype=np.float64))  # (B, T, H*E)
    E = logits.shape[-1] // H
    if E not in (1, d) or E * H != logits.shape[-1]:
        raise ValueError(f"W_theta must have H = {H} or H·d = {H * d} columns, got {logits.shape[-1]}")
    gate = sigmoid(logits.reshape(B, T, H, E).transpose(0, 2, 1, 3))  # (B, T, H*E) -> (B, H, T, E)
    return Y * gate


def output_gated_attention(
    X, W_Q, W_K, W_V, W_theta, W_O, *, num_heads, num_kv_heads=None, X_kv=None, b_Q=None, b_K=None, b_V=None,
    b_theta=None, b_O=None, mask=None, is_causal=False, scale=None,
):
    """The output-gated attention layer (position G1).

    Args:
        X: [B, T, d_model] queries' input; X_kv: [B, S, d_model] keys' and
            values' input (None: X, self-attention).
        W_Q: [d_model, H·d]; W_K, W_V: [d_model, G·d]; W_theta: [d_model, H]
            or [d_model, H·d]; W_O: [H·d, d_model]; b_*: biases or None.
        num_heads: H; num_kv_heads: G (None: H), dividing H.
        mask: bool (True = may attend) or float (added), [T, S] or 4-D
            broadcastable to (B, H, T, S); is_causal: hide future keys.
        scale: the score multiplier (None: 1/sqrt(d)).

    Returns:
        (O [B, T, d_model], P [B, H, T, S]): the output and the softmax
        probabilities that mix the values (before the gate).
    """
    X = np.asarray(X, dtype=np.float64)
    X_kv = X if X_kv is None else np.asarray(X_kv, dtype=np.float64)
    H = num_heads
    G = H if num_kv_heads is None else num_kv_heads

    def heads(Z, W, b, n):  # (B, L, d_model) -> (B, n, L, d)
        Y = Z @ np.asarray(W, dtype=np.float64) + (0.0 if b is None else np.asarray(b, dtype=np.float64))
        B, L, w = Y.shape
        return Y.reshape(B, L, n, w // n).transpose(0, 2, 1, 3)

    Q, K, V = heads(X, W_Q, b_Q, H), heads(X_kv, W_K, b_K, G), heads(X_kv, W_V, b_V, G)
    Y, P = attention(Q, K, V, mask=mask, is_causal=is_causal, scale=scale, return_weights=True)
    Y = output_gate(Y, X, W_theta, b_theta)
    B, _, T, d = Y.shape
    O = Y.transpose(0, 2, 1, 3).reshape(B, T, H * d) @ np.asarray(W_O, dtype=np.float64)  # concat heads
    return (O if b_O is None else O + np.asarray(b_O, dtype=np.float64)), P
