"""Tests for multihead.reference.attention against a brute-force loop version."""

import itertools
import math

import numpy as np
import pytest

from multihead.reference import attention, causal_mask

TOL = 1e-12


def _mask_at(mask, b, h, i, j):
    """mask[b, h, i, j] for a (T, S) mask or a 4-D mask with size-1 axes."""
    if mask.ndim == 2:
        return mask[i, j]
    idx = [0 if n == 1 else x for n, x in zip(mask.shape, (b, h, i, j), strict=True)]
    return mask[tuple(idx)]


def brute(q, k, v, mask=None, is_causal=False, align="top_left", scale=None):
    """Triple loop over (b, h, i): collect allowed keys, softmax them in Python."""
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out, weights = np.zeros((B, H, T, Dv)), np.zeros((B, H, T, S))
    for b, h, i in itertools.product(range(B), range(H), range(T)):
        g = h // (H // G)
        keys, scores = [], []
        for j in range(S):
            if is_causal and j > i + (S - T if align == "bottom_right" else 0):
                continue
            bias = 0.0
            if mask is not None:
                m = _mask_at(mask, b, h, i, j)
                if mask.dtype == bool and not m:
                    continue
                if mask.dtype != bool:
                    if m == -math.inf:
                        continue
                    bias = float(m)
            keys.append(j)
            scores.append(scale * sum(q[b, h, i, d] * k[b, g, j, d] for d in range(D)) + bias)
        if not keys:
            continue
        top = max(scores)
        ex = [math.exp(s - top) for s in scores]
        for j, e in zip(keys, ex, strict=True):
            weights[b, h, i, j] = e / sum(ex)
        for d in range(Dv):
            out[b, h, i, d] = sum(weights[b, h, i, j] * v[b, g, j, d] for j in keys)
    return out, weights


def _qkv(rng, B, H, G, T, S, D, Dv=None):
    Dv = D if Dv is None else Dv
    return (rng.standard_normal((B, H, T, D)), rng.standard_normal((B, G, S, D)),
            rng.standard_normal((B, G, S, Dv)))


def _random_mask(rng, kind, shape_kind, B, H, T, S):
    shape = {"2d": (T, S), "full": (B, H, T, S), "b1ts": (B, 1, T, S), "1h1s": (1, H, 1, S)}
    shape = shape[shape_kind]
    if kind == "bool":
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape)
    m[rng.random(shape) < 0.25] = -np.inf
    return m


def _check(q, k, v, **kw):
    out, w = attention(q, k, v, return_weights=True, **kw)
    align = kw.pop("causal_alignment", "top_left")
    want_out, want_w = brute(q, k, v, align=align, **kw)
    assert out.shape == want_out.shape and w.shape == want_w.shape
    np.testing.assert_allclose(out, want_out, rtol=0, atol=TOL)
    np.testing.assert_allclose(w, want_w, rtol=0, atol=TOL)
    np.testing.assert_array_equal(attention(q, k, v, **dict(kw, causal_alignment=align)), out)
    return out, w


CASES = [(None, None, False, "top_left"), (None, None, True, "top_left"),
         (None, None, True, "bottom_right"), ("bool", "2d", False, "top_left"),
         ("float", "full", False, "top_left"), ("bool", "b1ts", True, "bottom_right"),
         ("float", "1h1s", True, "top_left"), ("float", "2d", True, "bottom_right")]


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("D", [1, 3, 5])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("S", [1, 5, 9])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("kind,shape_kind,is_causal,align", CASES)
def test_matches_brute_force_sweep(D, T, S, G, kind, shape_kind, is_causal, align):
    rng = np.random.default_rng(1000 * D + 100 * T + 10 * S + G)
    B, H = 2, 4
    q, k, v = _qkv(rng, B, H, G, T, S, D, Dv=D + 1)
    mask = None if kind is None else _random_mask(rng, kind, shape_kind, B, H, T, S)
    out, w = _check(q, k, v, mask=mask, is_causal=is_causal, causal_alignment=align)
    assert not np.isnan(out).any()
    sums = w.sum(-1)
    assert np.all((np.abs(sums - 1) < TOL) | (sums == 0))


def test_scale_argument():
    q, k, v = _qkv(np.random.default_rng(1), 1, 2, 1, 3, 4, 5)
    _check(q, k, v, scale=0.3)
    assert not np.allclose(attention(q, k, v, scale=0.3), attention(q, k, v))


def test_causal_mask_pictures():
    x, o = True, False
    np.testing.assert_array_equal(causal_mask(2, 4), [[x, o, o, o], [x, x, o, o]])
    np.testing.assert_array_equal(causal_mask(2, 4, "bottom_right"), [[x, x, x, o], [x, x, x, x]])
    np.testing.assert_array_equal(causal_mask(4, 2, "bottom_right"),
                                  [[o, o], [o, o], [x, o], [x, x]])
    for align in ("top_left", "bottom_right"):
        np.testing.assert_array_equal(causal_mask(5, 5, align), np.tri(5, dtype=bool))
    assert causal_mask(3, 0).shape == (3, 0) and causal_mask(0, 3).dtype == bool


@pytest.mark.filterwarnings("error")
def test_fully_masked_rows_give_zeros():
    q, k, v = _qkv(np.random.default_rng(2), 2, 2, 2, 3, 4, 3)
    mask = np.ones((2, 2, 3, 4), dtype=bool)
    mask[0, 1, 2] = False
    out, w = _check(q, k, v, mask=mask)
    assert not out[0, 1, 2].any() and not w[0, 1, 2].any()
    assert np.all(out[0, 0] != 0)
    fmask = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(attention(q, k, v, mask=fmask), out)
    # T > S, bottom_right: the first T - S queries see no key at all.
    q, k, v = _qkv(np.random.default_rng(3), 1, 2, 1, 5, 2, 3)
    out, w = _check(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert not out[:, :, :3].any() and not w[:, :, :3].any() and np.all(out[:, :, 3:] != 0)
    # S = 0: nothing to attend to anywhere.
    out = attention(q, k[:, :, :0], v[:, :, :0])
    assert out.shape == (1, 2, 5, 3) and not out.any()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e308])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_bad_values_at_masked_positions_do_not_leak(bad, kind):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 2, 4, 2, 3, 6, 3)
    lengths = [4, 2]  # key padding: batch b sees keys 0 .. lengths[b] - 1
    pad = np.arange(6)[None, :] >= np.array(lengths)[:, None]  # (B, S), True = padding
    mask = ~pad[:, None, None, :]  # (B, 1, 1, S)
    if kind == "float":
        mask = np.where(mask, rng.standard_normal((2, 1, 1, 6)), -np.inf)
    clean_out, clean_w = _check(q, k, v, mask=mask)
    k2, v2 = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        k2[b, :, n:], v2[b, :, n:] = bad, bad
    out, w = attention(q, k2, v2, mask=mask, return_weights=True)
    np.testing.assert_array_equal(out, clean_out)
    np.testing.assert_array_equal(w, clean_w)
    # Causal on top: a query that cannot see a key also ignores its NaN.
    tri = np.tri(3, 6, dtype=bool)
    k3, v3 = k.copy(), v.copy()
    k3[:, :, 5], v3[:, :, 5] = bad, bad  # key 5 is never visible under top_left, T=3
    np.testing.assert_array_equal(attention(q, k3, v3, mask=tri, is_causal=True),
                                  attention(q, k, v, mask=tri, is_causal=True))


def test_nan_in_allowed_value_reaches_exactly_the_affected_rows():
    B, H, G, T, S, D = 2, 4, 2, 5, 5, 3
    q, k, v = _qkv(np.random.default_rng(5), B, H, G, T, S, D)
    v[1, 0, 2, 1] = np.nan  # batch 1, group 0 (query heads 0 and 1), key 2, column 1
    out = attention(q, k, v, is_causal=True)
    want = np.zeros(out.shape, dtype=bool)
    want[1, 0:2, 2:, 1] = True  # causal: only queries i >= 2 see key 2
    np.testing.assert_array_equal(np.isnan(out), want)


def test_nan_in_float_mask_at_causally_hidden_position_is_ignored():
    q, k, v = _qkv(np.random.default_rng(6), 1, 2, 2, 4, 4, 3)
    fmask = np.zeros((4, 4))
    fmask[0, 3] = np.nan  # hidden by causality: must be ignored
    fmask[2, 1] = 0.75  # visible: must be added
    out = _check(q, k, v, mask=fmask, is_causal=True)[0]
    assert not np.isnan(out).any()
    assert not np.allclose(out, attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("H,G,groups", [(4, 2, [0, 0, 1, 1]), (6, 3, [0, 0, 1, 1, 2, 2]),
                                        (4, 1, [0, 0, 0, 0]), (4, 4, [0, 1, 2, 3])])
def test_head_map_is_repeat_interleave(H, G, groups):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, H, 3, 2))
    k = rng.standard_normal((1, G, 4, 2))
    v = np.broadcast_to(np.arange(G, dtype=float)[None, :, None, None], (1, G, 4, 5))
    out = attention(q, k, v)  # every value of group g equals g
    np.testing.assert_allclose(out, np.broadcast_to(np.array(groups, float)[None, :, None, None],
                                                    (1, H, 3, 5)), rtol=0, atol=TOL)
    _check(q, k, v)


def test_batch_equals_time_equals_heads_with_2d_mask():
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 3, 3, 3, 3, 4, 2)
    mask = rng.random((3, 4)) < 0.6
    mask[:, 0] = True
    out = _check(q, k, v, mask=mask)[0]
    # A (T, S) mask is indexed by (query, key) for every batch and head.
    for b, h in itertools.product(range(3), range(3)):
        np.testing.assert_allclose(out[b, h], attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1],
                                                        v[b:b + 1, h:h + 1], mask=mask)[0, 0],
                                   rtol=0, atol=TOL)


# ---------------------------------------------------------------- errors


def test_errors():
    q, k, v = _qkv(np.random.default_rng(9), 2, 4, 2, 3, 5, 6)
    with pytest.raises(ValueError, match=r"4-D.*\(4, 3, 6\)"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"4-D.*\(2, 2, 5\)"):
        attention(q, k, v[..., 0])
    with pytest.raises(ValueError, match=r"batch.*\(1, 2, 5, 6\)"):
        attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"H=4, G=3"):
        attention(q, *_qkv(np.random.default_rng(0), 2, 4, 3, 3, 5, 6)[1:])
    with pytest.raises(ValueError, match=r"H=4, G=8"):
        attention(q, np.zeros((2, 8, 5, 6)), np.zeros((2, 8, 5, 6)))
    with pytest.raises(ValueError, match=r"H=4, G=0"):
        attention(q, np.zeros((2, 0, 5, 6)), np.zeros((2, 0, 5, 6)))
    with pytest.raises(ValueError, match=r"G and S.*\(2, 2, 4, 6\)"):
        attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match=r"G and S.*\(2, 1, 5, 6\)"):
        attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match=r"head dim.*\(2, 2, 5, 4\)"):
        attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"D >= 1"):
        attention(q[..., :0], k[..., :0], v)


@pytest.mark.parametrize("shape", [(3, 4), (5, 3), (1, 5), (5,), (3, 5, 1), (4, 3, 5),
                                   (2, 3, 3, 5), (2, 4, 3, 5, 1), ()])
def test_mask_shape_errors(shape):
    q, k, v = _qkv(np.random.default_rng(10), 2, 4, 2, 3, 5, 6)
    with pytest.raises(ValueError, match=r"\(T, S\) = \(3, 5\).*\(2, 4, 3, 5\), got " +
                       str(shape).replace("(", r"\(").replace(")", r"\)")):
        attention(q, k, v, mask=np.ones(shape, dtype=bool))


def test_mask_dtype_and_alignment_errors():
    q, k, v = _qkv(np.random.default_rng(11), 1, 2, 1, 3, 5, 6)
    for dtype in (np.int64, np.uint8, np.int32):
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            attention(q, k, v, mask=np.ones((3, 5), dtype=dtype))
    with pytest.raises(ValueError, match="top_left.*bottom_right.*'bottom-right'"):
        attention(q, k, v, is_causal=True, causal_alignment="bottom-right")
    with pytest.raises(ValueError, match="top_left.*bottom_right.*'lower'"):
        causal_mask(3, 5, alignment="lower")
    with pytest.raises(ValueError, match="-1"):
        causal_mask(-1, 5)
    with pytest.raises(TypeError, match="2.5"):
        causal_mask(2.5, 5)
    # Masks given as float32 or as nested lists are accepted.
    m32 = np.zeros((3, 5), dtype=np.float32)
    np.testing.assert_allclose(attention(q, k, v, mask=m32), attention(q, k, v), rtol=0, atol=TOL)
    np.testing.assert_array_equal(attention(q, k, v, mask=[[True] * 5] * 3), attention(q, k, v))
