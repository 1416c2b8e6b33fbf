"""The shared layer options ``alibi`` and ``softcap`` (``modules.score_options``):
every kind whose core is functional.attention takes them, the others refuse
with their reason; ALiBi follows the cache's positions and the kept heads."""

import math

import pytest
import torch
from support.kinds import KINDS_TAKING, OPTIONS, C, H, build
from support.paths import assert_paths_agree

import multihead.modules.base as base
from multihead.modules.registry import attention_class
from multihead.tools.heads import mask_heads

F64 = torch.float64


def _alibi_mask(slopes, T, S):
    """The float mask -m_h |i + S - T - j| (queries after the cached keys), (1, H, T, S)."""
    i = torch.arange(T, dtype=F64)[:, None] + (S - T)
    j = torch.arange(S, dtype=F64)[None, :]
    return (-slopes.to(F64)[:, None, None] * (i - j).abs())[None]


@pytest.mark.parametrize("kind", sorted(KINDS_TAKING))
def test_alibi_layer_equals_the_plain_layer_given_the_alibi_bias_as_a_mask(kind):
    x = torch.randn(2, 5, C, dtype=F64, generator=torch.Generator().manual_seed(0))
    m = build(kind, alibi=True)
    plain = build(kind)
    plain.load_state_dict(m.state_dict())
    bias = _alibi_mask(m.alibi_slopes, 5, 5)
    assert torch.equal(m.alibi_slopes, torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)]))
    assert_paths_agree(m(x, is_causal=True), plain(x, is_causal=True, attn_mask=bias))
    assert_paths_agree(m(x), plain(x, attn_mask=bias))


@pytest.mark.parametrize("kind", sorted(KINDS_TAKING))
def test_softcap_reaches_the_core_of_every_kind_that_takes_it(kind, monkeypatch):
    seen = []
    real = base.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["softcap"])
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "attention", spy)
    m = build(kind, softcap=7.5)
    x = torch.randn(1, 3, C, dtype=F64)
    m(x)
    assert seen == [7.5] and m.init_options["softcap"] == 7.5


def test_softcapped_mha_layer_equals_the_capped_formula():
    m = build("gqa", softcap=2.0)
    x = torch.randn(2, 4, C, dtype=F64, generator=torch.Generator().manual_seed(1)) * 3
    q, k, v = m.project(x)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = (2.0 * torch.tanh(s / 2.0)).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -math.inf)
    want = m.merge_heads(torch.softmax(s, dim=-1) @ v)
    assert_paths_agree(m(x, is_causal=True), want)


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_alibi_decoding_with_a_cache_equals_the_full_causal_forward(kind):
    m = build(kind, alibi=True)
    x = torch.randn(2, 6, C, dtype=F64, generator=torch.Generator().manual_seed(2))
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 6)
    parts = [m(x[:, :3], is_causal=True, kv_cache=cache)]
    parts += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 6)]
    assert_paths_agree(torch.cat(parts, dim=1), full)


def test_selected_heads_keep_their_slopes_and_outputs():
    m = build("gqa", alibi=True)
    sub = m.select_heads([2, 3])
    assert torch.equal(sub.alibi_slopes, m.alibi_slopes[2:])
    assert sub.init_options["alibi"] == m.alibi_slopes[2:].tolist()
    x = torch.randn(1, 4, C, dtype=F64)
    with mask_heads(m, {0: [0, 1]}):
        want = m(x, is_causal=True)
    assert_paths_agree(sub(x, is_causal=True), want)
    rebuilt = type(sub)(C, 2, num_kv_heads=1, head_dim=4, dtype=F64, **sub.init_options)
    assert torch.equal(rebuilt.alibi_slopes, sub.alibi_slopes)


@pytest.mark.parametrize("kind", sorted(k for k in KINDS_TAKING if attention_class(k).independent_heads))
def test_heads_selected_twice_keep_their_own_slopes(kind):
    """catches: a kind rebuilt for fewer heads from a list of H slopes (a second selection,
    or alibi given as a list) refused as a wrong slope count."""
    slopes = [0.5 / (h + 1) for h in range(H)]
    once = build(kind, alibi=slopes).select_heads([2, 3])
    twice = once.select_heads([1])
    assert once.alibi_slopes.tolist() == pytest.approx(slopes[2:])
    assert twice.alibi_slopes.tolist() == pytest.approx(slopes[3:]) and twice.init_options["alibi"] == pytest.approx(slopes[3:])


@pytest.mark.parametrize("kind", sorted(set(OPTIONS) - KINDS_TAKING))
@pytest.mark.parametrize("option", [{"alibi": True}, {"softcap": 30.0}])
def test_kinds_with_their_own_core_refuse_with_the_reason(kind, option):
    cls = attention_class(kind)
    name = next(iter(option))
    with pytest.raises(TypeError, match=rf"{cls.__name__} does not take {name} \(got .*\): \w"):
        build(kind, **option)


@pytest.mark.parametrize(
    ("option", "error", "match"),
    [
        ({"alibi": [0.5, 0.25]}, ValueError, r"alibi slopes must be 4 finite numbers \(one per head\), got alibi=\[0.5, 0.25\]"),
        ({"alibi": "yes"}, TypeError, "alibi must be a bool or a list of 4 slopes, got alibi='yes'"),
        ({"softcap": -1.0}, ValueError, "softcap must be None or a positive finite number, got softcap=-1.0"),
    ],
)
def test_bad_option_values_are_one_line_errors(option, error, match):
    with pytest.raises(error, match=match):
        build("mha", **option)


def test_per_head_slopes_are_taken_as_given():
    m = build("mha", alibi=[0.5, 0.0, 1.0, 0.125])
    assert m.alibi_slopes.tolist() == [0.5, 0.0, 1.0, 0.125]


def test_captured_scores_carry_the_softcap_and_alibi_of_the_layer():
    """capture(scores=True) rebuilds the scores the layer's softmax saw: their softmax is its weights."""
    from multihead.tools import capture

    m = build("gqa", alibi=True, softcap=3.0)
    x = torch.randn(2, 5, C, dtype=F64, generator=torch.Generator().manual_seed(3))
    cache = m.make_kv_cache(2, 5)
    with torch.no_grad():
        m(x[:, :2], is_causal=True, kv_cache=cache)
        with capture(m, scores=True, heads=[1, 2], rows=[0, 2]) as record:
            m(x[:, 2:], is_causal=True, kv_cache=cache)  # queries at positions 2-4 after the cache
    entry = record.layers[0]
    assert_paths_agree(torch.softmax(entry.scores.double(), dim=-1).float(), entry.weights)
