"""The MLA reference against the general reference attention and against
rope written as complex multiplication (DeepSeek's form)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference import attention
from multihead.reference.mla import mla_attention, rope_rotate, yarn_theta


def weights(rng, C=6, H=2, Dn=3, R=4, Dv=5, L=4, Rq=0):
    Cq = Rq or C
    w = {
        "W_UQ": rng.standard_normal((Cq, H, Dn)), "W_QR": rng.standard_normal((Cq, H, R)),
        "W_DKV": rng.standard_normal((C, L)), "g_KV": rng.uniform(0.5, 1.5, L), "W_KR": rng.standard_normal((C, R)),
        "W_UK": rng.standard_normal((L, H, Dn)), "W_UV": rng.standard_normal((L, H, Dv)),
        "W_O": rng.standard_normal((H * Dv, C)), "b_O": rng.standard_normal(C),
    }  # fmt: skip
    if Rq:
        w |= {"W_DQ": rng.standard_normal((C, Rq)), "g_Q": rng.uniform(0.5, 1.5, Rq)}
    return w


def rms(x, g, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g


def complex_rope(x, pos, theta):
    """Adjacent pairs (2k, 2k+1) as a + ib, times e^{i·pos·θ_k}."""
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * np.asarray(pos, dtype=np.float64)[:, None] * theta)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("Rq", [0, 3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_equals_attention_over_explicit_per_head_keys_and_values(seed, Rq, is_causal):
    """Build q = [q^C | RoPE(q^R)], k = [k^C | RoPE(k^R)] per head and v = c W^UV by hand;
    the general reference with scale 1/sqrt(Dn + R) then gives the same output."""
    rng = seed
    B, T, C, H, Dn, R, Dv = 2, 5, 6, 2, 3, 4, 5
    w = weights(rng, C, H, Dn, R, Dv, Rq=Rq)
    x = rng.standard_normal((B, T, C))
    mask = np.ones((B, 1, 1, T), dtype=bool)
    mask[1, ..., -1] = False
    rope = {"base": 100.0, "interleaved": True}
    got, P = mla_attention(x, x, w, rope=rope, mask=mask, is_causal=is_causal, return_weights=True)
    c_q = x if not Rq else rms(x @ w["W_DQ"], w["g_Q"])
    theta = 100.0 ** (-np.arange(0, R, 2) / R)
    q = np.concatenate([np.einsum("btc,chd->bhtd", c_q, w["W_UQ"]),
                        complex_rope(np.einsum("btc,chd->bhtd", c_q, w["W_QR"]), np.arange(T), theta)], -1)  # fmt: skip
    c = rms(x @ w["W_DKV"], w["g_KV"])
    k_r = complex_rope((x @ w["W_KR"])[:, None], np.arange(T), theta)  # (B, 1, T, R)
    k = np.concatenate([np.einsum("bsl,lhd->bhsd", c, w["W_UK"]), np.repeat(k_r, H, axis=1)], -1)
    v = np.einsum("bsl,lhd->bhsd", c, w["W_UV"])
    out, want_P = attention(q, k, v, mask=mask, is_causal=is_causal, scale=1 / math.sqrt(Dn + R), return_weights=True)
    want = out.transpose(0, 2, 1, 3).reshape(B, T, H * Dv) @ w["W_O"] + w["b_O"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(P, want_P, rtol=1e-12, atol=1e-12)


def test_rope_rotates_adjacent_pairs_or_halves_and_only_the_first_r_channels(seed):
    x = seed.standard_normal((2, 3, 4, 6))
    theta = np.array([1.0, 0.3])
    pos = np.array([0, 2, 5, 7])
    inter = rope_rotate(x, pos, theta, interleaved=True)
    np.testing.assert_allclose(inter[..., :4], complex_rope(x[..., :4], pos, theta), rtol=0, atol=1e-13)
    assert np.array_equal(inter[..., 4:], x[..., 4:])
    halves = rope_rotate(x[..., [0, 2, 1, 3]], pos, theta, interleaved=False)  # pair (k, k + 2) = old (2k, 2k+1)
    np.testing.assert_allclose(halves[..., [0, 2, 1, 3]], inter[..., :4], rtol=0, atol=1e-13)


def test_yarn_keeps_high_frequencies_divides_low_ones_and_clamps_at_r_minus_one():
    r, base, factor = 8, 10000.0, 4.0
    theta = base ** (-np.arange(0, r, 2) / r)
    # d(n) = r·ln(L0 / (2π·n)) / (2·ln base) = 4·log_base(L0 / (2π·n)); L0 = 2π·base^1.4 puts
    # d(beta_slow = 1) at 5.6 (high = 6 > r/2 - 1: the ramp's upper end lies past the last index 3)
    # and d(beta_fast = base^1.275) at 0.5 (low = 0)
    L0 = 2 * math.pi * base**1.4
    got = yarn_theta(r, base, factor, L0, beta_fast=base**1.275, beta_slow=1.0)
    ramp = np.arange(4) / 6
    np.testing.assert_allclose(got, theta / factor * ramp + theta * (1 - ramp), rtol=1e-14)
    assert got[0] == theta[0]  # the fastest rotation is kept
    same = yarn_theta(r, base, factor, 4096.0, beta_fast=1.0, beta_slow=1.0)  # low == high: a step
    assert np.all((same == theta) | np.isclose(same, theta / factor))


def test_yarn_scales_the_scores_by_mscale_squared(seed):
    rng = seed
    w = weights(rng)
    x = rng.standard_normal((1, 4, 6))
    yarn = {"factor": 4.0, "original_seq_len": 16, "mscale": 0.5}
    rope = {"interleaved": True, "base": 10000.0}
    _, P = mla_attention(x, x, w, rope=rope, yarn=yarn, return_weights=True)
    m = 0.1 * 0.5 * math.log(4.0) + 1
    # the same scores with the scale made plain again: W^UQ and W^QR divided by m²
    plain = {**w, "W_UQ": w["W_UQ"] * m**2, "W_QR": w["W_QR"] * m**2}
    _, P_big = mla_attention(x, x, plain, rope=rope, yarn={**yarn, "mscale": 0.0}, return_weights=True)
    np.testing.assert_allclose(P, P_big, rtol=1e-12, atol=1e-14)


def test_without_latent_norm_and_rope_part_it_is_attention_over_factored_keys_and_values(seed):
    """kv_norm=False and R = 0: keys c W^UK_i and values c W^UV_i of the raw latent c = h W^DKV + b,
    scale 1/sqrt(Dn), as the general reference computes them."""
    rng = seed
    B, T, C, H, Dn, Dv, L = 2, 4, 6, 2, 3, 5, 4
    w = weights(rng, C, H, Dn, 0, Dv, L)
    w["b_DKV"] = rng.standard_normal(L)
    del w["g_KV"]
    x = rng.standard_normal((B, T, C))
    got, P = mla_attention(x, x, w, kv_norm=False, is_causal=True, return_weights=True)
    c = x @ w["W_DKV"] + w["b_DKV"]
    q = np.einsum("btc,chd->bhtd", x, w["W_UQ"])
    k, v = np.einsum("bsl,lhd->bhsd", c, w["W_UK"]), np.einsum("bsl,lhd->bhsd", c, w["W_UV"])
    out, want_P = attention(q, k, v, is_causal=True, scale=1 / math.sqrt(Dn), return_weights=True)
    want = out.transpose(0, 2, 1, 3).reshape(B, T, H * Dv) @ w["W_O"] + w["b_O"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(P, want_P, rtol=1e-12, atol=1e-12)
