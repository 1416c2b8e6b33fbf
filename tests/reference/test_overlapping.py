"""The NumPy MOHSA reference: the overlapped split and the attention built on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference import attention as plain_attention
from multihead.reference.overlapping import overlapped_heads, overlapping_attention


def test_split_matches_the_docstring_picture():
    X = np.arange(1.0, 7.0)[None, None, :]  # C' = 6: channels c0..c5 hold 1..6
    heads = overlapped_heads(X, num_heads=3, overlap=1)[0, :, 0]  # (H, dh + 2ov)
    np.testing.assert_array_equal(heads, [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 0]])


@pytest.mark.parametrize("H,dh,ov", [(3, 2, 0), (3, 5, 1), (4, 2, 3), (2, 3, 7), (1, 4, 2)])
def test_split_is_a_window_of_the_padded_channels(H, dh, ov):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2, 5, H * dh))
    padded = np.concatenate([np.zeros((2, 5, ov)), X, np.zeros((2, 5, ov))], axis=-1)
    want = np.stack([padded[..., i * dh : (i + 1) * dh + 2 * ov] for i in range(H)], axis=1)
    np.testing.assert_array_equal(overlapped_heads(X, H, ov), want)


def test_zero_overlap_is_the_plain_head_split():
    X = np.random.default_rng(1).standard_normal((2, 4, 12))
    np.testing.assert_array_equal(overlapped_heads(X, 3, 0), X.reshape(2, 4, 3, 4).transpose(0, 2, 1, 3))


def _weights(rng, C, H, dh, ov, Ckv=None):
    Ckv = C if Ckv is None else Ckv
    Cp = H * dh
    return dict(
        W_q=rng.standard_normal((Cp, C)),
        W_k=rng.standard_normal((Cp, Ckv)),
        W_v=rng.standard_normal((Cp, Ckv)),
        W_o=rng.standard_normal((C, H * (dh + 2 * ov))),
        b_q=rng.standard_normal(Cp),
        b_k=rng.standard_normal(Cp),
        b_v=rng.standard_normal(Cp),
        b_o=rng.standard_normal(C),
    )


def test_zero_overlap_is_multi_head_attention():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 6))
    w = _weights(rng, 6, 3, 2, 0)
    y = overlapping_attention(x, x, num_heads=3, overlap=0, is_causal=True, **w)
    heads = [(x @ w[f"W_{n}"].T + w[f"b_{n}"]).reshape(2, 5, 3, 2).transpose(0, 2, 1, 3) for n in "qkv"]
    O = plain_attention(*heads, is_causal=True).transpose(0, 2, 1, 3).reshape(2, 5, 6)
    np.testing.assert_allclose(y, O @ w["W_o"].T + w["b_o"], rtol=0, atol=1e-12)


def test_one_head_by_hand_with_the_unwidened_scale():
    """Loops over heads, queries and keys, the widened dot product scaled by dh^-1/2."""
    rng = np.random.default_rng(3)
    H, dh, ov, T, S = 3, 2, 1, 4, 3
    x, ctx = rng.standard_normal((1, T, 5)), rng.standard_normal((1, S, 4))
    w = _weights(rng, 5, H, dh, ov, Ckv=4)
    y, A = overlapping_attention(x, ctx, num_heads=H, overlap=ov, return_weights=True, **w)
    q = x[0] @ w["W_q"].T + w["b_q"]
    k = ctx[0] @ w["W_k"].T + w["b_k"]
    v = ctx[0] @ w["W_v"].T + w["b_v"]

    def chan(row, c):
        return row[c] if 0 <= c < H * dh else 0.0

    O = np.zeros((T, H * (dh + 2 * ov)))
    for i in range(H):
        cols = range(i * dh - ov, (i + 1) * dh + ov)
        for t in range(T):
            s = [sum(chan(q[t], c) * chan(k[j], c) for c in cols) / math.sqrt(dh) for j in range(S)]
            p = np.exp(np.array(s) - max(s))
            p /= p.sum()
            np.testing.assert_allclose(A[0, i, t], p, rtol=1e-12)
            for jj, c in enumerate(cols):
                O[t, i * (dh + 2 * ov) + jj] = sum(p[j] * chan(v[j], c) for j in range(S))
    np.testing.assert_allclose(y[0], O @ w["W_o"].T + w["b_o"], rtol=1e-12, atol=1e-12)


def test_masks_reach_every_head_and_fully_masked_rows_are_zero():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 4))
    w = _weights(rng, 4, 2, 2, 1)
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    y, A = overlapping_attention(x, x, num_heads=2, overlap=1, mask=mask, return_weights=True, **w)
    assert np.all(A[0, :, 0, 1] == 0) and np.all(A[0, :, 1] == 0)
    np.testing.assert_allclose(y[0, 1], w["b_o"])  # zero head outputs -> only the output bias


@pytest.mark.parametrize(
    "args,match",
    [((np.zeros((2, 6)), 3, 1), "must be"), ((np.zeros((1, 2, 6)), 4, 1), "num_heads=4"), ((np.zeros((1, 2, 6)), 3, -1), "overlap")],
)
def test_split_errors(args, match):
    with pytest.raises(ValueError, match=match):
        overlapped_heads(*args)
