"""The gated-attention paper's Qwen3 layer (qiuzh20/gated_attention ``Qwen3Attention``)
-> multihead, against a re-implementation of the official eager forward written
here from its description: q_proj rows per key/value group [r heads' queries |
their gates], q/k RMS norm with gain w, full rotate-half rope, repeat_kv,
softmax(q·kᵀ/√D + causal), gate after attention, o_proj."""

from __future__ import annotations

import pytest
import torch
from support.attention import assert_matches

from multihead.convert import from_official, official_kinds
from multihead.convert.official.qwen_gated import to_official

F64 = torch.float64
C, H, G, D, T = 12, 4, 2, 6, 7


def official_state(*, headwise, bias=False, qk_norm=True, heads=H, groups=G, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64) * 0.5  # noqa: E731
    E = 1 if headwise else D
    sd = {"q_proj.weight": r(heads * (D + E), C), "k_proj.weight": r(groups * D, C),
          "v_proj.weight": r(groups * D, C), "o_proj.weight": r(C, heads * D)}  # fmt: skip
    if bias:
        sd.update({n.replace("weight", "bias"): r(w.shape[0]) for n, w in list(sd.items())})
    if qk_norm:
        sd["q_norm.weight"], sd["k_norm.weight"] = 1 + r(D), 1 + r(D)
    return sd


def rotate_half_rope(x, pos, theta):
    """x (B, n, T, D), pos (B, T): cos/sin of pos·θ^(-2i/D), both halves, rotate_half."""
    inv = theta ** (-torch.arange(0, D, 2, dtype=F64) / D)
    ang = pos[..., None].to(F64) * inv  # (B, T, D/2)
    emb = torch.cat([ang, ang], -1)[:, None]  # (B, 1, T, D)
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * emb.cos() + rot * emb.sin()


def official_forward(sd, x, *, headwise, heads=H, groups=G, theta=10000.0, eps=1e-6, pos=None, keep=None):
    """The official eager ``Qwen3Attention.forward`` (self-attention, causal + padding mask)."""
    B, L, _ = x.shape
    r, E = heads // groups, 1 if headwise else D

    def lin(name, t):
        return t @ sd[f"{name}.weight"].T + sd.get(f"{name}.bias", 0)

    per_group = lin("q_proj", x).view(B, L, groups, -1)  # (B, T, G, r·D + r·E)
    q, gate = per_group.split([r * D, r * E], dim=-1)
    gate = gate.reshape(B, L, heads, E)
    q = q.reshape(B, L, heads, D).transpose(1, 2)
    k = lin("k_proj", x).view(B, L, groups, D).transpose(1, 2)
    v = lin("v_proj", x).view(B, L, groups, D).transpose(1, 2)
    if "q_norm.weight" in sd:
        q = sd["q_norm.weight"] * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        k = sd["k_norm.weight"] * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    pos = torch.arange(L).expand(B, L) if pos is None else pos
    q, k = rotate_half_rope(q, pos, theta), rotate_half_rope(k, pos, theta)
    k = k[:, :, None].expand(B, groups, r, L, D).reshape(B, heads, L, D)  # repeat_kv
    v = v[:, :, None].expand(B, groups, r, L, D).reshape(B, heads, L, D)
    mask = torch.full((L, L), float("-inf"), dtype=F64).triu(1).expand(B, 1, L, L)
    if keep is not None:
        mask = mask.masked_fill(~keep[:, None, None, :].bool(), float("-inf"))
    p = torch.softmax(q @ k.transpose(2, 3) / D**0.5 + mask, dim=-1)
    o = (p @ v).transpose(1, 2) * torch.sigmoid(gate)  # (B, T, H, D)
    return lin("o_proj", o.reshape(B, L, heads * D))


def config(*, headwise, bias=False, qk_norm=True, heads=H, groups=G, **extra):
    flag = "headwise_attn_output_gate" if headwise else "elementwise_attn_output_gate"
    return {"hidden_size": C, "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": D,
            flag: True, "qkv_bias": bias, "use_qk_norm": qk_norm, **extra}  # fmt: skip


def _x(B=2, L=T, seed=1):
    return torch.randn(B, L, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


def test_the_kind_is_listed():
    assert {"qwen_gated", "qwen3_next"} <= set(official_kinds())


@pytest.mark.parametrize("groups", [G, H, 1])
@pytest.mark.parametrize("headwise", [True, False])
@pytest.mark.parametrize("bias,qk_norm", [(False, True), (True, False)])
def test_matches_the_official_forward(headwise, groups, bias, qk_norm):
    sd = official_state(headwise=headwise, bias=bias, qk_norm=qk_norm, groups=groups)
    m = from_official("qwen_gated", sd, **config(headwise=headwise, bias=bias, qk_norm=qk_norm, groups=groups,
                                                 rope_theta=500.0, rms_norm_eps=1e-5))  # fmt: skip
    x = _x()
    assert m.attention.gate == ("headwise" if headwise else "elementwise")
    assert_matches(m(x), official_forward(sd, x, headwise=headwise, groups=groups, theta=500.0, eps=1e-5))
    # the layout matters: the per-head layout of Qwen3-Next reads other rows (unless one group of one head)
    wrong = dict(sd)
    wrong["q_proj.weight"] = sd["q_proj.weight"].flip(0)
    assert not torch.allclose(from_official("qwen_gated", wrong, **config(headwise=headwise, bias=bias,
                              qk_norm=qk_norm, groups=groups, rope_theta=500.0, rms_norm_eps=1e-5))(x), m(x))  # fmt: skip


@pytest.mark.parametrize("headwise", [True, False])
def test_single_token_decoding_with_the_cache_equals_the_official_forward(headwise):
    sd = official_state(headwise=headwise)
    m = from_official("qwen_gated", sd, **config(headwise=headwise))
    x = _x()
    want = official_forward(sd, x, headwise=headwise)
    cache = m.make_kv_cache(2, T)
    steps = [m(x[:, : T - 3], kv_cache=cache)]
    steps += [m(x[:, t : t + 1], kv_cache=cache) for t in range(T - 3, T)]  # one token at a time
    assert cache.length == T
    assert_matches(torch.cat(steps, dim=1), want)


def test_padding_and_positions_as_the_official_masks():
    sd = official_state(headwise=False)
    m = from_official("qwen_gated", sd, **config(headwise=False))
    x = _x()
    keep = torch.tensor([[1] * T, [0, 0] + [1] * (T - 2)])  # left padding, Hugging Face's 0/1 mask
    pos = (keep.cumsum(-1) - 1).clamp(min=0)
    got = m(x, attention_mask=keep, position_ids=pos)
    want = official_forward(sd, x, headwise=False, pos=pos, keep=keep)
    assert_matches(got[keep.bool()], want[keep.bool()])
    with pytest.raises(ValueError, match=r"2-D padding mask \[B, S\], got shape \(2, 1, 7, 7\)"):
        m(x, attention_mask=torch.ones(2, 1, T, T))


@pytest.mark.parametrize("headwise", [True, False])
def test_round_trip_to_the_official_layout(headwise):
    sd = official_state(headwise=headwise, bias=True)
    back = to_official(from_official("qwen_gated", sd, **config(headwise=headwise, bias=True)))
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_both_flags_run_headwise_as_the_official_if_elif():
    sd = official_state(headwise=True)
    m = from_official("qwen_gated", sd, **config(headwise=True, elementwise_attn_output_gate=True))
    assert m.attention.gate == "headwise"


def test_float32_weights_give_a_float32_module():
    sd = {k: v.float() for k, v in official_state(headwise=False).items()}
    m = from_official("qwen_gated", sd, **config(headwise=False))
    x = _x().float()
    assert m.attention.out_proj.weight.dtype == torch.float32
    want = official_forward({k: v.double() for k, v in sd.items()}, x.double(), headwise=False)
    torch.testing.assert_close(m(x), want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"headwise_attn_output_gate": False}, "no output gate"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only the default rope"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"num_key_value_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ({"qkv_bias": True}, r"missing \['k_proj.bias', 'o_proj.bias', 'q_proj.bias', 'v_proj.bias'\]"),
        ({"use_qk_norm": False}, r"unexpected \['k_norm.weight', 'q_norm.weight'\]"),
        ({"head_dim": 4}, r"official parameter shapes \{'q_proj.weight': \(28, 12\)"),
    ],
)
def test_configurations_that_do_not_fit_are_refused_with_their_values(change, match):
    sd = official_state(headwise=True)
    with pytest.raises(ValueError, match=match):
        from_official("qwen_gated", sd, **{**config(headwise=True), **change})
