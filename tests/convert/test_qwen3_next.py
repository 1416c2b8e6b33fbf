"""Qwen3-Next's gated attention -> multihead, against transformers' own
``Qwen3NextAttention`` built with a tiny config (CPU, its sdpa attention, no
download): per-head q|gate rows, (1 + w) q/k norm gains, partial rotate-half rope."""

from __future__ import annotations

import pytest
import torch
from support.attention import assert_matches

from multihead.convert import from_official
from multihead.convert.official.qwen3_next import to_official

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

F64 = torch.float64
C, H, G, D, T = 16, 4, 2, 8, 7


def official(*, factor=0.5, theta=500.0, bias=False, groups=G, seed=0):
    cfg = qwen3_next.Qwen3NextConfig(
        hidden_size=C, num_attention_heads=H, num_key_value_heads=groups, head_dim=D, num_hidden_layers=1,
        attention_bias=bias, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                                 "partial_rotary_factor": factor},
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"  # eager takes its softmax in float32; sdpa keeps float64
    layer = qwen3_next.Qwen3NextAttention(cfg, layer_idx=0).to(F64).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.4)  # norm weights too: gains 1 + w
    for norm in (layer.q_norm, layer.k_norm):  # the official norm computes in float32 even for float64 inputs:
        norm.forward = float64_norm(norm)  # its float64 form, for the 1e-10 checks (float32 runs it as it is)
    return cfg, layer


def float64_norm(norm):
    """The official Qwen3NextRMSNorm in the input's dtype: x·rsqrt(mean(x²) + eps)·(1 + w)."""

    def forward(x):
        if x.dtype != F64:
            return type(norm).forward(norm, x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)

    return forward


def rope_table(cfg, pos):
    """cos, sin [B, T, r] of the official rotary embedding, computed in float64."""
    r = int(D * cfg.rope_parameters["partial_rotary_factor"])
    inv = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, r, 2, dtype=F64) / r)
    ang = pos[..., None].to(F64) * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def run_official(cfg, layer, x, pos=None, keep=None):
    B, L, _ = x.shape
    pos = torch.arange(L).expand(B, L) if pos is None else pos
    mask = torch.full((L, L), float("-inf"), dtype=F64).triu(1).expand(B, 1, L, L)
    if keep is not None:
        mask = mask.masked_fill(~keep[:, None, None, :].bool(), float("-inf"))
    with torch.no_grad():
        return layer(x, position_embeddings=rope_table(cfg, pos), attention_mask=mask)[0]


def convert(cfg, layer, **extra):
    fields = {n: getattr(cfg, n) for n in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "rms_norm_eps", "rope_parameters", "attention_bias")}  # fmt: skip
    return from_official("qwen3_next", layer.state_dict(), **{**fields, **extra})


def _x(B=2, L=T, seed=1, dtype=F64):
    return torch.randn(B, L, C, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("factor,bias,groups", [(0.5, False, G), (0.25, True, G), (1.0, False, 1)])
def test_matches_the_transformers_layer(factor, bias, groups):
    cfg, layer = official(factor=factor, bias=bias, groups=groups)
    m = convert(cfg, layer)
    assert m.attention.rope["rotary_dim"] == int(D * factor) and m.attention.gate == "elementwise"
    x = _x()
    assert_matches(m(x), run_official(cfg, layer, x))


def test_each_official_detail_matters():
    """Other norm gains (w instead of 1 + w), full rope or the paper's per-group rows give other outputs."""
    cfg, layer = official()
    x = _x()
    want = run_official(cfg, layer, x)
    m = convert(cfg, layer)
    m.attention.qk_norm.q_norm.unit_offset = False
    assert not torch.allclose(m(x), want)
    assert not torch.allclose(convert(cfg, layer, rope_parameters={"rope_theta": 500.0,
                                                                   "partial_rotary_factor": 1.0})(x), want)
    grouped = from_official("qwen_gated", {k: v for k, v in layer.state_dict().items() if "norm" not in k},
                            hidden_size=C, num_attention_heads=H, num_key_value_heads=G, head_dim=D,
                            elementwise_attn_output_gate=True, use_qk_norm=False)  # fmt: skip
    assert not torch.allclose(grouped(x), convert(cfg, layer)(x))


def test_single_token_decoding_with_the_cache_equals_the_transformers_layer():
    cfg, layer = official()
    m = convert(cfg, layer)
    x = _x()
    want = run_official(cfg, layer, x)
    cache = m.make_kv_cache(2, T)
    steps = [m(x[:, :4], kv_cache=cache)] + [m(x[:, t : t + 1], kv_cache=cache) for t in range(4, T)]
    assert_matches(torch.cat(steps, dim=1), want)


def test_left_padding_with_positions():
    cfg, layer = official()
    m = convert(cfg, layer)
    x = _x()
    keep = torch.tensor([[1] * T, [0, 0, 0] + [1] * (T - 3)])
    pos = (keep.cumsum(-1) - 1).clamp(min=0)
    got = m(x, attention_mask=keep, position_ids=pos)
    assert_matches(got[keep.bool()], run_official(cfg, layer, x, pos, keep)[keep.bool()])


def test_float32_with_the_official_rotary_embedding_and_round_trip():
    cfg, layer = official(bias=True)
    layer = layer.float()
    m = convert(cfg, layer)
    x = _x(dtype=torch.float32)
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad():
        cos_sin = qwen3_next.Qwen3NextRotaryEmbedding(cfg)(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1).expand(2, 1, T, T)
        want = layer(x, position_embeddings=cos_sin, attention_mask=mask)[0]
    torch.testing.assert_close(m(x), want)
    back = to_official(m)
    assert sorted(back) == sorted(layer.state_dict())
    assert all(torch.equal(back[k], v) for k, v in layer.state_dict().items())


def test_older_top_level_rope_fields_and_refusals():
    cfg, layer = official(factor=0.5, theta=500.0)
    fields = dict(hidden_size=C, num_attention_heads=H, num_key_value_heads=G, rms_norm_eps=1e-5)
    m = from_official("qwen3_next", layer.state_dict(), rope_theta=500.0, partial_rotary_factor=0.5, **fields)
    assert m.attention.head_dim == D  # read from k_proj.weight
    x = _x()
    assert_matches(m(x), run_official(cfg, layer, x))
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        from_official("qwen3_next", layer.state_dict(), rope_parameters={"rope_type": "yarn"}, **fields)
    with pytest.raises(ValueError, match=r"head_dim=8 x partial_rotary_factor=0.1 gives 0 rotated channels"):
        from_official("qwen3_next", layer.state_dict(), partial_rotary_factor=0.1, **fields)
    with pytest.raises(ValueError, match=r"missing \['k_proj.bias'"):
        from_official("qwen3_next", layer.state_dict(), attention_bias=True, **fields)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_bfloat16_on_cuda_follows_the_transformers_layer():
    """The converted layer (cached decoding) and transformers' own (the shipped float32 norm, the
    official rotary table), both bfloat16 on CUDA: the converted layer's error against float64 is at
    most 2x transformers' plus a noise floor (docs/testing.md)."""
    cfg, layer = official(factor=0.25)
    x = _x(L=19)
    want = run_official(cfg, layer, x)
    for norm in (layer.q_norm, layer.k_norm):
        del norm.forward  # the shipped norm again
    layer = layer.to("cuda", torch.bfloat16)
    m = convert(cfg, layer).cuda()
    assert m.attention.out_proj.weight.dtype == torch.bfloat16
    xb, pos = x.to("cuda", torch.bfloat16), torch.arange(19, device="cuda").expand(2, 19)
    cos_sin = qwen3_next.Qwen3NextRotaryEmbedding(cfg).cuda()(xb, pos)
    mask = torch.full((19, 19), float("-inf"), device="cuda").triu(1).expand(2, 1, 19, 19).to(torch.bfloat16)
    theirs = layer(xb, position_embeddings=cos_sin, attention_mask=mask)[0].double().cpu()
    cache = m.make_kv_cache(2, 19)
    ours = torch.cat([m(xb[:, :12], kv_cache=cache)] + [m(xb[:, t : t + 1], kv_cache=cache) for t in range(12, 19)],
                     dim=1).double().cpu()  # fmt: skip
    scale = float(want.abs().max())
    e_ours, e_theirs = float((ours - want).abs().max()), float((theirs - want).abs().max())
    assert e_ours <= 2 * e_theirs + 1e-3 * scale, (e_ours, e_theirs, scale)
