"""MultiHeadAttention against the NumPy float64 reference; construction and
dropout.

Call-time validation and defined outputs: test_attention_calls.py; gradients
and property tests: test_attention_props.py; state-dict layouts:
test_attention_state.py; the cache: test_kv_cache.py.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch
from support.modules import random_module as _module

from multihead import MultiHeadAttention
from multihead.reference import attention as ref_attention
from multihead.reference import multihead_attention_list, multihead_cross_attention_list

F64 = torch.float64
TOL = 1e-10




def _assert_ref(actual: torch.Tensor, expected: np.ndarray, tol: float = TOL) -> None:
    """max abs error <= tol, scaled by the output magnitude."""
    actual = actual.detach().numpy()
    assert actual.shape == expected.shape
    assert not np.isnan(actual).any()
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= tol * scale, f"max abs error {err:.3e} > {tol * scale:.3e}"




def _np_linear(x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
    y = x @ weight.detach().numpy().T  # torch Linear: x W^T + b
    return y if bias is None else y + bias.detach().numpy()


def _np_mask(attn_mask, key_mask, B, T, S):
    """AND on "may attend" of a (T, S) mask and a (B, S) padding mask, in NumPy."""
    a = None if attn_mask is None else attn_mask.numpy()
    if a is not None and a.ndim == 2:
        a = a[None, None]  # (T, S) -> (1, 1, T, S)
    p = None if key_mask is None else key_mask.numpy()[:, None, None, :]  # (B, 1, 1, S)
    if a is None or p is None:
        return a if p is None else p
    if a.dtype == np.bool_ and p.dtype == np.bool_:
        return a & p
    if a.dtype == np.bool_:
        a, p = p, a
    if p.dtype == np.bool_:
        return np.where(p, a, -np.inf)
    return a + p


def reference_forward(m, query, key=None, value=None, *, attn_mask=None, key_mask=None,
                      is_causal=False, causal_alignment="top_left", return_weights=False):
    """The module's forward, computed with NumPy projections and reference.attention."""
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    w = m.projection_weights()
    xq = query.detach().numpy()
    xk = xq if key is None else key.detach().numpy()
    xv = xk if value is None else value.detach().numpy()
    B, T, _ = xq.shape
    S = xk.shape[1]
    q = _np_linear(xq, *w["q"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k = _np_linear(xk, *w["k"]).reshape(B, S, G, D).transpose(0, 2, 1, 3)  # (B, G, S, D)
    v = _np_linear(xv, *w["v"]).reshape(B, S, G, D).transpose(0, 2, 1, 3)
    mask = _np_mask(attn_mask, key_mask, B, T, S)
    res = ref_attention(q, k, v, mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
                        return_weights=True)
    out, weights = res
    concat = out.transpose(0, 2, 1, 3).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, H*D)
    y = _np_linear(concat, m.out_proj.weight, m.out_proj.bias)
    return (y, weights) if return_weights else y


# ---------------------------------------------------------------- the sweep
SIZES = {
    "e5h5d1": {"embed_dim": 5, "num_heads": 5},
    "e12h4": {"embed_dim": 12, "num_heads": 4},
    "e10h4d3": {"embed_dim": 10, "num_heads": 4, "head_dim": 3},
    "gqa_kv1": {"embed_dim": 12, "num_heads": 4, "num_kv_heads": 1},
    "gqa_kv2": {"embed_dim": 12, "num_heads": 4, "num_kv_heads": 2},
    "gqa_kvH": {"embed_dim": 12, "num_heads": 4, "num_kv_heads": 4},
}
KINDS = {  # (kdim, vdim, S) with T = 7; None S = self-attention
    "self": (None, None, None),
    "cross": (None, None, 5),
    "cross_kdim_eq_vdim": (6, 6, 4),
    "cross_kdim_ne_vdim": (7, 9, 9),
}
MASKS = [
    "none", "causal_tl", "causal_br", "bool", "float", "kpm_bool", "kpm_float",
    "bool+kpm_bool", "float+kpm_bool", "bool+kpm_float", "float+kpm_float", "causal_br+bool+kpm_bool",
    "bool4d_batch+kpm_float", "float4d_heads+causal_tl",
]


def _masks(kind: str, B: int, H: int, T: int, S: int, g: torch.Generator):
    attn = kpm = None
    parts = kind.split("+")
    causal, align = "causal" in kind, "bottom_right" if "causal_br" in parts else "top_left"
    if "bool" in parts:
        attn = torch.rand(T, S, generator=g) > 0.3
    if "float" in parts:
        attn = torch.randn(T, S, generator=g, dtype=F64)
        attn[torch.rand(T, S, generator=g) < 0.2] = float("-inf")
    if "kpm_bool" in parts:
        kpm = torch.rand(B, S, generator=g) > 0.3
        kpm[:, 0] = True
    if "kpm_float" in parts:
        kpm = torch.randn(B, S, generator=g, dtype=F64)
        kpm[torch.rand(B, S, generator=g) < 0.2] = float("-inf")
    if "bool4d_batch" in parts:  # (B, 1, T, S)
        attn = torch.rand(B, 1, T, S, generator=g) > 0.3
    if "float4d_heads" in parts:  # (1, H, T, S): per head, folded per group by GQA paths
        attn = torch.randn(1, H, T, S, generator=g, dtype=F64)
        attn[torch.rand(1, H, T, S, generator=g) < 0.2] = float("-inf")
    return attn, kpm, causal, align


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("size", list(SIZES))
def test_module_matches_reference(size, kind, mask_kind, backend):
    kdim, vdim, S = KINDS[kind]
    m = _module(embed_dim=SIZES[size]["embed_dim"], num_heads=SIZES[size]["num_heads"],
                num_kv_heads=SIZES[size].get("num_kv_heads"), head_dim=SIZES[size].get("head_dim"),
                kdim=kdim, vdim=vdim)
    g = torch.Generator().manual_seed(zlib.crc32(f"{size}/{kind}/{mask_kind}".encode()))
    B, T, C = 2, 7, m.embed_dim
    x = torch.randn(B, T, C, generator=g, dtype=F64)
    key = value = None
    if S is not None:
        key = torch.randn(B, S, m.kdim, generator=g, dtype=F64)
        value = torch.randn(B, S, m.vdim, generator=g, dtype=F64) if kind != "cross" else None
    S = T if S is None else S
    attn, kpm, causal, align = _masks(mask_kind, B, m.num_heads, T, S, g)
    kwargs = {"attn_mask": attn, "key_mask": kpm, "is_causal": causal, "causal_alignment": align}
    expected, weights = reference_forward(m, x, key, value, return_weights=True, **kwargs)
    _assert_ref(m(x, key, value, backend=backend, **kwargs), expected)
    if backend == "math":
        out, w = m(x, key, value, backend=backend, return_weights=True, **kwargs)
        _assert_ref(out, expected)
        _assert_ref(w, weights)
    else:
        with pytest.raises(ValueError, match="return_weights"):
            m(x, key, value, backend=backend, return_weights=True, **kwargs)


@pytest.mark.parametrize("qkv_bias,out_bias", [(True, True), (False, False), (True, False), (False, True)])
def test_biases_on_and_off_match_reference(qkv_bias, out_bias):
    m = _module(embed_dim=12, num_heads=3, num_kv_heads=1, qkv_bias=qkv_bias, out_bias=out_bias)
    assert (m.qkv_proj.bias is None) != qkv_bias and (m.out_proj.bias is None) != out_bias
    x = torch.randn(3, 6, 12, dtype=F64)
    _assert_ref(m(x, is_causal=True), reference_forward(m, x, is_causal=True))


def _head_lists(m):
    """Per-head (C, D) matrices in the textbook reference's x @ W convention."""
    H, D = m.num_heads, m.head_dim
    w = m.projection_weights()
    return [[w[n][0][h * D:(h + 1) * D].detach().numpy().T for h in range(H)] for n in "qkv"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("embed_dim,num_heads", [(5, 5), (12, 4), (9, 3)])
def test_zero_bias_module_matches_textbook_list_reference(embed_dim, num_heads, causal):
    m = _module(embed_dim=embed_dim, num_heads=num_heads, qkv_bias=False, out_bias=False)
    Wqs, Wks, Wvs = _head_lists(m)
    Wp = m.out_proj.weight.detach().numpy().T  # (H*D, C)
    x = torch.randn(2, 7, embed_dim, dtype=F64)
    expected = multihead_attention_list(x.numpy(), Wqs, Wks, Wvs, Wp, do_mask=causal)
    _assert_ref(m(x, is_causal=causal), expected)
    xv = torch.randn(2, 4, embed_dim, dtype=F64)
    expected = multihead_cross_attention_list(x.numpy(), xv.numpy(), Wqs, Wks, Wvs, Wp)
    _assert_ref(m(x, xv), expected)


def test_gqa_equals_mha_with_repeat_interleaved_kv_weights():
    """Query head h reads key/value head h // (H // G): repeat_interleave, not tile."""
    H, G, D, C = 6, 2, 3, 12
    gqa = _module(embed_dim=C, num_heads=H, num_kv_heads=G, head_dim=D)
    mha = _module(embed_dim=C, num_heads=H, head_dim=D)
    w = gqa.projection_weights()

    def expand(t):  # (G*D, ...) -> (H*D, ...)
        return t.reshape(G, D, *t.shape[1:]).repeat_interleave(H // G, dim=0).reshape(H * D, *t.shape[1:])

    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.cat([w["q"][0], expand(w["k"][0]), expand(w["v"][0])]))
        mha.qkv_proj.bias.copy_(torch.cat([w["q"][1], expand(w["k"][1]), expand(w["v"][1])]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 5, C, dtype=F64)
    for backend in ("math", "sdpa"):
        torch.testing.assert_close(gqa(x, is_causal=True, backend=backend),
                                   mha(x, is_causal=True, backend=backend), rtol=0, atol=1e-12)


def test_num_kv_heads_equal_heads_is_bitwise_mha():
    a = _module(embed_dim=12, num_heads=4, num_kv_heads=4)
    b = _module(embed_dim=12, num_heads=4)
    x = torch.randn(2, 5, 12, dtype=F64)
    for backend in ("math", "sdpa"):
        assert torch.equal(a(x, is_causal=True, backend=backend), b(x, is_causal=True, backend=backend))


def test_float32_module_matches_reference_at_default_tolerance():
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=2).float()
    x = torch.randn(2, 7, 12)
    ref = reference_forward(m, x, is_causal=True)
    for backend in ("math", "sdpa"):
        torch.testing.assert_close(m(x, is_causal=True, backend=backend), torch.from_numpy(ref).float())


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs,match", [
    ({"embed_dim": 10, "num_heads": 4}, r"embed_dim=10 is not divisible by num_heads=4"),
    ({"embed_dim": 7, "num_heads": 2}, r"embed_dim=7 .*num_heads=2"),
    ({"embed_dim": 8, "num_heads": 0}, r"num_heads must be a positive int, got num_heads=0"),
    ({"embed_dim": 8, "num_heads": -2}, r"num_heads must be a positive int, got num_heads=-2"),
    ({"embed_dim": 0, "num_heads": 2}, r"embed_dim must be a positive int, got embed_dim=0"),
    ({"embed_dim": -4, "num_heads": 2}, r"embed_dim must be a positive int, got embed_dim=-4"),
    ({"embed_dim": 8, "num_heads": 2, "head_dim": 0}, r"head_dim must be a positive int, got head_dim=0"),
    ({"embed_dim": 8, "num_heads": 2, "head_dim": -1}, r"head_dim must be a positive int, got head_dim=-1"),
    ({"embed_dim": 12, "num_heads": 4, "num_kv_heads": 3}, r"num_kv_heads=3 must divide num_heads=4"),
    ({"embed_dim": 12, "num_heads": 4, "num_kv_heads": 8}, r"num_kv_heads=8 must divide num_heads=4"),
    ({"embed_dim": 12, "num_heads": 4, "num_kv_heads": 0}, r"num_kv_heads must be a positive int, got num_kv_heads=0"),
    ({"embed_dim": 12, "num_heads": 4, "kdim": 0}, r"kdim must be a positive int, got kdim=0"),
    ({"embed_dim": 12, "num_heads": 4, "vdim": -3}, r"vdim must be a positive int, got vdim=-3"),
])
def test_invalid_sizes_raise_value_error_naming_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


@pytest.mark.parametrize("num_heads", [2.0, True, "2", None])
def test_non_int_sizes_raise_type_error_naming_values(num_heads):
    with pytest.raises(TypeError, match=r"num_heads must be a positive int, got num_heads=" + re.escape(repr(num_heads))):
        MultiHeadAttention(8, num_heads)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, False, "0.1", None])
def test_invalid_dropout_raises(dropout):
    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\), got dropout=" + re.escape(repr(dropout))):
        MultiHeadAttention(8, 2, dropout=dropout)


def test_head_dim_override_decouples_from_embed_dim():
    m = MultiHeadAttention(10, 4, head_dim=3, num_kv_heads=2)
    assert m.qkv_proj.weight.shape == ((4 + 2 * 2) * 3, 10)
    assert m.out_proj.weight.shape == (10, 12)
    assert "head_dim=3" in repr(m) and "num_kv_heads=2" in repr(m)


def test_split_projections_equal_packed_path_with_equal_weights():
    """kdim/vdim != embed_dim (split q/k/v_proj) gives the packed result when the
    extra input columns are zero: k_proj = [W_k | junk] on [key | 0]."""
    C, H, G, extra = 12, 4, 2, 3
    fused = _module(embed_dim=C, num_heads=H, num_kv_heads=G)
    split = _module(seed=1, embed_dim=C, num_heads=H, num_kv_heads=G, kdim=C + extra, vdim=C + extra)
    assert not split.fused and fused.fused and not hasattr(split, "qkv_proj")
    w = fused.projection_weights()
    with torch.no_grad():
        split.q_proj.weight.copy_(w["q"][0])
        split.q_proj.bias.copy_(w["q"][1])
        for n in "kv":
            proj = getattr(split, f"{n}_proj")
            proj.weight[:, :C].copy_(w[n][0])  # the last `extra` columns keep their junk
            proj.bias.copy_(w[n][1])
        split.out_proj.load_state_dict(fused.out_proj.state_dict())
    x, key, value = (torch.randn(2, n, C, dtype=F64) for n in (5, 6, 6))
    pad = torch.zeros(2, 6, extra, dtype=F64)
    kpm = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    for backend in ("math", "sdpa"):
        a = fused(x, key, value, key_mask=kpm, is_causal=True, backend=backend)
        b = split(x, torch.cat([key, pad], -1), torch.cat([value, pad], -1), key_mask=kpm,
                  is_causal=True, backend=backend)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # the fused self-attention path equals the sliced projections (key = value = query)
    torch.testing.assert_close(fused(x), fused(x, x, x), rtol=0, atol=1e-12)
    torch.testing.assert_close(fused(x), fused(x, x), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- dropout
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_only_in_training(backend):
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=2)
    drop = MultiHeadAttention(12, 4, num_kv_heads=2, dropout=0.5, dtype=F64)
    drop.load_state_dict(m.state_dict())
    x = torch.randn(2, 9, 12, dtype=F64)
    drop.eval()
    a, b = drop(x, backend=backend), drop(x, backend=backend)
    assert torch.equal(a, b) and torch.equal(a, m(x, backend=backend))
    drop.train()
    torch.manual_seed(0)
    c = drop(x, backend=backend)
    d = drop(x, backend=backend)
    assert not torch.allclose(c, a) and not torch.allclose(c, d)
    torch.manual_seed(0)
    assert torch.equal(c, drop(x, backend=backend))  # seeded: reproducible


def test_training_weights_are_pre_dropout():
    m = _module(embed_dim=8, num_heads=2)
    drop = MultiHeadAttention(8, 2, dropout=0.5, dtype=F64)
    drop.load_state_dict(m.state_dict())
    x = torch.randn(2, 5, 8, dtype=F64)
    _, w_eval = m(x, return_weights=True)
    drop.train()
    out, w = drop(x, return_weights=True)
    assert torch.equal(w, w_eval)
    assert not torch.allclose(out, m(x))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_zero_in_training_is_bitwise_eval_and_draws_no_random_numbers(backend):
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=1)
    x = torch.randn(2, 6, 12, dtype=F64)
    kpm = torch.rand(2, 6) > 0.2
    ev = m.eval()(x, key_mask=kpm, is_causal=True, backend=backend)
    state = torch.get_rng_state()
    tr = m.train()(x, key_mask=kpm, is_causal=True, backend=backend)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(ev, tr)


# ---------------------------------------------------------------- rope / qk_norm (beyond tests/modules/test_contract.py)
def test_rope_on_odd_head_dim_and_one_key_value_head_matches_numpy():
    from support.kinds import numpy_forward

    m = _module(4, embed_dim=15, num_heads=3, num_kv_heads=1, rope={"rotary_dim": 2, "interleaved": True},
                qk_norm=True)  # D = 5  # fmt: skip
    x = torch.randn(2, 7, 15, dtype=F64)
    _assert_ref(m(x, is_causal=True), numpy_forward(m, x, is_causal=True)[0])


def test_gradcheck_with_rope_and_qk_norm():
    m = _module(5, embed_dim=8, num_heads=2, num_kv_heads=1, rope={"rotary_dim": 2}, qk_norm=True)
    x = torch.randn(1, 3, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True), (x,))
    m(x).sum().backward()
    assert m.qk_norm.q_norm.weight.grad is not None and m.qk_norm.k_norm.weight.grad is not None


def test_flat_hugging_face_norm_names_load():
    m = MultiHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    sd = {k.replace("qk_norm.", ""): torch.full_like(v, 2.0) if "norm" in k else v for k, v in m.state_dict().items()}
    other = MultiHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    other.load_state_dict(sd)  # Hugging Face's flat q_norm.weight / k_norm.weight (Qwen3, OLMo-2)
    assert torch.equal(other.qk_norm.k_norm.weight, torch.full((6,), 2.0))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [(dict(rope={"rotary_dim": 5}), ValueError, "rotary_dim=5"), (dict(rope={"rotary_dim": 8}), ValueError, "head_dim=6"),
     (dict(rope="yes"), TypeError, "rope")],
)
def test_rope_construction_errors_name_the_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(24, 4, **kwargs)


def test_positions_of_a_wrong_type_are_refused():
    m, x = MultiHeadAttention(24, 4, rope=True), torch.randn(2, 5, 24)
    with pytest.raises(TypeError, match="torch.bool"):
        m(x, positions=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="list"):
        m(x, positions=[0, 1, 2, 3, 4])
