"""The collaborative reference against the general reference attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference import attention
from multihead.reference.collaborative import collaborative_attention, collaborative_scores


def weights(rng, C=6, H=2, D=3, Ck=None):
    Ck = C if Ck is None else Ck
    return dict(
        W_q=rng.standard_normal((C, H * D)),
        W_k=rng.standard_normal((Ck, H * D)),
        W_v=rng.standard_normal((Ck, H * D)),
        b_v=rng.standard_normal(H * D),
        W_o=rng.standard_normal((H * D, C)),
        b_o=rng.standard_normal(C),
    )


def concat_mixing(H, D):
    return np.kron(np.eye(H), np.ones((1, D)))  # (H, H*D) block one-hot


@pytest.mark.parametrize("is_causal", [False, True])
def test_concatenate_mixing_with_query_bias_content_bias_is_mha(seed, is_causal):
    """Block one-hot mixing and content bias W_K,h b_Q,h reproduce MHA with a query bias."""
    rng = seed
    B, T, C, H, D = 2, 7, 6, 2, 3
    w = weights(rng, C, H, D)
    b_q = rng.standard_normal(H * D)
    x = rng.standard_normal((B, T, C))
    W_cb = np.stack([w["W_k"][:, h * D : (h + 1) * D] @ b_q[h * D : (h + 1) * D] for h in range(H)], axis=1)
    mask = np.ones((B, 1, 1, T), dtype=bool)
    mask[1, ..., -2:] = False
    got, P = collaborative_attention(
        x,
        x,
        w["W_q"],
        w["W_k"],
        concat_mixing(H, D),
        W_cb,
        w["W_v"],
        w["b_v"],
        w["W_o"],
        w["b_o"],
        mask=mask,
        is_causal=is_causal,
        return_weights=True,
    )
    split = lambda t: t.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # noqa: E731  (B, T, H*D) -> (B, H, T, D)
    q, k, v = split(x @ w["W_q"] + b_q), split(x @ w["W_k"]), split(x @ w["W_v"] + w["b_v"])
    o, want_P = attention(q, k, v, mask=mask, is_causal=is_causal, return_weights=True)
    want = o.transpose(0, 2, 1, 3).reshape(B, T, H * D) @ w["W_o"] + w["b_o"]
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(P, want_P, atol=1e-12, rtol=0)


def test_scores_written_out(seed):
    rng = seed
    B, T, S, C, Ck, H, Dt = 1, 3, 4, 5, 4, 3, 7
    x, y = rng.standard_normal((B, T, C)), rng.standard_normal((B, S, Ck))
    W_q, W_k = rng.standard_normal((C, Dt)), rng.standard_normal((Ck, Dt))
    M, W_cb = rng.standard_normal((H, Dt)), rng.standard_normal((Ck, H))
    s = collaborative_scores(x, y, W_q, W_k, M, W_cb)
    scale = 1 / math.sqrt(Dt / H)  # 7 / 3: a float division
    for h in range(H):
        for i in range(T):
            for j in range(S):
                want = sum((x[0, i] @ W_q)[c] * M[h, c] * (y[0, j] @ W_k)[c] for c in range(Dt))
                want += y[0, j] @ W_cb[:, h]
                assert s[0, h, i, j] == pytest.approx(scale * want, abs=1e-12)


def test_masked_inputs_do_not_leak_and_empty_rows_are_zero(seed):
    rng = seed
    B, T, S, C, H, D = 2, 3, 4, 6, 2, 3
    w = weights(rng, C, H, D)
    M, W_cb = rng.standard_normal((H, 5)), rng.standard_normal((C, H))
    W_q, W_k = rng.standard_normal((C, 5)), rng.standard_normal((C, 5))
    x, y = rng.standard_normal((B, T, C)), rng.standard_normal((B, S, C))
    mask = np.array([[True, True, False, False], [False] * 4])[:, None, None, :]
    args = (W_q, W_k, M, W_cb, w["W_v"], w["b_v"])
    a, Pa = collaborative_attention(x, y, *args, mask=mask, return_weights=True)
    y2 = y.copy()
    y2[0, 2:] = np.nan
    b, Pb = collaborative_attention(x, y2, *args, mask=mask, return_weights=True)
    np.testing.assert_array_equal(a[0], b[0])
    assert np.all(b[1] == 0) and np.all(Pb[1] == 0) and not np.isnan(Pb).any()
    float_mask = np.where(mask, 0.0, -np.inf)
    c = collaborative_attention(x, y2, *args, mask=float_mask)
    np.testing.assert_array_equal(c[0], b[0])
