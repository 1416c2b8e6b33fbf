"""``multihead.functional.attention`` against the NumPy float64 reference,
plus the backend registry, GQA head order and determinism."""


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.attention import (
    BACKENDS,
    F64,
    assert_matches,
    check_against_reference,
    grads,
    make_qkv,
    run_reference,
)
from support.paths import assert_paths_agree

from multihead.functional import (
    AUTO_ORDER,
    attention,
    list_backends,
    merge_masks,
    padding_mask_from_lengths,
    sliding_window_mask,
)

# (B, H, G, T, S, D, Dv): odd head dims 1, 3, 5, 59; lengths 1, 7, 63, 113;
# G in {1, 2, H} with H = 4; S != T; Dv != D; B == T == H.
SHAPES = [
    (2, 4, 1, 1, 1, 1, 1),
    (1, 4, 2, 7, 113, 3, 5),
    (2, 4, 4, 63, 7, 5, 3),
    (1, 4, 2, 63, 113, 59, 59),
    (3, 4, 1, 7, 7, 59, 1),
    (2, 4, 4, 1, 113, 3, 3),
    (4, 4, 4, 4, 7, 5, 5),
]


def _bool(rng, shape, p=0.7):
    return torch.from_numpy(rng.random(shape) < p)


def _float(rng, shape, p_inf=0.1):
    m = torch.from_numpy(rng.standard_normal(shape))
    return m.masked_fill(torch.from_numpy(rng.random(shape) < p_inf), float("-inf"))


def _lengths(rng, B, S):
    return torch.from_numpy(rng.integers(0, S + 1, size=B))


# Each kind maps (rng, B, H, T, S) to the keyword arguments of the call.
KINDS = {
    "none": lambda r, B, H, T, S: {},
    "causal_top_left": lambda r, B, H, T, S: {"is_causal": True},
    "causal_bottom_right": lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"},
    "bool_2d": lambda r, B, H, T, S: {"attn_mask": _bool(r, (T, S))},
    "bool_4d": lambda r, B, H, T, S: {"attn_mask": _bool(r, (B, H, T, S))},
    "bool_1h1s": lambda r, B, H, T, S: {"attn_mask": _bool(r, (1, H, 1, S))},
    "float_2d": lambda r, B, H, T, S: {"attn_mask": _float(r, (T, S))},
    "float_b1ts": lambda r, B, H, T, S: {"attn_mask": _float(r, (B, 1, T, S))},
    "padding_right": lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths(_lengths(r, B, S), S)},
    "padding_left_causal_br": lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths(_lengths(r, B, S), S, left=True),
        "is_causal": True, "causal_alignment": "bottom_right"},
    "bool_and_causal": lambda r, B, H, T, S: {
        "attn_mask": _bool(r, (B, 1, T, S)), "is_causal": True},
    "float_and_causal_br": lambda r, B, H, T, S: {
        "attn_mask": _float(r, (1, H, T, S)), "is_causal": True,
        "causal_alignment": "bottom_right"},
    "padding_and_float": lambda r, B, H, T, S: {
        "attn_mask": merge_masks(padding_mask_from_lengths(_lengths(r, B, S), S),
                                 _float(r, (T, S)))},
    "sliding_window": lambda r, B, H, T, S: {
        "attn_mask": sliding_window_mask(T, S, window=3)},
    "sliding_window_br": lambda r, B, H, T, S: {
        "attn_mask": sliding_window_mask(T, S, window=5, alignment="bottom_right")},
    "scale": lambda r, B, H, T, S: {"scale": 0.37},
    "scale_causal": lambda r, B, H, T, S: {"scale": 2.5, "is_causal": True},
}

CASES = [
    pytest.param(kind, SHAPES[(i + j) % len(SHAPES)], id=f"{kind}-{j}")
    for i, kind in enumerate(KINDS)
    for j in (0, 3)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_matches_reference_float64(kind, shape, backend, seed):
    B, H, G, T, S, D, Dv = shape
    q, k, v = make_qkv(seed, B, H, G, T, S, D, Dv)
    kw = KINDS[kind](seed, B, H, T, S)
    out = check_against_reference(q, k, v, backend, **kw)
    assert out.shape == (B, H, T, Dv) and out.dtype == F64


@pytest.mark.parametrize("kind", ["none", "causal_bottom_right", "bool_4d", "float_2d",
                                  "padding_left_causal_br", "float_and_causal_br"])
def test_sdpa_gradients_equal_math(kind, seed):
    B, H, G, T, S, D, Dv = 2, 4, 2, 7, 9, 5, 3
    q, k, v = make_qkv(seed, B, H, G, T, S, D, Dv, requires_grad=True)
    kw = KINDS[kind](seed, B, H, T, S)
    g_math = grads(attention(q, k, v, backend="math", **kw), q, k, v)
    g_sdpa = grads(attention(q, k, v, backend="sdpa", **kw), q, k, v)
    for a, b in zip(g_sdpa, g_math):
        assert_matches(a, b, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_matches_reference(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 63, 113, 59, 5, dtype=torch.float32)
    mask = _float(seed, (2, 1, 63, 113))
    out = attention(q, k, v, attn_mask=mask, is_causal=True, backend=backend)
    want, _ = run_reference(q, k, v, mask, is_causal=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1.3e-6, atol=1e-5)


# --------------------------------------------------------------- backends


def test_list_backends():
    names = list_backends()
    assert names == sorted(names)
    assert {"math", "sdpa"} <= set(names)
    assert set(AUTO_ORDER) <= set(names)


def test_unknown_backend_lists_valid_names(seed):
    q, k, v = make_qkv(seed, 1, 2, 2, 3, 3, 4)
    with pytest.raises(ValueError, match=r"unknown backend 'flash'") as info:
        attention(q, k, v, backend="flash")
    for name in ["auto", *list_backends()]:
        assert repr(name) in str(info.value)


def test_sdpa_refuses_weights_with_gradients_and_says_why(seed):
    q, k, v = make_qkv(seed, 1, 2, 2, 3, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve.*return_weights=True.*carry no gradient"):
        attention(q, k, v, backend="sdpa", return_weights=True)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"attn_mask": torch.ones(3, 5, dtype=torch.bool)}])
def test_auto_with_weights_that_need_gradients_uses_math(kw, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 3, 5, 4, requires_grad=True)
    out_a, w_a = attention(q, k, v, return_weights=True, **kw)
    out_m, w_m = attention(q, k, v, backend="math", return_weights=True, **kw)
    assert torch.equal(out_a, out_m) and torch.equal(w_a, w_m)  # auto runs the math path itself: bitwise


def test_auto_without_weights_uses_first_of_auto_order(seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 7, 5, 4)
    first = AUTO_ORDER[0]
    # auto runs that backend itself: the same operations, bitwise
    assert torch.equal(attention(q, k, v, is_causal=True),
                       attention(q, k, v, is_causal=True, backend=first))


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_return_value_forms(backend, seed):
    q, k, v = make_qkv(seed, 1, 2, 1, 3, 4, 5, 6)
    out = attention(q, k, v, backend=backend)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 3, 6)


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize(("B", "H", "G", "T", "S"), [(2, 4, 2, 7, 5), (1, 4, 1, 1, 9), (3, 4, 4, 6, 6)])
def test_weights_shape_and_row_sums(B, H, G, T, S, seed):
    q, k, v = make_qkv(seed, B, H, G, T, S, 3)
    mask = _bool(seed, (B, 1, T, S), p=0.4)
    mask[0, 0, 0] = False  # at least one empty row
    for backend in ("auto", "math"):
        out, w = attention(q, k, v, attn_mask=mask, return_weights=True, backend=backend)
        assert w.shape == (B, H, T, S) and w.dtype == q.dtype
        sums = w.sum(-1)
        empty = ~mask.expand(B, H, T, S).any(-1)
        assert torch.equal(sums[empty], torch.zeros_like(sums[empty]))
        torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]), rtol=0, atol=1e-12)
        assert bool((w >= 0).all()) and not bool(w[~mask.expand(B, H, T, S)].any())


# -------------------------------------------------------------------- GQA


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_head_order_is_repeat_interleave(backend, causal):
    """kv head g holds the constant value g, so head h must output h // (H // G)."""
    B, H, G, T, S, D = 1, 6, 3, 4, 5, 2
    q = torch.randn(B, H, T, D, dtype=F64)
    k = torch.randn(B, G, S, D, dtype=F64)
    v = torch.arange(G, dtype=F64).view(1, G, 1, 1).expand(B, G, S, 3).contiguous()
    out = attention(q, k, v, is_causal=causal, backend=backend)
    heads = out[0, :, :, :].mean(dim=(1, 2))
    torch.testing.assert_close(heads, torch.tensor([0, 0, 1, 1, 2, 2], dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"is_causal": True, "causal_alignment": "bottom_right"}])
def test_gqa_equals_expanded_mha(backend, kw, seed):
    B, H, G, T, S, D = 2, 4, 2, 7, 9, 5
    q, k, v = make_qkv(seed, B, H, G, T, S, D, 3)
    mask = _bool(seed, (B, H, T, S))
    for m in (None, mask):
        got = attention(q, k, v, attn_mask=m, backend=backend, **kw)
        want = attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                         attn_mask=m, backend=backend, **kw)
        assert_matches(got, want, 1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_g_equals_h_is_bitwise_mha(causal, seed):
    """With G = H each backend is bitwise the plain MHA computation it wraps."""
    q, k, v = make_qkv(seed, 2, 4, 4, 7, 7, 5, 3)
    scale = 1 / np.sqrt(5)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    manual = torch.softmax(scores, dim=-1) @ v
    got = attention(q, k, v, is_causal=causal, backend="math", scale=scale)
    assert_paths_agree(got, manual)
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    assert torch.equal(attention(q, k, v, is_causal=causal, backend="sdpa", scale=scale), fused)  # same kernel


# ------------------------------------------------------------ determinism


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal_bottom_right", "float_b1ts", "padding_left_causal_br"])
def test_same_inputs_twice_bitwise(backend, kind, seed):
    B, H, G, T, S, D = 2, 4, 2, 7, 9, 5
    q, k, v = make_qkv(seed, B, H, G, T, S, D, requires_grad=True)
    kw = KINDS[kind](seed, B, H, T, S)
    first = attention(q, k, v, backend=backend, **kw)
    second = attention(q, k, v, backend=backend, **kw)
    assert torch.equal(first, second)
    for a, b in zip(grads(first, q, k, v), grads(second, q, k, v)):
        assert torch.equal(a, b)
