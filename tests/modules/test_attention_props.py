"""MultiHeadAttention gradients (gradcheck, math vs sdpa) and hypothesis
properties: head-permutation invariance, token-permutation equivariance,
causality, masked-value invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.modules import random_module as _module
from support.properties import derandomized, examples

from multihead import MultiHeadAttention

F64 = torch.float64
BACKENDS = ["math", "sdpa"]
PROPS = settings(max_examples=examples(25), deadline=None, derandomize=derandomized())






# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("masks", ["none", "causal", "padding+causal_br"])
def test_gradcheck_inputs_tiny_gqa(backend, contiguous, masks):
    m = _module(embed_dim=6, num_heads=3, num_kv_heads=1)
    g = torch.Generator().manual_seed(1)
    if contiguous:
        q = torch.randn(2, 3, 6, generator=g, dtype=F64)
        k = torch.randn(2, 4, 6, generator=g, dtype=F64)
    else:
        q = torch.randn(3, 2, 6, generator=g, dtype=F64).transpose(0, 1)
        k = torch.randn(2, 4, 12, generator=g, dtype=F64)[..., ::2]
    v = torch.randn(2, 4, 6, generator=g, dtype=F64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = {}
    if masks == "causal":
        kw = {"is_causal": True}
    elif masks != "none":
        kw = {"key_mask": torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool),
                  "is_causal": True, "causal_alignment": "bottom_right"}
    full = masks == "padding+causal_br" and contiguous  # one slow exhaustive check per backend
    assert torch.autograd.gradcheck(lambda a, b, c: m(a, b, c, backend=backend, **kw), (q, k, v), fast_mode=not full)
    x = q.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: m(a, backend=backend, is_causal=True), (x,), fast_mode=True)


def test_gradcheck_with_a_fully_masked_row_has_zero_gradient():
    m = _module(embed_dim=6, num_heads=3, num_kv_heads=1)
    q = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    k = torch.randn(2, 4, 6, dtype=F64, requires_grad=True)
    kpm = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    for backend in BACKENDS:
        def fn(a, b, backend=backend):
            return m(a, b, key_mask=kpm, backend=backend)

        assert torch.autograd.gradcheck(fn, (q, k), fast_mode=True)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("cross", [False, True])
def test_parameter_grads_math_and_sdpa_agree(num_kv_heads, cross):
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=num_kv_heads)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 12, generator=g, dtype=F64)
    key = torch.randn(3, 7, 12, generator=g, dtype=F64) if cross else None
    S = 7 if cross else 5
    kpm = torch.rand(3, S, generator=g) > 0.3
    kpm[2] = False  # one fully padded row
    attn = torch.randn(5, S, generator=g, dtype=F64)
    grads, outs = {}, {}
    for backend in BACKENDS:
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = m(xi, key, attn_mask=attn, key_mask=kpm, is_causal=True,
                causal_alignment="bottom_right", backend=backend)
        (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum().backward()
        outs[backend] = out.detach()
        grads[backend] = [xi.grad] + [p.grad.clone() for p in m.parameters()]
    torch.testing.assert_close(outs["math"], outs["sdpa"], rtol=0, atol=1e-10)
    for a, b in zip(grads["math"], grads["sdpa"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- properties
def _permute_heads(m: MultiHeadAttention, perm: torch.Tensor) -> MultiHeadAttention:
    """A copy with heads reordered: q/k/v rows per head and out_proj columns."""
    H, D = m.num_heads, m.head_dim
    assert m.num_kv_heads == H
    new = _module(seed=99, embed_dim=m.embed_dim, num_heads=H, head_dim=D)
    rows = (perm[:, None] * D + torch.arange(D)).reshape(-1)  # head-major row indices
    w = m.projection_weights()
    with torch.no_grad():
        new.qkv_proj.weight.copy_(torch.cat([w[n][0][rows] for n in "qkv"]))
        new.qkv_proj.bias.copy_(torch.cat([w[n][1][rows] for n in "qkv"]))
        new.out_proj.weight.copy_(m.out_proj.weight[:, rows])
        new.out_proj.bias.copy_(m.out_proj.bias)
    return new


@PROPS
@given(
    H=st.integers(1, 5),
    D=st.integers(1, 4),
    T=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
    padded=st.booleans(),
)
def test_head_permutation_invariance(H, D, T, seed, causal, padded):
    g = torch.Generator().manual_seed(seed)
    m = _module(seed=seed, embed_dim=5, num_heads=H, head_dim=D)
    perm = torch.randperm(H, generator=g)
    p = _permute_heads(m, perm)
    x = torch.randn(2, T, 5, generator=g, dtype=F64)
    kpm = (torch.rand(2, T, generator=g) > 0.3) if padded else None
    out, w = m(x, key_mask=kpm, is_causal=causal, return_weights=True)
    out_p, w_p = p(x, key_mask=kpm, is_causal=causal, return_weights=True)
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_p, w[:, perm], rtol=0, atol=1e-14)
    out_sdpa = p(x, key_mask=kpm, is_causal=causal, backend="sdpa")
    torch.testing.assert_close(out_sdpa, out, rtol=0, atol=1e-12)


@PROPS
@given(T=st.integers(1, 6), S=st.integers(1, 6), G=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_key_permutation_invariance_and_query_equivariance(T, S, G, seed):
    """Without a mask, permuting queries permutes outputs; permuting key/value
    pairs together changes nothing."""
    g = torch.Generator().manual_seed(seed)
    m = _module(seed=seed, embed_dim=8, num_heads=4, num_kv_heads=G, kdim=3, vdim=5)
    x, k, v = (torch.randn(2, n, c, generator=g, dtype=F64) for n, c in ((T, 8), (S, 3), (S, 5)))
    pq, pk = torch.randperm(T, generator=g), torch.randperm(S, generator=g)
    out = m(x, k, v)
    torch.testing.assert_close(m(x[:, pq], k[:, pk], v[:, pk]), out[:, pq], rtol=0, atol=1e-12)


@PROPS
@given(T=st.integers(1, 7), extra=st.integers(1, 4), G=st.sampled_from([1, 3]), seed=st.integers(0, 2**16),
       backend=st.sampled_from(BACKENDS))
def test_causality_appending_tokens_leaves_earlier_outputs(T, extra, G, seed, backend):
    g = torch.Generator().manual_seed(seed)
    m = _module(seed=seed, embed_dim=6, num_heads=3, num_kv_heads=G)
    x = torch.randn(2, T + extra, 6, generator=g, dtype=F64)
    torch.testing.assert_close(m(x, is_causal=True, backend=backend)[:, :T],
                               m(x[:, :T], is_causal=True, backend=backend), rtol=0, atol=1e-12)


@PROPS
@given(S=st.integers(2, 7), seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS),
       junk=st.sampled_from([0.0, 1e6, float("nan"), float("inf")]))
def test_masked_value_invariance(S, seed, backend, junk):
    g = torch.Generator().manual_seed(seed)
    m = _module(seed=seed, embed_dim=6, num_heads=2, num_kv_heads=1)
    x, key = torch.randn(2, 3, 6, generator=g, dtype=F64), torch.randn(2, S, 6, generator=g, dtype=F64)
    keep = torch.rand(2, S, generator=g) > 0.5
    want = m(x, key, key_mask=keep, backend=backend)
    changed = torch.where(keep[..., None], key, torch.full_like(key, junk))
    torch.testing.assert_close(m(x, changed, key_mask=keep, backend=backend), want, rtol=0, atol=1e-12)
