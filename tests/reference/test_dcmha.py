"""The NumPy DCMHA / Talking-Heads reference: definitions checked independently."""

from __future__ import annotations

import numpy as np

from multihead.reference import attention
from multihead.reference.dcmha import compose, dcmha_attention, dynamic_weights, talking_heads_attention


def test_compose_equals_the_term_by_term_formula(seed):
    rng = seed
    B, N, T, S, R = 2, 3, 4, 5, 2
    A = rng.standard_normal((B, N, T, S))
    qs = (rng.standard_normal((B, T, R, N)), rng.standard_normal((B, T, R, N)), rng.standard_normal((B, T, N)))
    ks = (rng.standard_normal((B, S, R, N)), rng.standard_normal((B, S, R, N)), rng.standard_normal((B, S, N)))
    W = rng.standard_normal((N, N))
    got = compose(A, qs, ks, W)
    # A'[m] = A[m](1 + qdd[m] + kdd[m]) + Σ_i qw2[i,m] Σ_n qw1[i,n] A[n] + (same for keys) + Σ_n A[n] W[n,m]
    want = A * (1 + qs[2].transpose(0, 2, 1)[:, :, :, None] + ks[2].transpose(0, 2, 1)[:, :, None, :])
    want = want + np.einsum("btim,bits->bmts", qs[1], np.einsum("btin,bnts->bits", qs[0], A))
    want = want + np.einsum("bsim,bits->bmts", ks[1], np.einsum("bsin,bnts->bits", ks[0], A))
    want = want + np.einsum("bnts,nm->bmts", A, W)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_dynamic_weights_normalise_w1_rows_and_bound_gates(seed):
    rng = seed
    x = rng.standard_normal((1, 3, 6))
    w1, w2, dd = dynamic_weights(x, rng.standard_normal((6, 4, 8)), rng.standard_normal((4, 8, 4, 2)),
                                 rng.standard_normal((6, 4, 2)), slot=1)  # fmt: skip
    assert w1.shape == w2.shape == (1, 3, 2, 2) and dd.shape == (1, 3, 2)
    np.testing.assert_allclose(np.mean(w1**2, axis=-1), 1.0, atol=1e-5)
    assert np.all(np.abs(dd) < 1)


def test_identity_talking_heads_is_plain_attention(seed):
    rng = seed
    q, k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 6, 4))
    I = np.eye(3)
    out, w = talking_heads_attention(q, k, v, I, I, is_causal=True, causal_alignment="bottom_right")
    ref_out, ref_w = attention(q, k, v, is_causal=True, causal_alignment="bottom_right", return_weights=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(w, ref_w, atol=1e-12)


def test_dcmha_with_zero_dynamics_is_plain_attention_and_masks_stay_zero(seed):
    rng = seed
    C, N = 6, 2
    x = rng.standard_normal((1, 4, C))
    q, k, v = (rng.standard_normal((1, N, 4, 3)) for _ in range(3))
    zeros = (np.zeros((C, 4, 8)), np.zeros((4, 8, 4, N)), np.zeros((C, 4, N)))
    out, w = dcmha_attention(x, x, q, k, v, *zeros, is_causal=True)
    np.testing.assert_allclose(out, attention(q, k, v, is_causal=True), atol=1e-12)
    # with dynamics, the hidden (future) entries stay exactly 0 and rows are not renormalised
    dyn = (rng.standard_normal((C, 4, 8)), rng.standard_normal((4, 8, 4, N)), rng.standard_normal((C, 4, N)))
    _, w = dcmha_attention(x, x, q, k, v, *dyn, is_causal=True)
    assert np.all(w[..., np.triu_indices(4, 1)[0], np.triu_indices(4, 1)[1]] == 0)
    assert not np.allclose(w.sum(-1), 1.0)
