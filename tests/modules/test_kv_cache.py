"""KVCache and MultiHeadAttention decoding: cached equals full recomputation."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.modules import random_module
from support.properties import derandomized, examples

from multihead import KVCache, MultiHeadAttention

F64 = torch.float64
TOL = 1e-12
BACKENDS = ["math", "sdpa"]
HEADS = {"mha": None, "gqa": 2, "mqa": 1}


def _module(seed: int = 0, num_kv_heads: int | None = None, **kwargs) -> MultiHeadAttention:
    return random_module(seed, **{"embed_dim": 12, "num_heads": 4, "num_kv_heads": num_kv_heads, **kwargs})


def _decode(m, x, chunks, cache, backend="auto", keep=None):
    """Feed x (B, L, C) through the cache in chunks; return the concatenated outputs."""
    outs, start, base = [], 0, cache.length
    for n in chunks:
        kpm = None if keep is None else keep[:, : base + start + n]  # padding mask over the cache length
        outs.append(m(x[:, start:start + n], is_causal=True, kv_cache=cache, key_mask=kpm, backend=backend))
        start += n
        assert cache.length == base + start
    return torch.cat(outs, dim=1)


SCHEDULES = {
    "prefill_then_1": [4, 1, 1, 1, 1, 1, 1],
    "prefill_then_2_3": [3, 2, 3, 2],
    "one_by_one": [1] * 10,
    "single_prefill": [10],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_cached_decoding_equals_full_causal_recomputation(heads, schedule, backend):
    m = _module(num_kv_heads=HEADS[heads])
    x = torch.randn(2, 10, 12, dtype=F64)
    full = m(x, is_causal=True, backend=backend)
    cache = m.make_kv_cache(2, 16)
    torch.testing.assert_close(_decode(m, x, SCHEDULES[schedule], cache, backend), full, rtol=0, atol=TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", list(HEADS))
def test_left_padded_decoding_equals_recomputation(heads, backend):
    m = _module(num_kv_heads=HEADS[heads])
    x = torch.randn(3, 9, 12, dtype=F64)
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1, :2] = False  # two pad tokens on the left
    keep[2, :4] = False
    full = m(x, is_causal=True, key_mask=keep, backend=backend)
    assert not full.isnan().any()
    # pad queries see only pad keys: zeros before out_proj
    torch.testing.assert_close(full[2, :4], m.out_proj.bias.expand(4, 12), rtol=0, atol=0)
    for chunks in ([5, 1, 1, 1, 1], [4, 2, 3]):
        cache = m.make_kv_cache(3, 9)
        torch.testing.assert_close(_decode(m, x, chunks, cache, backend, keep), full, rtol=0, atol=TOL)


@pytest.mark.parametrize("heads", list(HEADS))
def test_cache_buffers_are_sized_by_kv_heads_and_not_persistent(heads):
    m = _module(num_kv_heads=HEADS[heads], head_dim=5)
    G = m.num_kv_heads
    cache = m.make_kv_cache(3, 11)
    assert cache.k.shape == (3, G, 11, 5) and cache.v.shape == (3, G, 11, 5)
    assert cache.k.dtype == F64 and cache.length == 0 and cache.max_len == 11
    assert cache.state_dict() == {}
    assert {n for n, _ in cache.named_buffers()} == {"k", "v"}
    m.cache = cache  # registered as a submodule: still not in the layer's state_dict
    assert not any("cache" in k for k in m.state_dict())
    del m.cache
    assert m.make_kv_cache(1, 2, dtype=torch.float32).k.dtype == torch.float32


def test_cached_keys_are_the_projected_keys_and_detached():
    m = _module(num_kv_heads=2)
    x = torch.randn(2, 5, 12, dtype=F64, requires_grad=True)
    cache = m.make_kv_cache(2, 8)
    out = m(x, is_causal=True, kv_cache=cache)
    _, k, v = m.project(x)
    # the same projection of the same 5 tokens: bitwise
    torch.testing.assert_close(cache.k[:, :, :5], k.detach(), rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, :, :5], v.detach(), rtol=0, atol=0)
    assert not cache.k.requires_grad and not cache.v.requires_grad
    out.sum().backward()  # gradients still reach the current step's inputs
    assert x.grad is not None and x.grad.any()


@pytest.mark.parametrize("through_module", [True, False])
def test_overflow_raises_before_any_write_and_capacity_is_usable(through_module):
    m = _module(num_kv_heads=2)
    x = torch.randn(2, 7, 12, dtype=F64)
    cache = m.make_kv_cache(2, 6)
    cache.k.fill_(7.0)  # sentinels: no write at all, not even past the cached length
    cache.v.fill_(-7.0)
    m(x[:, :4], is_causal=True, kv_cache=cache)
    k0, v0 = cache.k.clone(), cache.v.clone()
    msg = re.escape("KV cache overflow: 4 cached + 3 new = 7 > max_len 6")
    with pytest.raises(ValueError, match=msg):
        if through_module:
            m(x[:, 4:7], is_causal=True, kv_cache=cache)
        else:
            _, k, v = m.project(x[:, 4:7])
            cache.update(k, v)
    assert cache.length == 4 and torch.equal(cache.k, k0) and torch.equal(cache.v, v0)
    out = m(x[:, 4:6], is_causal=True, kv_cache=cache)  # exactly at capacity
    assert cache.length == 6
    torch.testing.assert_close(out, m(x[:, :6], is_causal=True)[:, 4:6], rtol=0, atol=TOL)
    with pytest.raises(ValueError, match=re.escape("6 cached + 1 new = 7 > max_len 6")):
        m(x[:, 6:7], is_causal=True, kv_cache=cache)
    assert cache.length == 6


def test_refused_call_leaves_the_cache_length_unchanged():
    """A call that fails after projection (bad mask, backend refusal) must not
    leave the cache advanced: the next step would see a ghost token."""
    m = _module()
    x = torch.randn(2, 6, 12, dtype=F64)
    cache = m.make_kv_cache(2, 8)
    m(x[:, :3], is_causal=True, kv_cache=cache)
    bad_calls = [
        {"key_mask": torch.ones(2, 3, dtype=torch.bool)},  # should be (2, 4)
        {"attn_mask": torch.ones(1, 3, dtype=torch.bool)},  # should be (1, 4)
        {"return_weights": True, "backend": "sdpa"},
        {"causal_alignment": "middle"},
    ]
    for kwargs in bad_calls:
        with pytest.raises(ValueError):
            m(x[:, 3:4], is_causal=True, kv_cache=cache, **kwargs)
        assert cache.length == 3, kwargs
    out = _decode(m, x[:, 3:], [1, 2], cache)
    torch.testing.assert_close(out, m(x, is_causal=True)[:, 3:], rtol=0, atol=TOL)


def test_reset_forgets_and_reuses_buffers():
    m = _module(num_kv_heads=1)
    a, b = torch.randn(2, 5, 12, dtype=F64), torch.randn(2, 5, 12, dtype=F64)
    cache = m.make_kv_cache(2, 5)
    _decode(m, a, [3, 2], cache)
    buf = cache.k.data_ptr()
    cache.reset()
    assert cache.length == 0 and cache.k.data_ptr() == buf
    torch.testing.assert_close(_decode(m, b, [2, 1, 2], cache), m(b, is_causal=True), rtol=0, atol=TOL)


@pytest.mark.parametrize("k_shape,v_shape", [
    ((3, 2, 1, 4), (3, 2, 1, 4)),  # batch
    ((2, 4, 1, 4), (2, 4, 1, 4)),  # H instead of G heads
    ((2, 2, 1, 5), (2, 2, 1, 4)),  # key head dim
    ((2, 2, 1, 4), (2, 2, 1, 3)),  # value head dim
    ((2, 2, 1, 4), (2, 2, 2, 4)),  # T differs
    ((2, 1, 4), (2, 1, 4)),  # rank
])
def test_update_shape_mismatch_raises(k_shape, v_shape):
    cache = KVCache(2, 2, 8, 4, dtype=F64)
    with pytest.raises(ValueError, match=re.escape(f"k={k_shape}, v={v_shape}")):
        cache.update(torch.zeros(k_shape, dtype=F64), torch.zeros(v_shape, dtype=F64))
    assert cache.length == 0


def test_value_dim_and_constructor_validation():
    cache = KVCache(1, 2, 4, 3, value_dim=5)
    assert cache.v.shape == (1, 2, 4, 5) and "max_len=4" in repr(cache)
    k, v = cache.update(torch.ones(1, 2, 2, 3), torch.ones(1, 2, 2, 5))
    assert k.shape == (1, 2, 2, 3) and v.shape == (1, 2, 2, 5)
    for kwargs, name, error in (({"batch_size": 0}, "batch_size", ValueError),
                                ({"num_kv_heads": -1}, "num_kv_heads", ValueError),
                                ({"max_len": 0}, "max_len", ValueError), ({"head_dim": 2.0}, "head_dim", TypeError),
                                ({"value_dim": 0}, "value_dim", ValueError), ({"max_len": True}, "max_len", TypeError)):
        args = {"batch_size": 1, "num_kv_heads": 1, "max_len": 4, "head_dim": 2, **kwargs}
        with pytest.raises(error, match=f"{name} must be a positive int, got {name}="):
            KVCache(**args)


def test_module_level_cache_errors():
    m = _module(num_kv_heads=2)
    x = torch.randn(2, 3, 12, dtype=F64)
    cache = m.make_kv_cache(2, 8)
    m(x, kv_cache=cache)  # a self-attention cache refuses cross-attention keys
    with pytest.raises(ValueError, match="self-attention positions"):
        m(x, x, kv_cache=cache)
    with pytest.raises(ValueError, match="self-attention positions"):
        m(x, x, x, kv_cache=cache)
    cache.reset()
    with pytest.raises(ValueError, match=re.escape("got k=(3, 2, 3, 3)")):
        m(torch.randn(3, 3, 12, dtype=F64), kv_cache=cache)  # batch 3, cache batch 2
    wrong = _module(num_kv_heads=1).make_kv_cache(2, 8)  # G = 1 cache, G = 2 layer
    with pytest.raises(ValueError, match=re.escape("cache holds k (B=2, G=1, D=3)")):
        m(x, kv_cache=wrong)
    assert cache.length == 0 and wrong.length == 0


def test_cache_without_is_causal_and_explicit_alignment():
    """With a cache the default alignment is bottom-right; a prefill of T
    tokens without is_causal sees everything, like the uncached call."""
    m = _module()
    x = torch.randn(2, 6, 12, dtype=F64)
    cache = m.make_kv_cache(2, 6)
    torch.testing.assert_close(m(x[:, :4], kv_cache=cache), m(x[:, :4]), rtol=0, atol=TOL)
    # top-left on purpose with a cache: the 2 new queries see only keys 0 and 0..1
    got = m(x[:, 4:], kv_cache=cache, is_causal=True, causal_alignment="top_left", backend="math")
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[4], mask[5] = torch.arange(6) < 1, torch.arange(6) < 2
    torch.testing.assert_close(got, m(x, attn_mask=mask)[:, 4:], rtol=0, atol=TOL)


@settings(max_examples=examples(30), deadline=None, derandomize=derandomized())
@given(
    heads=st.sampled_from(list(HEADS)),
    splits=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    B=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(BACKENDS),
    padded=st.booleans(),
)
def test_cached_equals_uncached_for_random_split_points(heads, splits, B, seed, backend, padded):
    L = sum(splits)
    g = torch.Generator().manual_seed(seed)
    m = _module(seed=seed, num_kv_heads=HEADS[heads], embed_dim=8, head_dim=3)
    x = torch.randn(B, L, 8, generator=g, dtype=F64)
    keep = None
    if padded:
        lengths = torch.randint(0, L + 1, (B,), generator=g)
        keep = torch.arange(L)[None, :] >= (L - lengths)[:, None]  # left padding
    full = m(x, is_causal=True, key_mask=keep, backend=backend)
    cache = m.make_kv_cache(B, L + int(torch.randint(0, 3, (), generator=g)))
    torch.testing.assert_close(_decode(m, x, splits, cache, backend, keep), full, rtol=0, atol=TOL)
