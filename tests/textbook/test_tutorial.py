"""The fixed tutorial forms against torch.nn.MultiheadAttention and the masking contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from support.properties import examples
from torch import nn

from multihead.textbook.tutorial import (
    AttentionHead,
    PerHeadMultiHeadAttention,
    SplitMultiHeadAttention,
    scaled_dot_product,
)

TOL = 1e-10
E, H = 12, 3
HD = E // H


def _reference(seed: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, batch_first=True).double().eval()
    with torch.no_grad():
        ref.in_proj_bias.normal_()  # torch zero-initialises the biases; make them count
        ref.out_proj.bias.normal_()
    return ref


def _per_head_from(ref: nn.MultiheadAttention) -> PerHeadMultiHeadAttention:
    ours = PerHeadMultiHeadAttention(E, H).double()
    w = ref.in_proj_weight.detach().chunk(3)  # W_q, W_k, W_v, each [E, E]
    b = ref.in_proj_bias.detach().chunk(3)
    with torch.no_grad():
        for j, head in enumerate(ours.heads):
            rows = slice(j * HD, (j + 1) * HD)  # head j's output rows
            for lin, wi, bi in zip((head.q, head.k, head.v), w, b):
                lin.weight.copy_(wi[rows])
                lin.bias.copy_(bi[rows])
        ours.output.weight.copy_(ref.out_proj.weight)
        ours.output.bias.copy_(ref.out_proj.bias)
    return ours


def _split_from(ref: nn.MultiheadAttention) -> SplitMultiHeadAttention:
    ours = SplitMultiHeadAttention(E, H).double()
    w = ref.in_proj_weight.detach().chunk(3)
    b = ref.in_proj_bias.detach().chunk(3)
    with torch.no_grad():
        for lin, wi, bi in zip((ours.q_linear, ours.k_linear, ours.v_linear), w, b):
            lin.weight.copy_(wi)
            lin.bias.copy_(bi)
        ours.out_linear.weight.copy_(ref.out_proj.weight)
        ours.out_linear.bias.copy_(ref.out_proj.bias)
    return ours


def _x(b: int = 3, t: int = 6, seed: int = 7) -> torch.Tensor:
    return torch.randn(b, t, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _padding() -> torch.Tensor:
    keep = torch.ones(3, 6, dtype=torch.bool)  # True = real token
    keep[0, 4:] = False
    keep[2, :2] = False
    return keep


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------- against torch
def test_per_head_no_mask_matches_torch_cross_attention():
    ref = _reference(0)
    ours = _per_head_from(ref)
    query, key, value = _x(t=4, seed=1), _x(seed=2), _x(seed=3)
    expected, _ = ref(query, key, value, need_weights=False)
    assert _diff(ours(query, key, value), expected) <= TOL


def test_split_no_mask_matches_torch():
    ref = _reference(1)
    x = _x()
    expected, _ = ref(x, x, x, need_weights=False)
    assert _diff(_split_from(ref)(x), expected) <= TOL


def test_per_head_padding_mask_matches_torch():
    ref = _reference(2)
    x, keep = _x(), _padding()
    expected, _ = ref(x, x, x, key_padding_mask=~keep, need_weights=False)  # torch: True = ignore
    assert _diff(_per_head_from(ref)(x, x, x, keep.unsqueeze(1)), expected) <= TOL  # ours: True = attend


@pytest.mark.parametrize("as_float", [False, True])
def test_split_padding_mask_matches_torch(as_float):
    ref = _reference(3)
    x, keep = _x(), _padding()
    mask = keep.unsqueeze(1)  # [B, 1, T]
    if as_float:
        mask = mask.double()  # 1.0 = attend, 0.0 = masked
    expected, _ = ref(x, x, x, key_padding_mask=~keep, need_weights=False)
    assert _diff(_split_from(ref)(x, mask), expected) <= TOL


def test_causal_mask_matches_torch_for_both_forms():
    ref = _reference(4)
    x = _x()
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))  # [T, T], True = attend
    expected, _ = ref(x, x, x, attn_mask=~causal, need_weights=False)
    assert _diff(_split_from(ref)(x, causal), expected) <= TOL
    assert _diff(_split_from(ref)(x, causal.expand(3, 6, 6)), expected) <= TOL
    assert _diff(_per_head_from(ref)(x, x, x, causal), expected) <= TOL


def test_both_forms_agree_with_each_other():
    ref = _reference(5)
    x = _x()
    assert _diff(_per_head_from(ref)(x, x, x), _split_from(ref)(x)) <= TOL


# ------------------------------------------------------------- fully masked rows
@pytest.mark.parametrize("form", ["per_head", "split"])
def test_fully_masked_rows_give_zero_attention_and_finite_gradients(form):
    ref = _reference(6)
    ours = _per_head_from(ref) if form == "per_head" else _split_from(ref)
    x = _x().requires_grad_(True)
    keep = _padding()
    keep[1] = False  # batch item 1: every key masked
    mask = keep.unsqueeze(1)
    out = ours(x, x, x, mask) if form == "per_head" else ours(x, mask)
    out_bias = ours.output.bias if form == "per_head" else ours.out_linear.bias
    # Attention output is 0, so the module returns the output projection's bias.
    assert _diff(out[1], out_bias.expand(6, E)) <= TOL
    expected, _ = ref(x, x, x, key_padding_mask=~keep, need_weights=False)
    for i in (0, 2):  # the other items still match torch
        assert _diff(out[i], expected[i]) <= TOL
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_scaled_dot_product_fully_masked_row_is_zero_with_finite_grad():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    mask[2] = False  # query 2 sees nothing
    out = scaled_dot_product(q, k, v, mask)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    rows = [0, 1, 3, 4]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # also True = attend
    assert _diff(out[..., rows, :], expected[..., rows, :]) <= TOL
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@settings(max_examples=examples(25), deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    tq=st.integers(1, 5),
    tk=st.integers(1, 5),
    d=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_scaled_dot_product_any_leading_dims_matches_torch(lead, tq, tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, tq, d, dtype=torch.float64, generator=g)
    k = torch.randn(*lead, tk, d, dtype=torch.float64, generator=g)
    v = torch.randn(*lead, tk, d + 1, dtype=torch.float64, generator=g)
    mask = torch.rand(*lead, tq, tk, generator=g) < 0.7
    mask[..., 0] = True  # no fully masked row: torch would give NaN there
    out = scaled_dot_product(q, k, v, mask)
    assert out.shape == (*lead, tq, d + 1)
    assert _diff(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) <= TOL
    assert _diff(scaled_dot_product(q, k, v), F.scaled_dot_product_attention(q, k, v)) <= TOL


@pytest.mark.parametrize("bad", [torch.tensor([[0.0, float("-inf")]]), torch.tensor([[1, 2]])])
def test_mask_must_be_bool_or_zero_one(bad):
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="0 and 1"):
        scaled_dot_product(q, q, q, bad)


# ------------------------------------------------------------- layout and errors
def test_attention_head_signature_and_shapes():
    torch.manual_seed(9)
    head = AttentionHead(embed_dim=12, head_dim=4)
    torch.manual_seed(9)
    first = nn.Linear(12, 4)  # q is created first
    assert head.q.weight.shape == head.k.weight.shape == head.v.weight.shape == (4, 12)
    assert torch.equal(head.q.weight, first.weight)
    x = torch.randn(2, 3, 12)
    assert head(x, x, x).shape == (2, 3, 4)


def test_module_layouts():
    per_head = PerHeadMultiHeadAttention(E, H)
    assert isinstance(per_head.heads, nn.ModuleList) and len(per_head.heads) == H
    assert all(h.q.out_features == HD and h.q.in_features == E for h in per_head.heads)
    assert per_head.output.in_features == per_head.output.out_features == E
    split = SplitMultiHeadAttention(E, H)
    assert split.dim_head == HD
    names = [n for n, _ in split.named_children()]
    assert names == ["q_linear", "k_linear", "v_linear", "out_linear"]
    n_params = 4 * (E * E + E)
    assert sum(p.numel() for p in split.parameters()) == n_params
    assert sum(p.numel() for p in per_head.parameters()) == n_params


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: PerHeadMultiHeadAttention(10, 4), r"embed_dim=10.*num_heads=4"),
        (lambda: SplitMultiHeadAttention(10, 3), r"d_model=10.*num_heads=3"),
        (lambda: PerHeadMultiHeadAttention(12, 0), r"num_heads=0"),
        (lambda: AttentionHead(0, 4), r"embed_dim=0"),
    ],
)
def test_constructor_errors_name_the_values(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_forward_shape_errors():
    with pytest.raises(ValueError, match=r"d_model=12.*\(2, 3, 8\)"):
        SplitMultiHeadAttention(12, 3)(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"3-D.*\(3, 12\)"):
        SplitMultiHeadAttention(12, 3)(torch.randn(3, 12))
    x = torch.randn(2, 3, 12)
    with pytest.raises(ValueError, match=r"value.*embed_dim=12.*\(2, 3, 5\)"):
        PerHeadMultiHeadAttention(12, 3)(x, x, torch.randn(2, 3, 5))
