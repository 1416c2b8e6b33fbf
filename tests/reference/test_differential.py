"""The NumPy differential attention references (V1, V2) against vectorised einsum forms,
plain attention in their limiting cases, and key sharing written out as repeated heads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference import attention
from multihead.reference.differential import (
    diff_lambda,
    differential_attention,
    differential_v2_attention,
    lambda_init,
    rms_norm,
)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _causal_softmax(scores):
    T, S = scores.shape[-2:]
    s = np.where(np.tril(np.ones((T, S), dtype=bool)), scores, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_lambda_init_by_depth_and_lambda_formula():
    assert lambda_init(0) == pytest.approx(0.2, abs=1e-15)
    assert lambda_init(1) == pytest.approx(0.8 - 0.6 * math.exp(-0.3), abs=1e-15)
    assert lambda_init(200) == pytest.approx(0.8, abs=1e-15)
    z = np.zeros(4)
    assert diff_lambda(z, z, z, z, 0.35) == pytest.approx(0.35, abs=1e-15)  # exp(0) - exp(0) + λ_init
    a, b = np.array([1.0, 2.0]), np.array([0.5, -0.25])
    assert diff_lambda(a, b, b, b, 0.2) == pytest.approx(math.exp(0.0) - math.exp(0.3125) + 0.2, abs=1e-15)


@pytest.mark.parametrize("H,G", [(3, 3), (4, 2), (4, 1)])
def test_v1_equals_the_einsum_form_with_repeat_kv(H, G):
    rng = _rng(1)
    B, T, d = 2, 5, 3
    q = rng.standard_normal((B, 2 * H, T, d))
    k = rng.standard_normal((B, 2 * G, T, d))
    v = rng.standard_normal((B, G, T, 2 * d))
    lam, lam0 = 0.37, lambda_init(2)
    heads, w = differential_attention(q, k, v, lam, lam0, is_causal=True)
    n_rep = H // G
    kr, vr = np.repeat(k, n_rep, axis=1), np.repeat(v, n_rep, axis=1)  # repeat_kv: each head n_rep times in place
    A = _causal_softmax(np.einsum("bjtd,bjsd->bjts", q, kr) / math.sqrt(d)).reshape(B, H, 2, T, T)
    W = A[:, :, 0] - lam * A[:, :, 1]
    want = (1 - lam0) * rms_norm(np.einsum("bhts,bhsd->bhtd", W, vr), 1e-5)
    np.testing.assert_allclose(w, W, rtol=0, atol=1e-14)
    np.testing.assert_allclose(heads, want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(w.sum(-1), np.full((B, H, T), 1 - lam), rtol=0, atol=1e-14)  # rows sum to 1 - λ


def test_v1_limits_plain_attention_and_cancelling_halves():
    rng = _rng(2)
    B, H, T, d = 1, 2, 4, 2
    q = rng.standard_normal((B, 2 * H, T, d))
    k = rng.standard_normal((B, 2 * H, T, d))
    v = rng.standard_normal((B, H, T, 2 * d))
    heads, _ = differential_attention(q, k, v, 0.0, 0.2)  # λ = 0: the first map alone
    plain = attention(q[:, 0::2], k[:, 0::2], v)
    np.testing.assert_allclose(heads, 0.8 * rms_norm(plain, 1e-5), rtol=0, atol=1e-13)
    same_q, same_k = np.repeat(q[:, 0::2], 2, axis=1), np.repeat(k[:, 0::2], 2, axis=1)
    heads, w = differential_attention(same_q, same_k, v, 1.0, 0.2)  # identical halves, λ = 1: nothing left
    assert np.abs(w).max() < 1e-15 and np.abs(heads).max() < 1e-6


def test_v1_per_head_mask_hides_keys_from_both_halves_of_its_head():
    rng = _rng(3)
    B, H, T, d = 1, 2, 4, 2
    q, k = rng.standard_normal((B, 2 * H, T, d)), rng.standard_normal((B, 2 * H, T, d))
    v = rng.standard_normal((B, H, T, 2 * d))
    mask = np.ones((1, H, T, T), dtype=bool)
    mask[0, 1, :, 2] = False  # head 1 may not see key 2
    _, w = differential_attention(q, k, v, 0.5, 0.2, mask=mask)
    assert (w[0, 1, :, 2] == 0).all() and (w[0, 0, :, 2] != 0).all()


@pytest.mark.parametrize("H,G", [(3, 3), (3, 2), (3, 6), (2, 1)])
def test_v2_equals_the_einsum_form_and_its_query_head_to_key_rule(H, G):
    """(3, 2): query heads 0 1 2 | 3 4 5 read kv 0 | 1, so pair 1 (heads 2, 3) reads both."""
    rng = _rng(4)
    B, T, d = 2, 5, 3
    q = rng.standard_normal((B, 2 * H, T, d))
    k, v = rng.standard_normal((B, G, T, d)), rng.standard_normal((B, G, T, d))
    lam = rng.standard_normal((B, T, H))
    heads, w = differential_v2_attention(q, k, v, lam, is_causal=True)
    r = 2 * H // G
    kr, vr = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)  # query head j reads kv j // r
    A = _causal_softmax(np.einsum("bjtd,bjsd->bjts", q, kr) / math.sqrt(d))
    O = np.einsum("bjts,bjsd->bjtd", A, vr)
    s = (1 / (1 + np.exp(-lam))).transpose(0, 2, 1)[..., None]  # (B, H, T, 1)
    np.testing.assert_allclose(heads, O[:, 0::2] - s * O[:, 1::2], rtol=0, atol=1e-14)
    np.testing.assert_allclose(w, A[:, 0::2] - s * A[:, 1::2], rtol=0, atol=1e-14)
    np.testing.assert_allclose(w.sum(-1), 1 - s[..., 0], rtol=0, atol=1e-14)


def test_v2_large_negative_lambda_is_plain_attention_of_the_even_heads():
    rng = _rng(5)
    B, H, G, T, d = 1, 2, 2, 4, 3
    q = rng.standard_normal((B, 2 * H, T, d))
    k, v = rng.standard_normal((B, G, T, d)), rng.standard_normal((B, G, T, d))
    heads, _ = differential_v2_attention(q, k, v, np.full((B, T, H), -800.0))  # sigmoid(-800) = 0 in float64
    np.testing.assert_allclose(heads, attention(q[:, 0::2], k, v), rtol=0, atol=1e-14)
