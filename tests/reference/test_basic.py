"""Tests for multihead.reference.basic: softmax and the textbook attention forms."""

import math
import warnings

import numpy as np
import pytest

from multihead.reference import (
    multihead_attention_einsum,
    multihead_attention_list,
    multihead_attention_vec,
    multihead_cross_attention_list,
    self_attention,
    softmax,
)

TOL = 1e-12


def _weights(rng, D, NH, HS):
    """Per-head weight lists Wqs, Wks, Wvs ([D, HS] each) and Wp [NH*HS, D]."""
    Wqs, Wks, Wvs = ([rng.standard_normal((D, HS)) for _ in range(NH)] for _ in range(3))
    return Wqs, Wks, Wvs, rng.standard_normal((NH * HS, D))


def _fuse(Wqs, Wks, Wvs):
    """[Wq | Wk | Wv], head i in columns i*HS:(i+1)*HS of each block, built by assignment."""
    D, HS = Wqs[0].shape
    NH = len(Wqs)
    W = np.zeros((D, 3 * NH * HS))
    for block, ws in enumerate((Wqs, Wks, Wvs)):
        for i, w in enumerate(ws):
            start = block * NH * HS + i * HS
            W[:, start : start + HS] = w
    return W


def _loop_cross(xq, xv, Wqs, Wks, Wvs, Wp):
    """Cross-attention, one scalar at a time in plain Python."""
    B, Nq, D = xq.shape
    Nv, HS, NH = xv.shape[1], Wqs[0].shape[1], len(Wqs)
    out = np.zeros((B, Nq, D))
    for b in range(B):
        for i in range(Nq):
            concat = []
            for h in range(NH):
                q = [sum(xq[b, i, d] * Wqs[h][d, e] for d in range(D)) for e in range(HS)]
                ks = [[sum(xv[b, j, d] * Wks[h][d, e] for d in range(D)) for e in range(HS)]
                      for j in range(Nv)]
                vs = [[sum(xv[b, j, d] * Wvs[h][d, e] for d in range(D)) for e in range(HS)]
                      for j in range(Nv)]
                s = [sum(q[e] * ks[j][e] for e in range(HS)) / math.sqrt(HS) for j in range(Nv)]
                m = max(s)
                ex = [math.exp(x - m) for x in s]
                p = [x / sum(ex) for x in ex]
                concat += [sum(p[j] * vs[j][e] for j in range(Nv)) for e in range(HS)]
            for c in range(D):
                out[b, i, c] = sum(concat[r] * Wp[r, c] for r in range(NH * HS))
    return out


# ---------------------------------------------------------------- softmax


def test_softmax_rows_sum_to_one_and_match_definition():
    x = np.random.default_rng(0).standard_normal((3, 4, 7))
    for axis in (0, 1, -1):
        p = softmax(x, axis=axis)
        np.testing.assert_allclose(p.sum(axis=axis), 1.0, rtol=0, atol=TOL)
        e = np.exp(x)
        np.testing.assert_allclose(p, e / e.sum(axis=axis, keepdims=True), rtol=0, atol=TOL)


def test_softmax_invariant_to_constant_shift():
    x = np.random.default_rng(1).standard_normal((5, 6))
    np.testing.assert_allclose(softmax(x + 123.25), softmax(x), rtol=0, atol=TOL)


def test_softmax_huge_inputs_stay_finite():
    p = softmax(np.array([1e4, 1e4 - 1.0, -1e4]))
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p, [1 / (1 + math.e**-1), math.e**-1 / (1 + math.e**-1), 0.0],
                               rtol=0, atol=TOL)


@pytest.mark.filterwarnings("error")
def test_softmax_all_neg_inf_row_is_zero_without_warnings():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = softmax(x)
    np.testing.assert_array_equal(p, [[0.0, 0.0, 0.0], [0.5, 0.0, 0.5]])


def test_softmax_nan_stays_nan():
    p = softmax(np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]]))
    assert np.isnan(p[0]).all()
    assert not np.isnan(p[1]).any()


# ---------------------------------------------------- list / vec / einsum


@pytest.mark.parametrize("do_mask", [False, True])
@pytest.mark.parametrize("B,N,D,NH", [(2, 5, 6, 3), (1, 1, 4, 1), (3, 7, 8, 4), (2, 4, 6, 6)])
def test_list_vec_einsum_agree(B, N, D, NH, do_mask):
    rng = np.random.default_rng(10 + N * D + NH)
    x = rng.standard_normal((B, N, D))
    Wqs, Wks, Wvs, Wp = _weights(rng, D, NH, D // NH)
    W = _fuse(Wqs, Wks, Wvs)
    ref = multihead_attention_list(x, Wqs, Wks, Wvs, Wp, do_mask=do_mask)
    assert ref.shape == (B, N, D)
    vec = multihead_attention_vec(x, W, NH, Wp, do_mask=do_mask)
    ein = multihead_attention_einsum(x, W, NH, Wp, do_mask=do_mask)
    np.testing.assert_allclose(vec, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(ein, ref, rtol=0, atol=TOL)


def test_mask_makes_prefix_independent_of_future():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 6, 4))
    Wqs, Wks, Wvs, Wp = _weights(rng, 4, 2, 2)
    y = x.copy()
    y[:, 3:] = rng.standard_normal((1, 3, 4))  # change only the future
    a = multihead_attention_list(x, Wqs, Wks, Wvs, Wp, do_mask=True)
    b = multihead_attention_list(y, Wqs, Wks, Wvs, Wp, do_mask=True)
    np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=0, atol=TOL)
    assert not np.allclose(multihead_attention_list(x, Wqs, Wks, Wvs, Wp)[:, :3],
                           multihead_attention_list(y, Wqs, Wks, Wvs, Wp)[:, :3])


def test_self_attention_equals_one_head_list_form():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 4))
    Wq, Wk, Wv = (rng.standard_normal((4, 4)) for _ in range(3))
    got = self_attention(x, Wk, Wq, Wv)  # tutorial order: Wk, Wq, Wv
    np.testing.assert_allclose(got, multihead_attention_list(x, [Wq], [Wk], [Wv], np.eye(4)),
                               rtol=0, atol=TOL)
    # Unbatched input gives the batch elements one at a time.
    np.testing.assert_allclose(self_attention(x[1], Wk, Wq, Wv), got[1], rtol=0, atol=TOL)
    # Argument order matters: swapping Wk and Wq changes the result.
    assert not np.allclose(self_attention(x, Wq, Wk, Wv), got)


def test_self_attention_head_size_differs_from_width():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5))
    Wq, Wk, Wv = (rng.standard_normal((5, 2)) for _ in range(3))
    q, k, v = x @ Wq, x @ Wk, x @ Wv
    s = q @ k.T / math.sqrt(2)
    e = np.exp(s)
    want = e / e.sum(-1, keepdims=True) @ v
    np.testing.assert_allclose(self_attention(x, Wk, Wq, Wv), want, rtol=0, atol=TOL)


def test_cross_attention_with_same_sequence_equals_list_form():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 6))
    Wqs, Wks, Wvs, Wp = _weights(rng, 6, 3, 2)
    np.testing.assert_allclose(multihead_cross_attention_list(x, x, Wqs, Wks, Wvs, Wp),
                               multihead_attention_list(x, Wqs, Wks, Wvs, Wp), rtol=0, atol=TOL)


def test_cross_attention_different_lengths_matches_loop_and_not_swapped_bug():
    rng = np.random.default_rng(6)
    xq, xv = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    Wqs, Wks, Wvs, Wp = _weights(rng, 4, 2, 3)
    got = multihead_cross_attention_list(xq, xv, Wqs, Wks, Wvs, Wp)
    assert got.shape == (2, 3, 4)
    np.testing.assert_allclose(got, _loop_cross(xq, xv, Wqs, Wks, Wvs, Wp), rtol=0, atol=TOL)
    # The widely copied bug: `for Wq, Wk, Wv in zip(Wks, Wqs, Wvs)`, i.e. the key
    # weights project the queries and the query weights project the keys.
    heads = []
    for Wq, Wk, Wv in zip(Wks, Wqs, Wvs, strict=True):
        s = (xq @ Wq) @ np.swapaxes(xv @ Wk, -1, -2) / math.sqrt(3)
        heads.append(softmax(s) @ (xv @ Wv))
    swapped = np.concatenate(heads, axis=-1) @ Wp
    assert np.abs(got - swapped).max() > 1e-3


# ---------------------------------------------------------------- errors


def test_self_attention_errors():
    w = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        self_attention(np.zeros(5), w, w, w)
    with pytest.raises(ValueError, match=r"Wq.*\(3, 2\)"):
        self_attention(np.zeros((2, 4)), w, np.zeros((3, 2)), w)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        self_attention(np.zeros((2, 4)), w, w, np.zeros((4, 3)))


def test_list_form_errors():
    rng = np.random.default_rng(7)
    x = np.zeros((1, 3, 4))
    Wqs, Wks, Wvs, Wp = _weights(rng, 4, 2, 2)
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        multihead_attention_list(np.zeros((3, 4)), Wqs, Wks, Wvs, Wp)
    with pytest.raises(ValueError, match="2, 1, 2"):
        multihead_attention_list(x, Wqs, Wks[:1], Wvs, Wp)
    with pytest.raises(ValueError, match="0, 0, 0"):
        multihead_attention_list(x, [], [], [], Wp)
    with pytest.raises(ValueError, match=r"Wvs\[1\].*\(5, 2\)"):
        multihead_attention_list(x, Wqs, Wks, [Wvs[0], np.zeros((5, 2))], Wp)
    with pytest.raises(ValueError, match=r"\(4, 2\), \(4, 3\)"):
        multihead_attention_list(x, Wqs, Wks, [Wvs[0], np.zeros((4, 3))], Wp)
    with pytest.raises(ValueError, match=r"\(4, 4\).*\(4, 3\)"):
        multihead_attention_list(x, Wqs, Wks, Wvs, np.zeros((4, 3)))


def test_cross_attention_errors():
    rng = np.random.default_rng(8)
    Wqs, Wks, Wvs, Wp = _weights(rng, 4, 2, 2)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\) and \(1, 5, 4\)"):
        multihead_cross_attention_list(np.zeros((2, 3, 4)), np.zeros((1, 5, 4)), Wqs, Wks, Wvs, Wp)
    with pytest.raises(ValueError, match=r"\(1, 3, 4\) and \(1, 5, 3\)"):
        multihead_cross_attention_list(np.zeros((1, 3, 4)), np.zeros((1, 5, 3)), Wqs, Wks, Wvs, Wp)
    with pytest.raises(ValueError, match=r"\(5, 4\)"):
        multihead_cross_attention_list(np.zeros((1, 3, 4)), np.zeros((5, 4)), Wqs, Wks, Wvs, Wp)


@pytest.mark.parametrize("fn", [multihead_attention_vec, multihead_attention_einsum])
def test_fused_form_errors(fn):
    x, W, Wp = np.zeros((1, 3, 6)), np.zeros((6, 18)), np.zeros((6, 6))
    with pytest.raises(ValueError, match="D = 6.*NH = 4"):
        fn(x, W, 4, Wp)
    with pytest.raises(ValueError, match="NH = 0"):
        fn(x, W, 0, Wp)
    with pytest.raises(TypeError, match="2.0"):
        fn(x, W, 2.0, Wp)
    with pytest.raises(ValueError, match=r"\(6, 18\).*\(6, 12\)"):
        fn(x, np.zeros((6, 12)), 2, Wp)
    with pytest.raises(ValueError, match=r"\(6, 6\).*\(6, 5\)"):
        fn(x, W, 2, np.zeros((6, 5)))
    with pytest.raises(ValueError, match=r"\(3, 6\)"):
        fn(np.zeros((3, 6)), W, 2, Wp)
