"""The output-gated attention reference (Qiu et al. 2025, position G1) against
loops over batch, head and query written from the paper's equations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference.attention import attention
from multihead.reference.output_gated import output_gate, output_gated_attention, sigmoid

C, H, D = 10, 4, 5


def weights(rng, *, G, headwise, bias=True):
    E = 1 if headwise else D
    w = {"W_Q": rng.normal(size=(C, H * D)), "W_K": rng.normal(size=(C, G * D)), "W_V": rng.normal(size=(C, G * D)),
         "W_theta": rng.normal(size=(C, H * E)), "W_O": rng.normal(size=(H * D, C))}  # fmt: skip
    if bias:
        w.update(b_Q=rng.normal(size=H * D), b_K=rng.normal(size=G * D), b_V=rng.normal(size=G * D),
                 b_theta=rng.normal(size=H * E), b_O=rng.normal(size=C))  # fmt: skip
    return w


def loops(X, X_kv, w, *, G, headwise, allowed):
    """Token by token, head by head: y_h(t) = Σ_s p_s v_s, times σ(x_t W_θ + b_θ) of head h."""
    B, T, _ = X.shape
    S = X_kv.shape[1]
    b = {n: w.get(n, 0.0) for n in ("b_Q", "b_K", "b_V", "b_theta", "b_O")}
    out = np.zeros((B, T, C))
    for i in range(B):
        for t in range(T):
            concat = []
            for h in range(H):
                g = h // (H // G)
                q = (X[i, t] @ w["W_Q"] + b["b_Q"])[h * D : (h + 1) * D]
                scores = []
                for s in range(S):
                    k = (X_kv[i, s] @ w["W_K"] + b["b_K"])[g * D : (g + 1) * D]
                    scores.append(q @ k / math.sqrt(D) if allowed[t, s] else -math.inf)
                top = max(scores)
                e = [math.exp(z - top) if z > -math.inf else 0.0 for z in scores]
                y = sum(e[s] / sum(e) * (X_kv[i, s] @ w["W_V"] + b["b_V"])[g * D : (g + 1) * D] for s in range(S))
                logits = X[i, t] @ w["W_theta"] + b["b_theta"]
                gate = 1 / (1 + math.exp(-logits[h])) if headwise else 1 / (1 + np.exp(-logits[h * D : (h + 1) * D]))
                concat.append(y * gate)
            out[i, t] = np.concatenate(concat) @ w["W_O"] + b["b_O"]
    return out


@pytest.mark.parametrize("G", [H, 2, 1])
@pytest.mark.parametrize("headwise", [True, False])
def test_matches_loops_causal_self_attention(headwise, G):
    rng = np.random.default_rng(0)
    w = weights(rng, G=G, headwise=headwise)
    X = rng.normal(size=(2, 7, C))
    got, P = output_gated_attention(X, num_heads=H, num_kv_heads=G, is_causal=True, **w)
    want = loops(X, X, w, G=G, headwise=headwise, allowed=np.tri(7, dtype=bool))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert P.shape == (2, H, 7, 7)
    np.testing.assert_allclose(P.sum(-1), 1.0, atol=1e-12)  # the softmax, ungated


@pytest.mark.parametrize("headwise", [True, False])
def test_matches_loops_cross_attention_with_a_mask(headwise):
    rng = np.random.default_rng(1)
    w = weights(rng, G=2, headwise=headwise, bias=False)
    X, X_kv = rng.normal(size=(2, 3, C)), rng.normal(size=(2, 6, C))
    allowed = rng.random((3, 6)) > 0.3
    allowed[:, 0] = True
    got, _ = output_gated_attention(X, num_heads=H, num_kv_heads=2, X_kv=X_kv, mask=allowed, **w)
    np.testing.assert_allclose(got, loops(X, X_kv, w, G=2, headwise=headwise, allowed=allowed), rtol=0, atol=1e-12)


def test_headwise_is_elementwise_with_each_heads_column_repeated():
    rng = np.random.default_rng(2)
    w = weights(rng, G=2, headwise=True)
    X = rng.normal(size=(1, 5, C))
    wide = dict(w, W_theta=np.repeat(w["W_theta"], D, axis=1), b_theta=np.repeat(w["b_theta"], D))
    a, _ = output_gated_attention(X, num_heads=H, num_kv_heads=2, is_causal=True, **w)
    b, _ = output_gated_attention(X, num_heads=H, num_kv_heads=2, is_causal=True, **wide)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_open_gates_give_plain_attention_and_closed_gates_the_output_bias():
    rng = np.random.default_rng(3)
    w = weights(rng, G=H, headwise=False)
    X = rng.normal(size=(2, 4, C))
    Q, K, V = ((X @ w[f"W_{n}"] + w[f"b_{n}"]).reshape(2, 4, H, D).transpose(0, 2, 1, 3) for n in "QKV")
    Y = attention(Q, K, V, is_causal=True)
    plain = Y.transpose(0, 2, 1, 3).reshape(2, 4, H * D) @ w["W_O"] + w["b_O"]
    opened, _ = output_gated_attention(X, num_heads=H, is_causal=True, **dict(w, W_theta=0 * w["W_theta"],
                                                                              b_theta=np.full(H * D, 50.0)))
    np.testing.assert_allclose(opened, plain, rtol=0, atol=1e-12)  # σ(50) = 1 - 2e-22
    closed, _ = output_gated_attention(X, num_heads=H, is_causal=True, **dict(w, W_theta=0 * w["W_theta"],
                                                                              b_theta=np.full(H * D, -800.0)))
    np.testing.assert_allclose(closed, np.broadcast_to(w["b_O"], closed.shape), rtol=0, atol=1e-12)


def test_gate_helpers():
    assert sigmoid(0.0) == 0.5 and sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0  # no overflow warning
    with pytest.raises(ValueError, match=r"W_theta must have H = 4 or H·d = 20 columns, got 8"):
        output_gate(np.zeros((1, H, 2, D)), np.zeros((1, 2, C)), np.zeros((C, 8)))
