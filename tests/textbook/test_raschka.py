"""Raschka chapter 3 classes against the book's numbers (multihead/data/textbook_ch03.json)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead.data import load_textbook_oracle
from multihead.textbook.raschka import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

ORACLE = load_textbook_oracle()
TOL = 1e-6
CLASSES = {
    "SelfAttention_v1": SelfAttention_v1,
    "SelfAttention_v2": SelfAttention_v2,
    "CausalAttention": CausalAttention,
    "MultiHeadAttentionWrapper": MultiHeadAttentionWrapper,
    "MultiHeadAttention": MultiHeadAttention,
}


def _inputs() -> torch.Tensor:
    return torch.tensor(ORACLE["inputs"])  # [6, 3]


def _batch() -> torch.Tensor:
    inputs = _inputs()
    return torch.stack((inputs, inputs), dim=0)  # [2, 6, 3], as the json's "batch"


def _max_diff(actual: torch.Tensor, expected) -> float:
    expected = torch.tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape
    return (actual.detach() - expected).abs().max().item()


def _build(case: dict) -> nn.Module:
    cls = CLASSES[case["class"].split()[0]]
    torch.manual_seed(case["seed"])
    return cls(**case["args"])


def _check_linear_weights(layer_owner: nn.Module, expected: dict) -> None:
    for name in ("W_query", "W_key", "W_value"):
        layer = getattr(layer_owner, name)
        assert _max_diff(layer.weight, expected[name]["weight"]) <= TOL, name
        assert layer.bias is None


@pytest.mark.parametrize("name", sorted(ORACLE["cases"]))
def test_oracle_case_reproduces_book(name):
    case = ORACLE["cases"][name]
    module = _build(case).eval()
    cls_name = case["class"].split()[0]
    # Seeded weights equal the book's: proves the parameter creation order.
    if cls_name == "SelfAttention_v1":
        for w in ("W_query", "W_key", "W_value"):
            assert _max_diff(getattr(module, w), case[w]) <= TOL, w
    elif cls_name == "MultiHeadAttentionWrapper":
        assert len(module.heads) == len(case["heads"]) == case["args"]["num_heads"]
        for head, expected in zip(module.heads, case["heads"]):
            _check_linear_weights(head, expected)
    else:
        _check_linear_weights(module, case)
    if cls_name == "MultiHeadAttention":
        assert _max_diff(module.out_proj.weight, case["out_proj"]["weight"]) <= TOL
        assert _max_diff(module.out_proj.bias, case["out_proj"]["bias"]) <= TOL
        assert module.num_heads == case["num_heads"]
        assert module.head_dim == case["head_dim"]
    # Output: the 2-D inputs for the self-attention classes, the [2, 6, 3] batch otherwise.
    x = _inputs() if cls_name.startswith("SelfAttention") else _batch()
    with torch.no_grad():
        out = module(x)
    assert _max_diff(out, case["output"]) <= TOL


@pytest.mark.parametrize("d_out", [1, 2])
def test_wrapper_output_width_is_heads_times_d_out(d_out):
    case = ORACLE["cases"][f"MultiHeadAttentionWrapper_d_out{d_out}_seed123"]
    out = _build(case)(_batch())
    assert out.shape == (2, 6, case["args"]["num_heads"] * d_out)


def test_wrapper_head0_is_a_seeded_causal_attention():
    case = ORACLE["cases"]["MultiHeadAttentionWrapper_d_out2_seed123"]
    causal = ORACLE["cases"]["CausalAttention_seed123"]
    out = _build(case)(_batch())
    assert _max_diff(out[..., :2], causal["output"]) <= TOL


def test_gpt2_small_parameter_count():
    spec = ORACLE["gpt2_small_attention_parameter_count"]
    module = MultiHeadAttention(**spec["args"])
    assert sum(p.numel() for p in module.parameters()) == spec["parameters"] == 2_360_064
    assert module.head_dim == 64


def test_v1_with_v2_weights_transposed_matches_v2():
    """The book's exercise 3.1: v1 and v2 agree once v1 gets v2's weights transposed."""
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    sa_v1 = SelfAttention_v1(3, 2)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(sa_v1, name).copy_(getattr(sa_v2, name).weight.T)
    assert torch.allclose(sa_v1(_inputs()), sa_v2(_inputs()), atol=1e-7)


@pytest.mark.parametrize("cls", [SelfAttention_v1, SelfAttention_v2])
def test_self_attention_accepts_a_batch(cls):
    torch.manual_seed(0)
    module = cls(3, 4)
    x = torch.rand(5, 7, 3)
    out = module(x)
    assert out.shape == (5, 7, 4)
    for i in range(5):
        assert torch.allclose(out[i], module(x[i]), atol=1e-6)


def test_state_dict_keys_are_the_books():
    causal = CausalAttention(3, 2, 6, 0.0)
    assert list(causal.state_dict()) == ["mask", "W_query.weight", "W_key.weight", "W_value.weight"]
    mha = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2, qkv_bias=True)
    assert set(mha.state_dict()) == {
        "mask",
        "W_query.weight",
        "W_query.bias",
        "W_key.weight",
        "W_key.bias",
        "W_value.weight",
        "W_value.bias",
        "out_proj.weight",
        "out_proj.bias",
    }
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    assert "heads.1.mask" in wrapper.state_dict()
    expected_mask = torch.triu(torch.ones(6, 6), diagonal=1)
    assert mha.mask.dtype == torch.float32
    assert torch.equal(mha.mask, expected_mask)
    assert torch.equal(causal.mask, expected_mask)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CausalAttention(3, 4, 8, 0.0),
        lambda: MultiHeadAttention(3, 4, 8, 0.0, num_heads=2),
        lambda: MultiHeadAttentionWrapper(3, 4, 8, 0.0, num_heads=2),
    ],
)
def test_causal_and_shorter_than_context(make):
    torch.manual_seed(1)
    module = make().eval()
    x = torch.rand(2, 5, 3)  # 5 < context_length = 8: the mask is sliced
    y = x.clone()
    y[:, 3:] = torch.rand(2, 2, 3)  # change only the future of tokens 0..2
    out_x, out_y = module(x), module(y)
    assert torch.allclose(out_x[:, :3], out_y[:, :3], atol=1e-7)
    assert not torch.allclose(out_x[:, 3:], out_y[:, 3:])


def test_multihead_matches_torch_multihead_attention_with_causal_mask():
    torch.manual_seed(2)
    mha = MultiHeadAttention(8, 8, 10, 0.0, num_heads=4, qkv_bias=True).double().eval()
    ref = nn.MultiheadAttention(8, 4, batch_first=True).double().eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.W_query.weight, mha.W_key.weight, mha.W_value.weight]))
        ref.in_proj_bias.copy_(torch.cat([mha.W_query.bias, mha.W_key.bias, mha.W_value.bias]))
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        ref.out_proj.bias.copy_(mha.out_proj.bias)
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    expected, _ = ref(x, x, x, attn_mask=mha.mask[:7, :7].bool(), need_weights=False)
    assert (mha(x) - expected).abs().max().item() <= 1e-10


def test_dropout_only_in_training():
    torch.manual_seed(3)
    mha = MultiHeadAttention(4, 4, 6, 0.5, num_heads=2)
    x = torch.rand(2, 6, 4)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    mha.train()
    assert not torch.equal(mha(x), mha(x))


# ----------------------------------------------------------------------------- errors
def test_d_out_not_divisible_by_num_heads():
    with pytest.raises(ValueError, match=r"d_out=10.*num_heads=3"):
        MultiHeadAttention(3, 10, 6, 0.0, num_heads=3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CausalAttention(3, 2, 6, 0.0),
        lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=2),
        lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2),
    ],
)
def test_too_many_tokens_for_context_length(make):
    with pytest.raises(ValueError, match=r"7 tokens.*context_length=6"):
        make()(torch.rand(2, 7, 3))


@pytest.mark.parametrize(
    "x, pattern",
    [
        (torch.rand(6, 3), r"3-D.*\(6, 3\)"),
        (torch.rand(1, 2, 6, 3), r"3-D.*\(1, 2, 6, 3\)"),
        (torch.rand(2, 6, 4), r"d_in=3.*\(2, 6, 4\)"),
    ],
)
def test_wrong_input_shape(x, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)(x)


def test_self_attention_wrong_input_shape():
    with pytest.raises(ValueError, match=r"d_in=3.*\(6, 5\)"):
        SelfAttention_v1(3, 2)(torch.rand(6, 5))
    with pytest.raises(ValueError, match=r"2-D or 3-D.*\(6,\)"):
        SelfAttention_v2(3, 2)(torch.rand(6))
    with pytest.raises(TypeError, match="list"):
        SelfAttention_v2(3, 2)([[0.0, 1.0, 2.0]])


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: SelfAttention_v1(0, 2), r"d_in=0"),
        (lambda: SelfAttention_v2(3, -1), r"d_out=-1"),
        (lambda: CausalAttention(3, 2, 0, 0.0), r"context_length=0"),
        (lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=0), r"num_heads=0"),
        (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=-2), r"num_heads=-2"),
        (lambda: CausalAttention(3, 2, 6, 1.5), r"dropout=1.5"),
    ],
)
def test_non_positive_sizes_and_bad_dropout(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_non_integer_size_is_a_type_error():
    with pytest.raises(TypeError, match=r"d_out.*2\.5"):
        MultiHeadAttention(3, 2.5, 6, 0.0, num_heads=1)
