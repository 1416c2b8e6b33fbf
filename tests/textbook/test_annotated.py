"""Annotated Transformer MultiHeadedAttention against torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead.textbook.annotated import MultiHeadedAttention, attention, clones, subsequent_mask
from multihead.textbook.raschka import CausalAttention, MultiHeadAttention
from multihead.textbook.tutorial import PerHeadMultiHeadAttention, SplitMultiHeadAttention

TOL = 1e-10
H, D = 4, 16


def _pair(seed: int = 0) -> tuple[MultiHeadedAttention, nn.MultiheadAttention]:
    """An eval-mode float64 MultiHeadedAttention with distinct projections and its torch twin."""
    torch.manual_seed(seed)
    ours = MultiHeadedAttention(H, D, dropout=0.0).double().eval()
    with torch.no_grad():
        for lin in ours.linears:  # clones() makes all four identical; make them differ
            lin.weight.normal_(0.0, 0.5)
            lin.bias.normal_(0.0, 0.5)
    ref = nn.MultiheadAttention(D, H, batch_first=True).double().eval()
    q, k, v, o = ours.linears
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        ref.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        ref.out_proj.weight.copy_(o.weight)
        ref.out_proj.bias.copy_(o.bias)
    return ours, ref


def _qkv(b: int = 3, tq: int = 5, tk: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(42)
    return tuple(torch.randn(b, t, D, dtype=torch.float64, generator=g) for t in (tq, tk, tk))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_no_mask_matches_torch():
    ours, ref = _pair()
    query, key, value = _qkv()
    expected, weights = ref(query, key, value, need_weights=True, average_attn_weights=False)
    assert _diff(ours(query, key, value), expected) <= TOL
    assert ours.attn.shape == (3, H, 5, 7)
    assert _diff(ours.attn, weights) <= TOL


@pytest.mark.parametrize("as_int", [False, True])
def test_padding_mask_matches_torch(as_int):
    ours, ref = _pair(1)
    query, key, value = _qkv()
    keep = torch.ones(3, 7, dtype=torch.bool)  # True = real token
    keep[0, 5:] = False
    keep[2, 1:4] = False
    mask = keep.unsqueeze(1)  # [B, 1, Tk], the official src_mask layout
    if as_int:
        mask = mask.to(torch.int64)  # 1 = keep, 0 = masked also works
    # torch's key_padding_mask has the opposite polarity: True = ignore.
    expected, weights = ref(
        query, key, value, key_padding_mask=~keep, need_weights=True, average_attn_weights=False
    )
    assert _diff(ours(query, key, value, mask), expected) <= TOL
    assert _diff(ours.attn, weights) <= TOL
    assert torch.all(ours.attn[0, :, :, 5:] == 0)


def test_causal_subsequent_mask_matches_torch():
    ours, ref = _pair(2)
    x = _qkv(tq=6, tk=6)[0]
    mask = subsequent_mask(6)  # [1, T, T], True = may attend
    expected, weights = ref(x, x, x, attn_mask=~mask[0], need_weights=True, average_attn_weights=False)
    assert _diff(ours(x, x, x, mask), expected) <= TOL
    assert _diff(ours.attn, weights) <= TOL


def test_padding_and_causal_combined_matches_torch():
    """The official tgt_mask: (tgt != pad) [B, 1, T] AND subsequent_mask(T) -> [B, T, T]."""
    ours, ref = _pair(3)
    x = _qkv(tq=6, tk=6)[0]
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, 4:] = False
    tgt_mask = keep.unsqueeze(-2) & subsequent_mask(6)  # [B, T, T]
    expected, _ = ref(x, x, x, key_padding_mask=~keep, attn_mask=~subsequent_mask(6)[0], need_weights=False)
    assert _diff(ours(x, x, x, tgt_mask), expected) <= TOL


def test_fully_masked_row_is_uniform_average_of_projected_values():
    ours, _ = _pair(4)
    query, key, value = _qkv()
    mask = torch.ones(3, 1, 7, dtype=torch.bool)
    mask[1] = False  # batch item 1: every key masked
    out = ours(query, key, value, mask)
    assert torch.isfinite(out).all()
    assert torch.allclose(ours.attn[1], torch.full_like(ours.attn[1], 1 / 7), atol=TOL, rtol=0)
    _, _, v_proj, o_proj = ours.linears
    expected = o_proj(v_proj(value[1]).mean(dim=0))  # [D]: mean over keys, then out projection
    assert _diff(out[1], expected.expand(5, D)) <= TOL


def test_subsequent_mask():
    m = subsequent_mask(4)
    assert m.shape == (1, 4, 4)
    assert m.dtype == torch.bool
    assert torch.equal(m[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="size=0"):
        subsequent_mask(0)


def test_seeded_layout_four_identical_clones():
    torch.manual_seed(123)
    module = MultiHeadedAttention(H, D, dropout=0.1)
    torch.manual_seed(123)
    single = nn.Linear(D, D)  # clones() deep-copies ONE layer: one draw from the stream
    assert isinstance(module.linears, nn.ModuleList) and len(module.linears) == 4
    for lin in module.linears:
        assert torch.equal(lin.weight, single.weight)
        assert torch.equal(lin.bias, single.bias)
    assert len({id(p) for p in module.parameters()}) == 8  # copies, not shared tensors
    assert list(module.state_dict()) == [f"linears.{i}.{n}" for i in range(4) for n in ("weight", "bias")]
    assert module.d_k == D // H and module.h == H and module.attn is None
    assert module.dropout.p == 0.1
    assert sum(p.numel() for p in module.parameters()) == 4 * (D * D + D)


def test_clones_are_independent():
    layers = clones(nn.Linear(3, 3), 2)
    with torch.no_grad():
        layers[0].weight.zero_()
    assert not torch.equal(layers[0].weight, layers[1].weight)


def test_dropout_only_in_training_and_attn_is_post_dropout():
    torch.manual_seed(5)
    module = MultiHeadedAttention(H, D, dropout=0.5)
    x = torch.randn(2, 6, D)
    module.eval()
    first = module(x, x, x)
    p_eval = module.attn.detach().clone()
    assert torch.equal(first, module(x, x, x))
    module.train()
    assert not torch.equal(module(x, x, x), module(x, x, x))
    kept = module.attn != 0
    assert (~kept).any()  # some probabilities were dropped
    # Kept probabilities carry dropout's 1 / (1 - p) = 2 rescaling.
    assert torch.allclose(module.attn[kept], 2 * p_eval[kept], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_masking(dtype):
    """float16 uses finfo.min instead of -1e9 (which overflows); the others keep -1e9."""
    torch.manual_seed(6)
    module = MultiHeadedAttention(2, 8, dropout=0.0).eval().to(dtype)
    x = torch.randn(2, 4, 8).to(dtype)
    mask = torch.ones(2, 1, 4, dtype=torch.bool)
    mask[0] = False
    mask[1, 0, 3] = False
    out = module(x, x, x, mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(module.attn[0].float(), torch.full((2, 4, 4), 0.25), atol=1e-3)
    assert torch.all(module.attn[1, :, :, 3] == 0)


def test_official_fill_overflows_float16():
    """Documents why the fill value deviates in float16."""
    scores = torch.zeros(2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(torch.tensor([True, False]), -1e9)


def test_attention_function_replaces_not_adds():
    scores_input = torch.tensor([[[5.0, 1.0]]])  # q = [[5, 1]], k = identity -> scores [5, 1]
    key = torch.eye(2).unsqueeze(0)
    value = torch.tensor([[[1.0], [3.0]]])
    out, p = attention(scores_input, key, value, mask=torch.tensor([[[False, False]]]))
    assert torch.allclose(p, torch.full_like(p, 0.5))  # replaced: the original scores are gone
    assert torch.allclose(out, torch.tensor([[[2.0]]]))


def test_attn_attribute_only_on_annotated_class():
    assert hasattr(MultiHeadedAttention(2, 4), "attn")
    for module in (
        CausalAttention(4, 4, 4, 0.0),
        MultiHeadAttention(4, 4, 4, 0.0, num_heads=2),
        PerHeadMultiHeadAttention(4, 2),
        SplitMultiHeadAttention(4, 2),
    ):
        assert not hasattr(module, "attn"), type(module).__name__


def test_errors_name_the_values():
    with pytest.raises(ValueError, match=r"d_model=10.*h=4"):
        MultiHeadedAttention(4, 10)
    with pytest.raises(ValueError, match=r"h=0"):
        MultiHeadedAttention(0, 8)
    with pytest.raises(ValueError, match=r"dropout=-0.1"):
        MultiHeadedAttention(2, 8, dropout=-0.1)
    module = MultiHeadedAttention(2, 8)
    with pytest.raises(ValueError, match=r"key.*d_model=8.*\(1, 3, 6\)"):
        module(torch.rand(1, 3, 8), torch.rand(1, 3, 6), torch.rand(1, 3, 8))
    with pytest.raises(ValueError, match=r"key and value.*\(1, 3, 8\).*\(1, 4, 8\)"):
        module(torch.rand(1, 3, 8), torch.rand(1, 3, 8), torch.rand(1, 4, 8))
