"""A local layer's ``window_cache``: it keeps the last ``window`` positions, a
prefill longer than the window then one-token steps give the full forward
(every kind, rope, ALiBi, a key mask over every position), its storage is
window-sized, and a call that fails leaves it as it was."""

from __future__ import annotations

import pytest
import torch
from support.kinds import F64, C, H, build
from support.paths import assert_paths_agree

from multihead import KVCache, WindowKVCache, build_attention, window_cache
from multihead.modules.kv_cache import DynamicKVCache, LatentKVCache
from multihead.modules.registry import list_attention_kinds
from multihead.modules.window_cache import WindowDynamicKVCache, WindowLatentKVCache, cached_positions


def _x(B=2, T=11, seed=1):
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _decode(m, x, cache, prefill, **kw):
    """The outputs of a prefill of ``prefill`` positions, then one position at a time."""
    T = x.shape[1]
    outs = [m(x[:, :prefill], is_causal=True, kv_cache=cache, **kw)]
    outs += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, **kw) for t in range(prefill, T)]
    return torch.cat(outs, 1)


WINDOWED = {KVCache: WindowKVCache, DynamicKVCache: WindowDynamicKVCache, LatentKVCache: WindowLatentKVCache}


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kind_decodes_a_long_prompt_with_its_window_cache(kind):
    """Prefill of 7 positions (window 3), then 4 steps: the full forward's outputs. Every
    registered kind's own cache (keys and values, DCMHA's key-side weights, MLA's latent
    rows) has a windowed class, which keeps the last 3 positions."""
    m = build(kind, window=3, rope=True)
    x = _x()
    cache = window_cache(m, 2, 11)
    assert type(cache) is WINDOWED[type(m.make_kv_cache(2, 11))] and cache.k.shape[2] == 0
    with torch.no_grad():
        got = _decode(m, x, cache, prefill=7)
        want = m(x, is_causal=True)
    assert_paths_agree(got, want)
    assert cache.length == 11 and cache.k.shape[2] == 3
    assert all(getattr(cache, name).shape[dim] == 3 for name, dim in cache._kept_dims.items())


def test_a_layer_without_a_window_gets_its_own_cache():
    m = build("gqa")
    cache = window_cache(m, 2, 9)
    assert type(cache) is KVCache and cache.k.shape[2] == 9
    assert cached_positions(m, 9) == 9 and cached_positions(build("gqa", window=4), 9) == 4
    assert cached_positions(build("gqa", window=4), 3) == 3
    mla = build("mla", window=4, decode="absorbed")
    assert isinstance(window_cache(mla, 1, 9), WindowLatentKVCache) and cached_positions(mla, 9) == 4
    assert isinstance(window_cache(build("mla", decode="absorbed"), 1, 9), LatentKVCache)


@pytest.mark.parametrize("positions", [{"rope": True}, {"alibi": True}, {}])
def test_cached_steps_equal_the_full_forward_with_positions_and_a_key_mask(positions):
    """ALiBi counts distances by key index: the kept keys stay in order, so the distances
    are the full cache's. The key mask spans every position written (left padding of
    row 1, longer than the window)."""
    torch.manual_seed(0)
    m = build_attention("gqa", embed_dim=C, num_heads=H, num_kv_heads=2, window=4, dtype=F64, **positions).eval()
    x = _x(T=12)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, :5] = False
    with torch.no_grad():
        want = m(x, is_causal=True, key_mask=key_mask)
        cache = window_cache(m, 2, 12)
        outs = [m(x[:, :6], is_causal=True, kv_cache=cache, key_mask=key_mask[:, :6])]
        for t in range(6, 12):
            outs.append(m(x[:, t : t + 1], is_causal=True, kv_cache=cache, key_mask=key_mask[:, : t + 1]))
    assert_paths_agree(torch.cat(outs, 1)[0], want[0])
    assert_paths_agree(torch.cat(outs, 1)[1, 5:], want[1, 5:])  # padded queries see nothing: not compared


@pytest.mark.parametrize("steps", [[1] * 10, [2, 5, 1, 2], [10]])
def test_the_cache_holds_the_last_window_positions_in_window_sized_storage(steps):
    torch.manual_seed(0)
    m = build_attention("gqa", embed_dim=C, num_heads=H, num_kv_heads=2, window=4, dtype=F64, rope=True).eval()
    x = _x(T=10)
    cache = window_cache(m, 2, 10)
    full = m.make_kv_cache(2, 10)
    t = 0
    with torch.no_grad():
        for n in steps:
            m(x[:, t : t + n], is_causal=True, kv_cache=cache)
            m(x[:, t : t + n], is_causal=True, kv_cache=full)
            t += n
            kept = min(t, 4)
            assert cache.k.shape == (2, 2, kept, m.head_dim) and cache.v.shape == (2, 2, kept, m.head_dim)
            for got, buf in ((cache.k, full.k), (cache.v, full.v)):  # the last positions, in order
                assert torch.equal(got, buf[:, :, t - kept : t])
                assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # nothing more held
    assert cache.k.numel() == 2 * 2 * 4 * m.head_dim  # window-sized, not max_len-sized


def test_window_one_and_reset_and_the_errors():
    torch.manual_seed(0)
    m = build_attention("mha", embed_dim=C, num_heads=H, window=1, dtype=F64).eval()
    x = _x(T=5)
    with torch.no_grad():
        assert_paths_agree(_decode(m, x, window_cache(m, 2, 5), prefill=3), m(x, is_causal=True))
    cache = window_cache(m, 2, 5)
    with torch.no_grad():
        m(x, is_causal=True, kv_cache=cache)
        with pytest.raises(ValueError, match=r"KV cache overflow: 5 cached \+ 1 new = 6 > max_len 5"):
            m(x[:, :1], is_causal=True, kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache holds batch_size=2, got a batch of 1"):
            cache.check_append(1, 1)
    assert cache.length == 5 and cache.k.shape[2] == 1
    cache.reset()
    assert cache.length == 0 and cache.k.shape[2] == 0 and cache.v.shape[2] == 0
    with pytest.raises(ValueError, match="window must be a positive int, got window=0"):
        WindowKVCache(1, 1, 4, 2, window=0)


@pytest.mark.parametrize(("k_shape", "v_shape", "words"), [
    ((1, 2, 3), (1, 1, 2, 3), "must be \\(B, G, T, D\\) with equal T"),  # k of 3 dims
    ((1, 1, 2, 3), (1, 1, 2), "must be \\(B, G, T, D\\) with equal T"),  # v of 3 dims
    ((1, 1, 2, 3), (1, 1, 3, 3), "must be \\(B, G, T, D\\) with equal T"),  # T differs
    ((1, 1, 2, 4), (1, 1, 2, 3), "cache holds k \\(B=1, G=1, D=3\\)"),  # another key width
])  # fmt: skip
def test_a_write_of_the_wrong_shape_is_refused_before_anything_is_written(k_shape, v_shape, words):
    """catches: a shape check that needs every condition to fail before it refuses."""
    cache = WindowKVCache(1, 1, 6, 3, window=2)
    with pytest.raises(ValueError, match=words):
        cache.update(torch.zeros(k_shape), torch.zeros(v_shape))
    assert cache.length == 0


def test_a_call_that_fails_after_the_write_leaves_the_cache_as_it_was():
    """A key mask of the wrong width is refused after the cache was written: the kept keys
    and the length come back, and decoding on gives the outputs of a run without that call."""
    torch.manual_seed(0)
    m = build_attention("gqa", embed_dim=C, num_heads=H, num_kv_heads=2, window=3, dtype=F64, rope=True).eval()
    x = _x(T=8)
    cache, reference = window_cache(m, 2, 8), window_cache(m, 2, 8)
    with torch.no_grad():
        m(x[:, :5], is_causal=True, kv_cache=cache)
        m(x[:, :5], is_causal=True, kv_cache=reference)
        k, v = cache.k.clone(), cache.v.clone()
        with pytest.raises(ValueError, match=r"key_mask must be \(B, S\)"):
            m(x[:, 5:7], is_causal=True, kv_cache=cache, key_mask=torch.ones(2, 3, dtype=torch.bool))
        assert cache.length == 5 and torch.equal(cache.k, k) and torch.equal(cache.v, v)
        assert_paths_agree(_decode(m, x[:, 5:], cache, 1), _decode(m, x[:, 5:], reference, 1))


def test_an_attn_mask_over_every_position_written_is_cut_to_the_kept_keys():
    """Each query also hides the key two positions back (inside the window of 4): a
    [T, length] mask per call gives the full forward with that [T, T] mask."""
    torch.manual_seed(0)
    m = build_attention("gqa", embed_dim=C, num_heads=H, num_kv_heads=2, window=4, dtype=F64, rope=True).eval()
    x = _x(T=10)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    hide = j != i - 2  # (T, T)
    cache = window_cache(m, 2, 10)
    with torch.no_grad():
        want = m(x, is_causal=True, attn_mask=hide)
        outs = [m(x[:, :6], is_causal=True, kv_cache=cache, attn_mask=hide[:6, :6])]
        outs += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, attn_mask=hide[t : t + 1, : t + 1]) for t in range(6, 10)]
    assert_paths_agree(torch.cat(outs, 1), want)
    assert not torch.allclose(want, m(x, is_causal=True))  # the mask matters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list_attention_kinds())
def test_cuda_every_kind_decodes_a_long_prompt_with_its_window_cache_as_on_the_cpu(kind):
    """float64 on the GPU: the window cache's prefill and steps equal the CPU's full forward, and the
    cache's storage is window-sized on the device."""
    m = build(kind, window=3, rope=True)
    x = _x()
    with torch.no_grad():
        want = m(x, is_causal=True)
        gpu = m.to("cuda")
        cache = window_cache(gpu, 2, 11)
        assert type(cache) is WINDOWED[type(gpu.make_kv_cache(2, 11))] and cache.k.device.type == "cuda"
        got = _decode(gpu, x.cuda(), cache, prefill=7)
    assert_paths_agree(got.cpu(), want)
    assert cache.length == 11 and all(getattr(cache, name).shape[dim] == 3 for name, dim in cache._kept_dims.items())
