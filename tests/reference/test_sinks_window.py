"""The reference's ``sinks`` and ``window`` against forms written another way: a sink is
one more key whose score is s_h and whose value is zero; a window is a boolean mask."""

import numpy as np
import pytest

from multihead.reference import attention


def _qkv(rng, B=2, H=4, G=2, T=5, S=6, D=3):
    return rng.standard_normal((B, H, T, D)), rng.standard_normal((B, G, S, D)), rng.standard_normal((B, G, S, 2))


@pytest.mark.parametrize("mask_kind", ["none", "bool_with_empty_row", "float"])
def test_a_sink_is_one_more_key_with_score_s_and_a_zero_value(mask_kind):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    B, H, T, D = q.shape
    S = k.shape[2]
    sinks = rng.standard_normal(H) * 2
    mask = None
    if mask_kind == "bool_with_empty_row":
        mask = rng.random((B, H, T, S)) < 0.6
        mask[0, 1, 2] = False
    elif mask_kind == "float":
        mask = rng.standard_normal((1, H, T, S))
    out, w = attention(q, k, v, mask=mask, sinks=sinks, return_weights=True)
    # per head: a key of zeros plus a float mask column holding s_h (q . 0 = 0), value zero
    k_h = np.repeat(k, H // k.shape[1], axis=1)
    v_h = np.repeat(v, H // v.shape[1], axis=1)
    k2 = np.concatenate([k_h, np.zeros((B, H, 1, D))], axis=2)
    v2 = np.concatenate([v_h, np.zeros((B, H, 1, 2))], axis=2)
    bias = np.zeros((B, H, T, S + 1))
    bias[..., S] = sinks[None, :, None]
    if mask_kind == "bool_with_empty_row":
        bias[..., :S] = np.where(mask, 0.0, -np.inf)
    elif mask_kind == "float":
        bias[..., :S] += mask
    out2, w2 = attention(q, k2, v2, mask=bias, return_weights=True)
    np.testing.assert_allclose(out, out2, rtol=0, atol=1e-13)
    np.testing.assert_allclose(w, w2[..., :S], rtol=0, atol=1e-13)
    assert (w.sum(-1) < 1).all()
    if mask_kind == "bool_with_empty_row":
        assert (out[0, 1, 2] == 0).all() and (w[0, 1, 2] == 0).all()


@pytest.mark.parametrize("T,S,alignment", [(6, 6, "top_left"), (3, 7, "bottom_right"), (7, 4, "top_left")])
def test_a_window_is_the_mask_of_the_query_and_the_keys_before_it(T, S, alignment):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, T=T, S=S)
    offset = 0 if alignment == "top_left" else S - T
    i, j = np.arange(T)[:, None] + offset, np.arange(S)[None, :]
    mask = (j <= i) & (j > i - 3)
    got = attention(q, k, v, window=3, causal_alignment=alignment)
    np.testing.assert_allclose(got, attention(q, k, v, mask=mask), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        attention(q, k, v, window=0)
