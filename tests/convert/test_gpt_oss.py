"""gpt-oss attention -> multihead, against transformers' own ``GptOssAttention`` built with
a tiny config (CPU, its eager attention with the sink column, no download): sliding and
full layers, causal forward, token-by-token decoding (past the window), left padding,
float32 with the official rotary table, the round trip and the refusals."""

from __future__ import annotations

import pytest
import torch
from support.attention import assert_matches

from multihead import streaming_cache
from multihead.convert import from_official
from multihead.convert.official.gpt_oss import to_official
from multihead.modules.kv_cache import KVCache
from multihead.modules.window_cache import WindowKVCache

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
masking = pytest.importorskip("transformers.masking_utils")

F64 = torch.float64
C, H, G, D, T, W = 16, 4, 2, 8, 9, 3


def official(*, layer_type="sliding_attention", theta=500.0, seed=0, dtype=F64):
    cfg = gpt_oss.GptOssConfig(
        hidden_size=C, num_attention_heads=H, num_key_value_heads=G, head_dim=D, num_hidden_layers=2,
        sliding_window=W, layer_types=[layer_type, "full_attention"], attention_bias=True, num_local_experts=2,
        intermediate_size=8, rope_parameters={"rope_type": "default", "rope_theta": theta},
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # the sink column, in the input's dtype
    layer = gpt_oss.GptOssAttention(cfg, layer_idx=0).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return cfg, layer


def official_mask(cfg, L, keep=None, dtype=F64):
    """transformers' own mask functions: causal, and the sliding overlay on a sliding layer."""
    fn = masking.causal_mask_function
    if cfg.layer_types[0] == "sliding_attention":
        fn = masking.sliding_window_causal_mask_function(cfg.sliding_window)
    zero = torch.tensor(0)
    allowed = fn(zero, zero, torch.arange(L)[:, None], torch.arange(L)[None, :])  # (L, L)
    mask = torch.zeros(L, L, dtype=dtype).masked_fill(~allowed, float("-inf")).expand(1, 1, L, L)
    if keep is not None:
        mask = mask.masked_fill(~keep[:, None, None, :].bool(), float("-inf"))
    return mask


def rope_table(cfg, pos):
    """cos, sin [B, L, D/2] of the official rotary embedding, in float64."""
    inv = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, D, 2, dtype=F64) / D)
    ang = pos[..., None].to(F64) * inv
    return ang.cos(), ang.sin()


def run_official(cfg, layer, x, pos=None, keep=None):
    B, L, _ = x.shape
    pos = torch.arange(L).expand(B, L) if pos is None else pos
    with torch.no_grad():
        return layer(x, position_embeddings=rope_table(cfg, pos), attention_mask=official_mask(cfg, L, keep))[0]


def convert(cfg, layer, **extra):
    fields = {n: getattr(cfg, n) for n in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "sliding_window", "rope_parameters", "attention_bias", "layer_types")}  # fmt: skip
    return from_official("gpt_oss", layer.state_dict(), layer_idx=0, **{**fields, **extra})


def _x(B=2, L=T, seed=1, dtype=F64):
    return torch.randn(B, L, C, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_matches_the_transformers_layer_forward_and_decoding(layer_type):
    cfg, layer = official(layer_type=layer_type)
    m = convert(cfg, layer)
    assert m.attention.sliding_window == (W if layer_type == "sliding_attention" else None)
    x = _x()
    want = run_official(cfg, layer, x)
    assert_matches(m(x), want)
    cache = m.make_kv_cache(2, T)
    steps = [m(x[:, :2], kv_cache=cache)] + [m(x[:, t : t + 1], kv_cache=cache) for t in range(2, T)]
    assert_matches(torch.cat(steps, dim=1), want)  # decoding runs past the window of 3
    # a sliding layer's cache keeps its last W positions, a full one all T
    assert type(cache) is (WindowKVCache if layer_type == "sliding_attention" else KVCache)
    assert cache.length == T and cache.k.shape[2] == (W if layer_type == "sliding_attention" else T)


def test_each_official_detail_matters():
    """Without the sinks, or the window on a sliding layer, the output differs."""
    cfg, layer = official()
    x = _x()
    want = run_official(cfg, layer, x)
    assert not torch.allclose(convert(cfg, layer, layer_types=None, layer_type="full_attention")(x), want)
    m = convert(cfg, layer)
    m.attention.sinks = None
    assert not torch.allclose(m(x), want)


def test_a_sliding_layer_decodes_with_a_streaming_cache_in_bounded_memory():
    cfg, layer = official()
    m = convert(cfg, layer)
    x = _x(L=12)
    want = run_official(cfg, layer, x)
    cache = streaming_cache(m.attention, 2, sink_tokens=0, window=W, max_step=1)
    got = torch.cat([m(x[:, t : t + 1], kv_cache=cache) for t in range(12)], dim=1)
    assert_matches(got, want)
    assert cache.k.shape[2] == W and cache.key_positions().tolist() == [9, 10, 11]


def test_left_padding_with_positions():
    cfg, layer = official(layer_type="full_attention")
    m = convert(cfg, layer)
    x = _x()
    keep = torch.tensor([[1] * T, [0, 0, 0] + [1] * (T - 3)])
    pos = (keep.cumsum(-1) - 1).clamp(min=0)
    got = m(x, attention_mask=keep, position_ids=pos)
    assert_matches(got[keep.bool()], run_official(cfg, layer, x, pos, keep)[keep.bool()])


def test_float32_with_the_official_rotary_embedding_and_round_trip():
    cfg, layer = official(dtype=torch.float32)
    m = convert(cfg, layer)
    assert m.attention.out_proj.weight.dtype == torch.float32
    x = _x(dtype=torch.float32)
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad():
        cos_sin = gpt_oss.GptOssRotaryEmbedding(cfg)(x, pos)
        want = layer(x, position_embeddings=cos_sin, attention_mask=official_mask(cfg, T, dtype=torch.float32))[0]
    torch.testing.assert_close(m(x), want)
    back = to_official(m)
    assert sorted(back) == sorted(layer.state_dict())
    assert all(torch.equal(back[k], v) for k, v in layer.state_dict().items())


def test_refusals_name_the_field():
    cfg, layer = official()
    sd = layer.state_dict()
    fields = dict(hidden_size=C, num_attention_heads=H, num_key_value_heads=G, head_dim=D)
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        from_official("gpt_oss", sd, rope_parameters={"rope_type": "yarn"}, **fields)
    with pytest.raises(ValueError, match="needs sliding_window"):
        from_official("gpt_oss", sd, layer_type="sliding_attention", **fields)
    with pytest.raises(ValueError, match="layer_type must be one of"):
        from_official("gpt_oss", sd, layer_type="chunked", **fields)
    with pytest.raises(ValueError, match=r"missing \['sinks'\]"):
        from_official("gpt_oss", {k: v for k, v in sd.items() if k != "sinks"}, **fields)
    with pytest.raises(ValueError, match="layer_idx must be an index"):
        from_official("gpt_oss", sd, layer_types=["full_attention"], layer_idx=3, **fields)
