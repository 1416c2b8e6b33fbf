"""The NumPy MoH reference: gate algebra, routers, load balance, special cases."""

from __future__ import annotations

import numpy as np
import pytest

from multihead.reference import attention
from multihead.reference.moh import (
    moh_attention,
    moh_learned_gates,
    moh_load_balancing_loss,
    moh_query_norm_gates,
)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_learned_gates_algebra(rng):
    B, N, C, hs, E, hr = 2, 5, 6, 3, 4, 2
    x = rng.standard_normal((B, N, C))
    W_g, W_g0, W_g1 = (rng.standard_normal(s) for s in ((E, C), (2, C), (hs, C)))
    gates, p, sel = moh_learned_gates(x, W_g, W_g0, W_g1, hs, hr)
    assert gates.shape == (B, N, hs + E) and p.shape == sel.shape == (B, N, E)
    np.testing.assert_allclose(p.sum(-1), 1.0)
    assert (sel.sum(-1) == hr).all()
    assert ((gates[..., hs:] != 0) == sel).all()
    for b in range(B):
        for n in range(N):
            w = np.exp(W_g0 @ x[b, n])
            w = 2 * w / w.sum()
            # shared gates sum to w0·hs, routed gates to w1·hr
            np.testing.assert_allclose(gates[b, n, :hs].sum(), w[0] * hs)
            np.testing.assert_allclose(gates[b, n, hs:].sum(), w[1] * hr)
            # the chosen heads are the hr most probable
            assert set(np.flatnonzero(sel[b, n])) == set(np.argsort(p[b, n])[-hr:])


def test_gate_special_cases(rng):
    x = rng.standard_normal((1, 3, 4))
    # all heads routed: gates are the renormalised top-k times hr
    gates, p, _ = moh_learned_gates(x, rng.standard_normal((3, 4)), None, None, 0, 3)
    np.testing.assert_allclose(gates, 3 * p)
    # hs = 1: a constant shared gate of 1 mixed by w0
    gates, _, _ = moh_learned_gates(x, rng.standard_normal((2, 4)), rng.standard_normal((2, 4)), None, 1, 1)
    assert (gates[..., 0] > 0).all() and (gates[..., 0] < 2).all()
    # hr = 0: a softmax over all (shared) heads scaled by H
    W_g1 = rng.standard_normal((3, 4))
    gates, p, sel = moh_learned_gates(x, None, None, W_g1, 3, 0)
    assert p is None and sel is None
    np.testing.assert_allclose(gates.sum(-1), 3.0)


def test_query_norm_router_picks_the_largest_norms(rng):
    q = rng.standard_normal((2, 6, 4, 3))
    gates, sel = moh_query_norm_gates(q, 2, 2)
    assert set(np.unique(gates)) == {0.0, 1.0}
    assert (gates[..., :2] == 1).all() and (sel.sum(-1) == 2).all()
    norms = np.linalg.norm(q[:, 2:], axis=-1).transpose(0, 2, 1)  # (B, E, N) -> (B, N, E)
    top = np.sort(np.argsort(-norms, axis=-1)[..., :2], axis=-1)  # (B, N, 2)
    assert (top == np.argwhere(sel)[:, 2].reshape(2, 4, 2)).all()
    # equal norms: no 0/0, still hr heads chosen
    gates, sel = moh_query_norm_gates(np.ones((1, 4, 1, 2)), 1, 2)
    assert np.isfinite(gates).all() and sel.sum() == 2


def test_load_balancing_loss():
    E = 4
    uniform = np.full((8, E), 1 / E)
    balanced = np.eye(E, dtype=bool)[np.arange(8) % E]
    assert moh_load_balancing_loss(uniform, balanced) == pytest.approx(1.0)
    # everything on one head with all probability there: E
    p = np.zeros((8, E))
    p[:, 0] = 1
    assert moh_load_balancing_loss(p, p.astype(bool)) == pytest.approx(E)


def test_all_ones_gates_are_plain_attention(rng):
    """query_norm router with every head shared: gates are 1, the output is plain MHA."""
    B, N, C, H, d = 2, 5, 8, 2, 4
    x = rng.standard_normal((B, N, C))
    W_qkv, b_qkv = rng.standard_normal((3 * H * d, C)), rng.standard_normal(3 * H * d)
    W_o, b_o = rng.standard_normal((C, H * d)), rng.standard_normal(C)
    y, w = moh_attention(x, W_qkv, b_qkv, W_o, b_o, H, H, 0, router="query_norm", is_causal=True,
                         return_weights=True)
    qkv = x @ W_qkv.T + b_qkv
    q, k, v = (qkv[..., i * H * d:(i + 1) * H * d].reshape(B, N, H, d).transpose(0, 2, 1, 3) for i in range(3))
    o, a = attention(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_allclose(y, o.transpose(0, 2, 1, 3).reshape(B, N, H * d) @ W_o.T + b_o, atol=1e-12)
    np.testing.assert_allclose(w, a, atol=1e-15)


def test_weights_are_gate_times_probabilities(rng):
    B, N, C, H, d, hs, hr = 1, 4, 6, 3, 2, 1, 1
    x = rng.standard_normal((B, N, C))
    W_qkv, W_o = rng.standard_normal((3 * H * d, C)), rng.standard_normal((C, H * d))
    W_g, W_g0 = rng.standard_normal((2, C)), rng.standard_normal((2, C))
    y, w = moh_attention(x, W_qkv, None, W_o, None, H, hs, hr, W_g=W_g, W_g0=W_g0, return_weights=True)
    gates, _, _ = moh_learned_gates(x, W_g, W_g0, None, hs, hr)
    np.testing.assert_allclose(w.sum(-1), gates.transpose(0, 2, 1), atol=1e-12)  # rows sum to the gate
    assert ((w.sum(-1) == 0).sum(1) == H - hs - hr).all()  # one unselected routed head per token
