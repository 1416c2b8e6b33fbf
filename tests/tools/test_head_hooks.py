"""AttentionLayer.register_head_hook and tools.heads (attention_layers, mask_heads).

Independent check of masking: a masked head contributes nothing, which is
the same as zeroing that head's input columns of out_proj in a copy of the
model (the bias stays).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.paths import assert_paths_agree

from multihead import build_attention
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.heads import attention_layers, mask_heads

F64 = torch.float64


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", **overrides), dtype=F64).eval()


def _ids(B: int = 2, T: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _zero_columns(model: GPT, heads: dict[int, list[int]]) -> GPT:
    """A copy with the out_proj input columns of the given query heads zeroed."""
    ablated = copy.deepcopy(model)
    D = model.config.head_dim
    with torch.no_grad():
        for i, chosen in heads.items():
            for h in chosen:
                ablated.blocks[i].attn.out_proj.weight[:, h * D : (h + 1) * D] = 0.0
    return ablated


def test_hook_sees_each_heads_context_and_out_proj_merges_it():
    attn = build_attention("mha", embed_dim=12, num_heads=3, dtype=F64).eval()
    x = torch.randn(2, 5, 12, dtype=F64, generator=torch.Generator().manual_seed(0))
    seen = []
    handle = attn.register_head_hook(lambda layer, out: seen.append((layer, out)))
    y, weights = attn(x, return_weights=True)
    handle.remove()
    layer, out = seen[0]
    assert layer is attn and out.shape == (2, 3, 5, 4)
    v = attn.project(x)[2]  # (B, H, S, D)
    assert_paths_agree(out, weights @ v)  # context = weights x values, per head
    merged = attn.out_proj(out.transpose(1, 2).reshape(2, 5, 12))  # (B, H, T, D) -> (B, T, H*D)
    assert_paths_agree(y, merged)


def test_a_returned_tensor_replaces_the_heads_and_remove_restores_the_forward():
    attn = build_attention("gqa", embed_dim=16, num_heads=4, num_kv_heads=2, dtype=F64).eval()
    x = torch.randn(2, 6, 16, dtype=F64, generator=torch.Generator().manual_seed(0))
    before = attn(x, is_causal=True)
    handle = attn.register_head_hook(lambda layer, out: torch.zeros_like(out))
    zeroed = attn(x, is_causal=True)
    assert_paths_agree(zeroed, attn.out_proj.bias.expand(2, 6, 16))
    handle.remove()
    # the same operations on the same shapes as `before`: bitwise
    assert torch.equal(attn(x, is_causal=True), before)


def test_hooks_chain_in_registration_order():
    attn = build_attention("mha", embed_dim=8, num_heads=2, dtype=F64).eval()
    x = torch.randn(1, 3, 8, dtype=F64)
    order = []
    attn.register_head_hook(lambda layer, out: (order.append("a"), out * 2.0)[1])
    attn.register_head_hook(lambda layer, out: order.append(("b", out.clone())))
    attn(x)
    assert order[0] == "a" and order[1][0] == "b"
    plain = build_attention("mha", embed_dim=8, num_heads=2, dtype=F64).eval()
    plain.load_state_dict(attn.state_dict())
    got = []
    plain.register_head_hook(lambda layer, out: got.append(out))
    plain(x)
    assert_paths_agree(order[1][1], 2.0 * got[0])


def test_hook_errors_name_the_values():
    attn = build_attention("mha", embed_dim=8, num_heads=2)
    with pytest.raises(TypeError, match="int"):
        attn.register_head_hook(3)
    x = torch.randn(1, 3, 8)
    handle = attn.register_head_hook(lambda layer, out: out[:, :1])
    with pytest.raises(ValueError, match=r"\(1, 1, 3, 4\).*\(1, 2, 3, 4\)"):
        attn(x)
    handle.remove()
    handle = attn.register_head_hook(lambda layer, out: "zeros")
    with pytest.raises(TypeError, match="str"):
        attn(x)
    handle.remove()


def test_attention_layers_in_forward_order():
    model = _gpt()
    assert attention_layers(model) == [block.attn for block in model.blocks]
    with pytest.raises(ValueError, match="Linear contains no multihead attention"):
        attention_layers(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="str"):
        attention_layers("gpt")


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_mask_heads_equals_zeroing_the_heads_out_proj_columns(kind):
    extra = {"attention": "gqa", "num_kv_heads": 2} if kind == "gqa" else {}
    model = _gpt(**extra)
    idx = _ids()
    heads = {0: [1, 3], 1: [0]}
    before = model(idx)
    with torch.no_grad(), mask_heads(model, heads) as layers:
        masked = model(idx)
        assert layers == attention_layers(model)
    want = _zero_columns(model, heads)(idx)
    assert_paths_agree(masked, want)
    assert not torch.allclose(masked, before)
    # hooks are gone: the same operations on the same shapes as `before`, bitwise
    assert torch.equal(model(idx), before)


def test_mask_heads_acts_inside_the_torch_drop_in():
    from multihead import TorchMultiheadAttention

    torch.manual_seed(0)
    m = TorchMultiheadAttention(12, 3, batch_first=True, dtype=F64).eval()
    x = torch.randn(2, 5, 12, dtype=F64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), mask_heads(m, {0: [1]}):
        masked, _ = m(x, x, x, need_weights=False)
    ablated = copy.deepcopy(m)
    with torch.no_grad():
        ablated.out_proj.weight[:, 4:8] = 0.0  # head 1 of 3, head_dim 4
        want, _ = ablated(x, x, x, need_weights=False)
    assert_paths_agree(masked, want)


def test_mask_heads_removes_its_hooks_when_the_block_raises():
    model = _gpt()
    idx = _ids()
    before = model(idx)
    with pytest.raises(RuntimeError, match="inside"):
        with mask_heads(model, {1: [2]}):
            raise RuntimeError("inside")
    assert torch.equal(model(idx), before)  # same operations, same shapes: bitwise


def test_masked_head_is_zero_even_with_nan_values():
    attn = build_attention("mha", embed_dim=8, num_heads=2, dtype=F64).eval()
    x = torch.randn(1, 3, 8, dtype=F64)
    with torch.no_grad():
        attn.qkv_proj.bias[16:20] = float("nan")  # head 0's values
    seen = []
    with mask_heads(attn, {0: [0]}):
        attn.register_head_hook(lambda layer, out: seen.append(out))
        y = attn(x)
    assert torch.isfinite(y).all()
    assert torch.equal(seen[0][:, 0], torch.zeros(1, 3, 4, dtype=F64))  # exact zeros


@pytest.mark.parametrize(
    ("heads", "error", "match"),
    [
        ({2: [0]}, ValueError, r"layer index=2 out of range \[0, 2\)"),
        ({0: [4]}, ValueError, r"head=4 out of range \[0, 4\) in layer 0"),
        ({0: [-1]}, ValueError, r"head=-1 out of range"),
        ({"0": [1]}, TypeError, r"layer index must be an int, got layer index='0'"),
        ({0: [True]}, TypeError, r"head must be an int, got head=True"),
        ({0: 1}, TypeError, r"heads\[0\] must be a list of head indices, got 1"),
        ([0, 1], TypeError, r"heads must be a mapping"),
    ],
)
def test_mask_heads_errors(heads, error, match):
    model = _gpt()
    with pytest.raises(error, match=match):
        with mask_heads(model, heads):
            pass
    assert all(not layer._head_hooks for layer in attention_layers(model))
