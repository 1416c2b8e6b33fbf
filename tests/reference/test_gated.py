"""The NumPy hard-concrete gate reference against independent computations:
quadrature over the noise, sampling, finite differences and the textbook heads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from multihead.reference import multihead_attention_list
from multihead.reference.gated import (
    gated_multihead_attention,
    hard_concrete_cdf,
    hard_concrete_eval_gate,
    hard_concrete_eval_gate_grad,
    hard_concrete_mean,
    hard_concrete_sample,
    hard_concrete_sample_grad,
    l0_penalty,
    open_probability,
)

LOG_ALPHAS = np.array([-4.0, -1.3, -0.2, 0.0, 0.6, 2.1, 5.0])


def _fd(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


def test_eval_gate_closes_and_opens_at_ln_11():
    la = np.array([-10.0, math.log(1 / 11) - 1e-9, math.log(1 / 11) + 1e-6, 0.0, math.log(11) - 1e-6,
                   math.log(11) + 1e-9, 10.0])  # fmt: skip
    g = hard_concrete_eval_gate(la)
    assert g[0] == 0.0 and g[1] == 0.0 and 0.0 < g[2] < 1e-6
    assert g[3] == pytest.approx(0.5 * 1.2 - 0.1, abs=1e-15)
    assert 1 - 1e-6 < g[4] < 1.0 and g[5] == 1.0 and g[6] == 1.0


def test_gate_derivatives_match_finite_differences():
    la = LOG_ALPHAS
    np.testing.assert_allclose(
        hard_concrete_eval_gate_grad(la), _fd(hard_concrete_eval_gate, la), rtol=1e-6, atol=1e-9
    )
    u = np.array([0.05, 0.3, 0.5, 0.5, 0.7, 0.2, 0.9])
    np.testing.assert_allclose(
        hard_concrete_sample_grad(la, u), _fd(lambda a: hard_concrete_sample(a, u), la), rtol=1e-6, atol=1e-9
    )


def test_cdf_atoms_and_open_probability():
    low, high, T = -0.1, 1.1, 0.33
    la = LOG_ALPHAS
    p_zero = hard_concrete_cdf(0.0, la)
    np.testing.assert_allclose(p_zero, 1 / (1 + np.exp(-(T * math.log(-low / high) - la))), rtol=1e-13)
    np.testing.assert_allclose(open_probability(la), np.clip(1 - p_zero, 1e-6, 1 - 1e-6), rtol=1e-12)
    # with the defaults T ln(0.1/1.1) = -0.79131...
    np.testing.assert_allclose(open_probability(0.0), 1 / (1 + math.exp(-0.79131)), rtol=1e-5)
    assert np.all(hard_concrete_cdf(-1e-12, la) == 0.0) and np.all(hard_concrete_cdf(1.0, la) == 1.0)
    x = np.linspace(0, 0.999, 50)[:, None]
    assert np.all(np.diff(hard_concrete_cdf(x, la), axis=0) >= 0)


def test_cdf_is_the_distribution_of_the_noise_transform():
    """P(g <= x) = P(u <= u*(x)): the cdf equals the measure of the noise that
    maps at or below x, found by bisection on the (increasing) sample map."""
    la = LOG_ALPHAS
    for x in (0.0, 0.1, 0.5, 0.93):
        lo, hi = np.zeros_like(la), np.ones_like(la)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            below = hard_concrete_sample(la, mid) <= x
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        np.testing.assert_allclose(hard_concrete_cdf(x, la), lo, atol=1e-12)


def test_mean_equals_the_integral_over_the_noise():
    n = 400_000
    u = (np.arange(n) + 0.5) / n  # midpoint rule on (0, 1)
    direct = hard_concrete_sample(LOG_ALPHAS[None, :], u[:, None]).mean(axis=0)
    np.testing.assert_allclose(hard_concrete_mean(LOG_ALPHAS), direct, atol=2e-6)


def test_mean_is_not_the_eval_gate():
    """The official test-time gate drops the temperature: it is not E[g]."""
    assert abs(hard_concrete_mean(np.array([1.0]))[0] - hard_concrete_eval_gate(1.0)) > 1e-2


def test_l0_penalty_value_and_gradient():
    la = LOG_ALPHAS
    value, grad = l0_penalty(la, coef=0.7)
    assert value == pytest.approx(0.7 * open_probability(la).sum(), rel=1e-14)
    fd = np.array([_fd(lambda a, i=i: l0_penalty(np.where(np.arange(la.size) == i, a, la), coef=0.7)[0], la[i])
                   for i in range(la.size)])  # fmt: skip
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-10)
    # clipped at eps: no gradient and never exactly 0 or H
    value, grad = l0_penalty(np.array([-40.0, 40.0]))
    assert value == pytest.approx(1.0) and np.all(grad == 0.0)


def test_gated_attention_with_unit_gates_equals_textbook_heads(seed):
    rng = seed
    B, N, C, H = 2, 7, 10, 2
    d = C // H
    x = rng.standard_normal((B, N, C))
    Wq, Wk, Wv, Wo = (rng.standard_normal((C, C)) for _ in range(4))
    gates = np.array([1.0, 0.37])
    out, weights = gated_multihead_attention(x, x, Wq, Wk, Wv, Wo, gates, num_heads=H, is_causal=True)
    # textbook heads take (in, out) matrices; scaling Wp's rows of head 1 gates head 1
    Wp = Wo.T.copy()
    Wp[d:] *= gates[1]
    want = multihead_attention_list(
        x, [Wq[h * d : (h + 1) * d].T for h in range(H)], [Wk[h * d : (h + 1) * d].T for h in range(H)],
        [Wv[h * d : (h + 1) * d].T for h in range(H)], Wp, do_mask=True,
    )  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(weights.sum(-1), np.broadcast_to(gates[None, :, None], (B, H, N)), atol=1e-12)


def test_closed_head_is_the_same_as_removing_it(seed):
    rng = seed
    B, T, S, C, H = 2, 3, 5, 8, 4
    d = C // H
    xq, xkv = rng.standard_normal((B, T, C)), rng.standard_normal((B, S, C))
    Wq, Wk, Wv, Wo = (rng.standard_normal((C, C)) for _ in range(4))
    gates = np.array([0.4, 0.0, 1.0, 0.8])
    out, _ = gated_multihead_attention(xq, xkv, Wq, Wk, Wv, Wo, gates, num_heads=H)
    keep = np.r_[0:d, 2 * d : C]  # drop head 1's rows of W_q/W_k/W_v and columns of W_o
    small, _ = gated_multihead_attention(
        xq, xkv, Wq[keep], Wk[keep], Wv[keep], Wo[:, keep], gates[[0, 2, 3]], num_heads=H - 1
    )
    np.testing.assert_allclose(out, small, atol=1e-12)
