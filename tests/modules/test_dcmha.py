"""DCMHA and Talking-Heads modules against the NumPy reference, chunking, cache, cost."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_paths_agree
from torch.utils.flop_counter import FlopCounterMode

from multihead.modules.kinds.dcmha import DCMHA, TalkingHeadsAttention
from multihead.modules.kv_cache import DynamicKVCache
from multihead.modules.registry import build_attention
from multihead.reference.dcmha import dcmha_attention, talking_heads_attention

F64 = torch.float64


def make(kind="dcmha", seed=0, C=15, H=3, **opts):
    torch.manual_seed(seed)
    cls = DCMHA if kind == "dcmha" else TalkingHeadsAttention
    m = cls(C, H, dtype=F64, **opts)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def n(t):
    return None if t is None else t.detach().numpy()


def reference(m, x, key=None, mask=None, **kw):
    key = x if key is None else key
    q, k, v = m.project(x, key)
    if m.dynamic:
        out, w = dcmha_attention(n(x), n(key), n(q), n(k), n(v), n(m.dw1), n(m.qkw), n(m.dd),
                                 n(getattr(m, "pre_static", None)), n(getattr(m, "post_static", None)),
                                 mask=n(mask), **kw)  # fmt: skip
    else:
        out, w = talking_heads_attention(n(q), n(k), n(v), n(m.pre_static), n(m.post_static), mask=n(mask), **kw)
    B, H, T, D = out.shape
    out = torch.from_numpy(out).transpose(1, 2).reshape(B, T, H * D)
    return m.out_proj(out), torch.from_numpy(w)


def close(a, b, tol=1e-10):
    a, b = a.detach(), b.detach()
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale


@pytest.mark.parametrize("kind", ["dcmha", "talking_heads"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [None, 2, 3])
def test_matches_reference_outputs_and_weights(kind, causal, chunk):
    m = make(kind, chunk_size=chunk)
    x = torch.randn(2, 7, 15, dtype=F64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, :2] = False  # left padding in row 1
    out, w = m(x, is_causal=causal, key_mask=keep, return_weights=True)
    ref_out, ref_w = reference(m, x, mask=keep[:, None, None, :], is_causal=causal)
    close(w, ref_w)
    close(out, ref_out)


def test_gradients_are_chunk_invariant_and_outputs_match_reference():
    x = torch.randn(2, 7, 15, dtype=F64)
    grads = []
    for chunk in (1, 3, 100):
        m = make(chunk_size=chunk)
        xi = x.clone().requires_grad_(True)
        out = m(xi, is_causal=True)
        out.square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            close(a, b)
    # the reference path (torch autograd through the same pieces in one block) agrees too
    m = make()
    xi = x.clone().requires_grad_(True)
    ref_out, _ = reference(m, xi, is_causal=True)
    out = m(xi, is_causal=True)
    close(out, ref_out)


def test_chunked_equals_unchunked_with_cross_attention_and_float_mask():
    m = make(C=10, H=2)
    x, mem = torch.randn(2, 9, 10, dtype=F64), torch.randn(2, 5, 10, dtype=F64)
    bias = torch.randn(9, 5, dtype=F64)
    bias[3, :] = float("-inf")  # a row that sees nothing
    m.chunk_size = 4
    a, wa = m(x, mem, attn_mask=bias, return_weights=True)
    m.chunk_size = 9
    b, wb = m(x, mem, attn_mask=bias, return_weights=True)
    close(a, b)
    close(wa, wb)
    assert torch.all(wa[:, :, 3] == 0)
    ref_out, ref_w = reference(m, x, mem, mask=bias)
    close(a, ref_out)
    close(wa, ref_w)


def test_bottom_right_causal_chunks_and_auto_chunk():
    m = make(C=10, H=2, chunk_size=2)
    x = torch.randn(1, 5, 10, dtype=F64)
    mem = torch.randn(1, 8, 10, dtype=F64)
    out, w = m(x, mem, is_causal=True, causal_alignment="bottom_right", return_weights=True)
    ref_out, ref_w = reference(m, x, mem, is_causal=True, causal_alignment="bottom_right")
    close(out, ref_out)
    close(w, ref_w)
    auto = make(C=10, H=2)
    assert auto._chunk(300) == 256 and auto._chunk(7) == 7


def test_gradcheck_tiny():
    m = make(C=6, H=2, chunk_size=2)
    x = torch.randn(1, 3, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True), (x,))


@pytest.mark.parametrize("kind", ["dcmha", "talking_heads"])
def test_cached_decoding_equals_recomputation(kind):
    m = make(kind, C=10, H=2)
    x = torch.randn(2, 6, 10, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 8)
    assert isinstance(cache, DynamicKVCache) == (kind == "dcmha")
    parts = [m(x[:, :3], is_causal=True, kv_cache=cache)]
    parts += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 6)]
    close(torch.cat(parts, dim=1), full)
    with pytest.raises(ValueError, match="overflow"):
        m(torch.randn(2, 3, 10, dtype=F64), is_causal=True, kv_cache=cache)
    assert cache.length == 6


@pytest.mark.parametrize("kind", ["dcmha", "talking_heads"])
def test_cost_matches_parameter_count_and_flop_counter(kind):
    m = build_attention(kind, embed_dim=12, num_heads=4)
    cost = m.cost(9, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters())
    with FlopCounterMode(display=False) as counter:
        m(torch.randn(2, 9, 12), backend="math")
    assert cost.total_flops == counter.get_total_flops()
    per_token = 2 * 4 * 3 + (2 * 5 * 4 if kind == "dcmha" else 0)
    assert cost.kv_cache_bytes_per_token == per_token * 2
    causal = m.cost(8, causal=True)
    assert causal.core_flops * 64 == m.cost(8).core_flops * 36


def test_observer_receives_composed_weights():
    m = make(C=10, H=2)
    events = []
    handle = m.register_attention_observer(lambda mod, e: events.append(e))
    x = torch.randn(1, 5, 10, dtype=F64)
    _, w = m(x, is_causal=True, return_weights=True)
    handle.remove()
    (e,) = events
    assert e.kind == "dcmha" and torch.equal(e.weights, w.detach())
    # the weights are the post-composed P' that mix the values: P' v merged = output
    q, k, v = m.project(x)
    close(m.merge_heads(e.weights @ v), m(x, is_causal=True))
    assert not torch.allclose(e.weights.sum(-1), torch.ones(1, 2, 5, dtype=F64))  # not renormalised


def test_masked_nan_values_do_not_leak():
    m = make(C=10, H=2)
    x = torch.randn(1, 4, 10, dtype=F64)
    mem = torch.randn(1, 5, 10, dtype=F64)
    keep = torch.tensor([[True, True, True, False, False]])
    a = m(x, mem, key_mask=keep)
    mem2 = mem.clone()
    mem2[0, 3:] = float("nan")
    b = m(x, mem2, key_mask=keep)
    close(a, b)


def test_errors():
    with pytest.raises(ValueError, match="num_heads"):
        DCMHA(10, 3)
    with pytest.raises(ValueError, match="chunk_size"):
        DCMHA(8, 2, chunk_size=0)
    with pytest.raises(ValueError, match="dropout"):
        DCMHA(8, 2, dropout=1.0)
    with pytest.raises(ValueError, match="nothing to compose"):
        DCMHA(8, 2, dynamic=False, static=False)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_attention("dcmha", embed_dim=8, num_heads=2, num_kv_heads=1)
    with pytest.raises(TypeError, match="TalkingHeadsAttention does not take dynamic"):
        TalkingHeadsAttention(8, 2, dynamic=True)
    m = DCMHA(8, 2)
    with pytest.raises(ValueError, match="sdpa"):
        m(torch.randn(1, 3, 8), backend="sdpa")
    with pytest.raises(ValueError, match=r"\(B, T, 8\)"):
        m(torch.randn(1, 3, 7))


@pytest.mark.parametrize("kind", ["dcmha", "talking_heads"])
def test_gpt_generates_cached_equals_uncached(kind):
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention=kind, attention_options={"chunk_size": 3})).eval()
    idx = torch.randint(0, 256, (2, 5))
    a = assert_cached_generation_agrees(model, idx, 6)
    assert np.all(a[:, :5].numpy() == idx.numpy())


def test_dynamic_only_cost_matches_the_flop_counter():
    """catches: static composition counted for a layer without it."""
    from torch.utils.flop_counter import FlopCounterMode

    m = DCMHA(16, 4, static=False).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        m(x, backend="math")
    assert counter.get_total_flops() == m.cost(5, batch=2).total_flops


def test_initial_weights_have_the_official_scales():
    """catches: other initial scales of the composition weights (the official code's: std
    sqrt(2 / (C + K)), 0.02 / (sqrt(4H) (H + 2)) and 0.05 sqrt(2 / (H + C)))."""
    torch.manual_seed(0)
    C, H = 256, 8
    m = DCMHA(C, H)
    K = m.dw1.shape[-1]
    for weight, std in ((m.dw1, math.sqrt(2 / (C + K))), (m.qkw, 0.02 / (math.sqrt(4 * H) * (H + 2))),
                        (m.dd, 0.05 * math.sqrt(2 / (H + C)))):  # fmt: skip
        assert abs(float(weight.std()) / std - 1) < 0.1, (tuple(weight.shape), float(weight.std()), std)


def test_dropout_acts_in_training_only_and_an_empty_query_gives_an_empty_output():
    """catches: the composed weights never dropped; a T = 0 call with a row of output."""
    torch.manual_seed(0)
    m = DCMHA(16, 4, dropout=0.5).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    kept = m.eval()(x)
    assert not torch.allclose(m.train()(x), kept)  # half the weights dropped (and the rest doubled)
    assert_paths_agree(m.eval()(x), kept)  # eval: no dropout
    assert m(torch.randn(2, 0, 16, dtype=torch.float64)).shape == (2, 0, 16)
