"""The shared options ``sinks`` and ``window`` on every kind that takes them, and the
streaming cache (StreamingLLM): outputs equal the float64 reference / full attention
with the same visible keys, caches decode past the window and past their capacity,
heads carry their sinks when selected, and refusals name the option."""

from __future__ import annotations

import pytest
import torch
from support.attention import assert_matches
from support.kinds import F64, C, H, build
from support.paths import assert_paths_agree

from multihead import StreamingKVCache, build_attention, streaming_cache
from multihead.functional import sliding_window_mask
from multihead.modules.registry import attention_class, list_attention_kinds
from multihead.reference import attention as reference
from multihead.tools.heads import mask_heads

SINK_KINDS = [k for k in list_attention_kinds() if "sinks" not in attention_class(k).refused_options]
INDEPENDENT_SINKS = [k for k in SINK_KINDS if attention_class(k).independent_heads]


def _x(B=2, T=7, seed=1):
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _gqa(seed=0, **options):
    torch.manual_seed(seed)
    m = build_attention("gqa", embed_dim=C, num_heads=H, num_kv_heads=2, dtype=F64, **options)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def _reference_layer(m, x, **kw):
    """The layer's output from its own q, k, v and the NumPy reference core."""
    q, k, v = m.project(x)
    sinks = None if m.sinks is None else m.sinks.detach().numpy()
    out = reference(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), sinks=sinks, **kw)
    B, _, T, _ = q.shape
    return m.out_proj(torch.from_numpy(out).transpose(1, 2).reshape(B, T, -1)).detach()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_sinks_and_window_equal_the_reference(backend):
    m = _gqa(sinks=True, window=3)
    x = _x()
    want = _reference_layer(m, x, is_causal=True, window=3)
    assert_matches(m(x, is_causal=True, backend=backend), want)
    assert not torch.allclose(_gqa(sinks=True)(x, is_causal=True), want)  # the window matters
    with torch.no_grad():  # exact weights from the fused kernel carry no gradient
        out, w = m(x, is_causal=True, backend=backend, return_weights=True)
    assert bool((w.sum(-1) < 1).all()) and bool((w != 0).sum(-1).le(3).all())


def test_a_row_that_sees_nothing_gives_the_output_bias_alone():
    m = _gqa(sinks=True)
    x = _x(B=1, T=4)
    key_mask = torch.zeros(1, 4, dtype=torch.bool)
    for backend in ("math", "sdpa"):
        out = m(x, key_mask=key_mask, backend=backend)
        assert_paths_agree(out, m.out_proj.bias.detach().expand(1, 4, C))


def test_sink_gradients_agree_between_paths_and_reach_the_parameter():
    m = _gqa(sinks=True, window=2)
    x = _x()
    grads = []
    for backend in ("math", "sdpa"):
        m.zero_grad()
        m(x, is_causal=True, backend=backend).square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert grads[0][0].abs().sum() > 0  # sinks come first: they learn
    for a, b in zip(*grads):
        assert_paths_agree(a, b)


@pytest.mark.parametrize("kind", SINK_KINDS)
def test_every_kind_that_takes_sinks_and_window_decodes_with_its_cache(kind):
    m = build(kind, sinks=True, window=3, rope=True)
    assert m.sinks is not None and m.sliding_window == 3
    x = _x()
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 7)
    steps = [m(x[:, :3], is_causal=True, kv_cache=cache)] + [m(x[:, t : t + 1], is_causal=True, kv_cache=cache)
                                                             for t in range(3, 7)]  # fmt: skip
    assert_paths_agree(torch.cat(steps, 1), full)
    plain = build(kind, rope=True, sinks=True)
    plain.load_state_dict(m.state_dict())
    assert_paths_agree(plain(x, attn_mask=sliding_window_mask(7, window=3)), full)


@pytest.mark.parametrize("kind", INDEPENDENT_SINKS)
def test_selected_heads_keep_their_sinks(kind):
    m = build(kind, sinks=True, window=4)
    x = _x(T=5)
    small = m.select_heads([1, 3] if m.num_kv_heads == H else [0, 1])
    kept = [1, 3] if m.num_kv_heads == H else [0, 1]
    assert torch.equal(small.sinks, m.sinks[kept]) and small.sliding_window == 4
    with mask_heads(m, {0: [h for h in range(H) if h not in kept]}):
        want = m(x, is_causal=True)
    assert_paths_agree(small(x, is_causal=True), want)
    parts = [m.tensor_parallel_part(hs) for hs in ([0, 1], [2, 3])]
    total = sum(p(x, is_causal=True) for p in parts) - (len(parts) - 1) * m.out_proj.bias.detach()
    assert_paths_agree(total, m(x, is_causal=True))


def test_kinds_with_their_own_core_refuse_sinks_and_bad_values_are_named():
    refusing = sorted(set(list_attention_kinds()) - set(SINK_KINDS))
    assert {"moh", "dcmha", "diff"} <= set(refusing)
    for kind in refusing:
        with pytest.raises(TypeError, match="does not take sinks .*its core is its own"):
            build(kind, sinks=True)
    with pytest.raises(ValueError, match="window must be an int >= 1 or None, got window=0"):
        _gqa(window=0)
    with pytest.raises(TypeError, match="sinks must be a bool, got sinks='yes'"):
        _gqa(sinks="yes")
    with pytest.raises(ValueError, match="window=2 is for self-attention"):
        _gqa(window=2)(_x(), _x(seed=2))


# ---------------------------------------------------------------------- streaming cache
def _stream_mask(T, sink, window):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & ((j < sink) | (j > i - window))


@pytest.mark.parametrize("steps", [[1] * 20, [5, 3, 1, 4, 2, 5]])
def test_streaming_cache_equals_full_attention_with_the_same_visible_keys(steps):
    """Rope keys keep their original positions; the cache stays at sink + window - 1 + max_step."""
    T, sink, window = sum(steps), 2, 4
    m = _gqa(sinks=True, rope=True)
    x = _x(T=T)
    want = m(x, attn_mask=_stream_mask(T, sink, window))
    cache = streaming_cache(m, 2, sink_tokens=sink, window=window, max_step=5)
    assert isinstance(cache, StreamingKVCache) and cache.k.shape[2] == sink + window - 1 + 5
    outs, t = [], 0
    for n in steps:
        outs.append(m(x[:, t : t + n], is_causal=True, kv_cache=cache))
        t += n
        kept = cache.key_positions()
        assert kept.numel() <= sink + window - 1 + n and kept[:sink].tolist() == list(range(min(sink, t)))
    assert_paths_agree(torch.cat(outs, 1), want)
    assert cache.length == T and cache.key_positions()[-1] == T - 1


def test_streaming_cache_with_a_window_layer_and_its_errors():
    m = _gqa(window=3, rope=True)
    x = _x(T=9)
    want = m(x, attn_mask=_stream_mask(9, 1, 5), is_causal=True)  # the layer's window is the narrower
    cache = streaming_cache(m, 2, sink_tokens=1, window=5, max_step=2)
    got = torch.cat([m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(9)], 1)
    assert_paths_agree(got, want)
    with pytest.raises(ValueError, match="at most max_step=2 new positions per call, got 3"):
        m(x[:, :3], is_causal=True, kv_cache=cache)
    assert cache.length == 9
    with pytest.raises(ValueError, match="keeps a cache of its own"):
        streaming_cache(build("dcmha"), 1, sink_tokens=1, window=2, max_step=1)
    cache.reset()
    assert cache.length == 0 and cache.key_positions().numel() == 0


def test_cost_counts_the_pairs_inside_the_window():
    m, plain = _gqa(window=3), _gqa()
    pairs = int(sliding_window_mask(7, window=3).sum())  # 3 + 3 + ... from the mask builder
    D = m.head_dim
    assert m.cost(7, causal=True).core_flops == 2 * H * pairs * 2 * D
    assert plain.cost(7, causal=True).core_flops == 2 * H * 28 * 2 * D
    assert m.cost(7).kv_cache_bytes_per_token == plain.cost(7).kv_cache_bytes_per_token
    assert m.cost(7).parameters == plain.cost(7).parameters
    assert _gqa(sinks=True).cost(7).parameters == plain.cost(7).parameters + H  # one sink logit per head


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kinds_cost_counts_only_the_pairs_inside_its_window(kind):
    """catches: a kind whose cost() ignores the window. Its core FLOPs are a·(visible pairs) + b,
    so the savings of two windows are in the ratio of the pairs they hide."""
    def core(window):
        return build(kind, window=window).cost(7, causal=True).core_flops

    hidden = {w: 28 - int(sliding_window_mask(7, window=w).sum()) for w in (2, 4)}  # of T = 7's 28 causal pairs
    saved = {w: core(None) - core(w) for w in (2, 4)}
    assert saved[2] > 0 and saved[2] * hidden[4] == saved[4] * hidden[2]


def test_observers_get_the_exact_weights_with_the_sinks_share():
    m = _gqa(sinks=True, window=3)
    x = _x()
    events = []
    handle = m.register_attention_observer(lambda layer, event: events.append(event), heads=[1, 2], rows=[-1])
    with torch.no_grad():
        m(x, is_causal=True)
        _, w = m(x, is_causal=True, return_weights=True, backend="math")
    handle.remove()
    got = events[0].weights
    assert_paths_agree(got, w[:, [1, 2]][:, :, [-1]])
    assert bool((got.sum(-1) < 1).all())
