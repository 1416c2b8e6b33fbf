"""Window caches of kinds whose cache holds more than keys and values: DCMHA's
key-side composition weights (``WindowDynamicKVCache``) and MLA's latent rows on
the absorbed path (``WindowLatentKVCache``). Prompts longer than the window then
steps give the full forward, the cache holds the last ``window`` positions of a
full cache in window-sized storage, a failed call leaves it as it was, and a GPT
of local and global blocks of these kinds generates the uncached tokens."""

from __future__ import annotations

import pytest
import torch
from support.kinds import F64, C, H
from support.paths import assert_greedy_agrees, assert_paths_agree

from multihead import build_attention, window_cache
from multihead.models import GPT, GPTConfig
from multihead.modules.kv_cache import DynamicKVCache, LatentKVCache
from multihead.modules.window_cache import WindowDynamicKVCache, WindowLatentKVCache
from multihead.tools.flops import kv_cache_size

KINDS = {
    "dcmha": ({"chunk_size": 2, "rope": True}, DynamicKVCache, WindowDynamicKVCache),
    "mla": ({"decode": "absorbed", "kv_lora_rank": 10, "qk_nope_head_dim": 3, "qk_rope_head_dim": 4, "v_head_dim": 5,
             "rope": True}, LatentKVCache, WindowLatentKVCache),  # fmt: skip
}


def _layer(kind, window=4):
    torch.manual_seed(0)
    return build_attention(kind, embed_dim=C, num_heads=H, window=window, dtype=F64, **KINDS[kind][0]).eval()


def _x(B=2, T=12, seed=1):
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _kept(cache):
    """Every tensor the cache keeps per position, with its position dimension."""
    if isinstance(cache, (DynamicKVCache, WindowDynamicKVCache)):
        return [(cache.k, 2), (cache.v, 2), (cache.kw, 1)]
    return [(cache.k, 2)] if isinstance(cache, (LatentKVCache, WindowLatentKVCache)) else [(cache.k, 2), (cache.v, 2)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("steps", [[7, 1, 1, 1, 1, 1], [2, 5, 1, 3, 1], [12]])
def test_decoding_equals_the_full_forward_and_keeps_the_last_window(kind, steps):
    """Each call's outputs are the full forward's rows; after it the cache holds the last
    min(t, 4) positions of a full cache written alongside, in storage of that size."""
    m, x = _layer(kind), _x()
    cache, full = window_cache(m, 2, 12), m.make_kv_cache(2, 12)
    assert type(cache) is KINDS[kind][2] and type(full) is KINDS[kind][1]
    outs, t = [], 0
    with torch.no_grad():
        want = m(x, is_causal=True)
        for n in steps:
            outs.append(m(x[:, t : t + n], is_causal=True, kv_cache=cache))
            m(x[:, t : t + n], is_causal=True, kv_cache=full)
            t += n
            kept = min(t, 4)
            for (got, dim), (buf, _) in zip(_kept(cache), _kept(full)):
                assert got.shape[dim] == kept
                assert torch.equal(got, buf.narrow(dim, t - kept, kept))
                assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # nothing more held
    assert_paths_agree(torch.cat(outs, 1), want)
    assert cache.length == 12


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_key_mask_over_every_position_and_a_failed_call(kind):
    """Left padding of row 1 longer than the window; then a call refused after its write
    (a key mask of the wrong width) leaves every kept tensor and the length as they were."""
    m, x = _layer(kind), _x()
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, :6] = False
    cache = window_cache(m, 2, 12)
    with torch.no_grad():
        want = m(x, is_causal=True, key_mask=key_mask)
        outs = [m(x[:, :7], is_causal=True, kv_cache=cache, key_mask=key_mask[:, :7])]
        before = [tensor.clone() for tensor, _ in _kept(cache)]
        with pytest.raises(ValueError, match=r"key_mask must be \(B, S\)"):
            m(x[:, 7:9], is_causal=True, kv_cache=cache, key_mask=torch.ones(2, 3, dtype=torch.bool))
        assert cache.length == 7 and all(torch.equal(a, b) for a, (b, _) in zip(before, _kept(cache)))
        for t in range(7, 12):
            outs.append(m(x[:, t : t + 1], is_causal=True, kv_cache=cache, key_mask=key_mask[:, : t + 1]))
    got = torch.cat(outs, 1)
    assert_paths_agree(got[0], want[0])
    assert_paths_agree(got[1, 6:], want[1, 6:])  # padded queries see nothing: not compared


def test_the_caches_refuse_what_they_do_not_hold():
    dcmha, mla = _layer("dcmha"), _layer("mla")
    cache = window_cache(dcmha, 2, 8)
    k = torch.zeros(2, H, 1, dcmha.head_dim, dtype=F64)
    with pytest.raises(ValueError, match="needs the key-side weights kw"):
        cache.update(k, k)
    with pytest.raises(ValueError, match=r"kw must be \(2, 1, 2, 5, 4\), got \(2, 1, 2, 5, 3\)"):
        cache.update(k, k, torch.zeros(2, 1, 2, 5, 3, dtype=F64))
    assert cache.length == 0 and cache.k.shape[2] == 0
    latent = window_cache(mla, 2, 8)
    mla.decode = "naive"
    with pytest.raises(ValueError, match="decodes 'naive' but kv_cache is a WindowLatentKVCache"):
        mla(_x(T=1), is_causal=True, kv_cache=latent)
    cache.reset()
    assert cache.kw.shape[1] == 0 and not hasattr(latent, "v")
    assert [n for n, _ in cache.named_buffers()] == ["k", "v", "kw"]  # moved by .to() with the cache


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_gpt_of_local_and_global_blocks_generates_the_uncached_tokens(kind):
    """Blocks 0, 1 local (window 4), block 2 global; a prompt of 9 then 8 steps."""
    torch.manual_seed(0)
    options = {k: v for k, v in KINDS[kind][0].items() if k != "rope"}
    config = GPTConfig(vocab_size=61, context_length=24, embed_dim=C, num_layers=3, num_heads=H, attention=kind,
                       positions="rope", attention_options=options,
                       layer_attention_options=[{"window": 4}, {"window": 4}, {}])  # fmt: skip
    model = GPT(config).eval()
    caches = model.make_kv_caches(2, 20)
    assert [type(c) for c in caches] == [KINDS[kind][2], KINDS[kind][2], KINDS[kind][1]]
    prompt = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, logits = model.generate(prompt, 8, temperature=0, return_logits=True)
        ref, ref_logits = model.generate(prompt, 8, temperature=0, return_logits=True, use_cache=False)
    assert_greedy_agrees(got, ref, logits, ref_logits, start=9)
    size = kv_cache_size(model, context=20)
    per_layer = size.bytes_per_token // 3  # every block holds the same bytes per position
    assert size.bytes == per_layer * (4 + 4 + 20)
