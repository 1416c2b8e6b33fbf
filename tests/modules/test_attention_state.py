"""MultiHeadAttention state dicts: the fused ``qkv_proj`` layout and the split
``q_proj``/``k_proj``/``v_proj`` layout load into each other."""

from __future__ import annotations

import pytest
import torch
from support.modules import random_module as _module
from torch import nn

from multihead import MultiHeadAttention

F64 = torch.float64




def _as_split_keys(sd: dict, m: MultiHeadAttention, prefix: str = "") -> dict:
    out = {k: v for k, v in sd.items() if "qkv_proj" not in k}
    for suffix in ("weight", "bias"):
        whole = sd.get(f"{prefix}qkv_proj.{suffix}")
        if whole is not None:
            for n, sl in zip(("q_proj", "k_proj", "v_proj"), m._slices()):
                out[f"{prefix}{n}.{suffix}"] = whole[sl].clone()
    return out


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("num_kv_heads", [None, 1, 2])
def test_fused_module_loads_split_keys_and_round_trips(num_kv_heads, qkv_bias):
    a = _module(embed_dim=12, num_heads=4, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias)
    b = _module(seed=7, embed_dim=12, num_heads=4, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias)
    split_sd = _as_split_keys(a.state_dict(), a)
    keys_before = set(split_sd)
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= keys_before
    b.load_state_dict(split_sd)  # strict
    assert set(split_sd) == keys_before  # the caller's dict is not rewritten
    assert set(b.state_dict()) == set(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k
    x = torch.randn(2, 5, 12, dtype=F64)
    assert torch.equal(a(x, is_causal=True), b(x, is_causal=True))
    # and back: the fused keys of b load into a third module
    c = _module(seed=8, embed_dim=12, num_heads=4, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias)
    c.load_state_dict(b.state_dict())
    assert torch.equal(a(x), c(x))


def test_split_layout_loads_under_a_prefix():
    a = nn.ModuleDict({"attn": _module(embed_dim=8, num_heads=2)})
    b = nn.ModuleDict({"attn": _module(seed=3, embed_dim=8, num_heads=2)})
    b.load_state_dict(_as_split_keys(a.state_dict(), a["attn"], prefix="attn."))
    x = torch.randn(2, 3, 8, dtype=F64)
    assert torch.equal(a["attn"](x), b["attn"](x))


def test_split_module_loads_fused_bias_key():
    """A split module (kdim != embed_dim) loads torch-style keys: separate
    weights with one packed ``qkv_proj.bias``, and round-trips its own."""
    a = _module(embed_dim=8, num_heads=2, num_kv_heads=1, kdim=5, vdim=3)
    b = _module(seed=5, embed_dim=8, num_heads=2, num_kv_heads=1, kdim=5, vdim=3)
    sd = {k: v for k, v in a.state_dict().items() if not k.endswith("_proj.bias") or k.startswith("out")}
    sd["qkv_proj.bias"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
    b.load_state_dict(sd)
    x, k, v = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 4, 5, dtype=F64), torch.randn(2, 4, 3, dtype=F64)
    assert torch.equal(a(x, k, v), b(x, k, v))
    c = _module(seed=6, embed_dim=8, num_heads=2, num_kv_heads=1, kdim=5, vdim=3)
    c.load_state_dict(a.state_dict())
    assert torch.equal(a(x, k, v), c(x, k, v))


def test_split_module_refuses_a_fused_weight_of_the_wrong_width():
    fused = _module(embed_dim=8, num_heads=2)
    split = _module(embed_dim=8, num_heads=2, kdim=5, vdim=5)
    with pytest.raises(RuntimeError, match="size mismatch"):
        split.load_state_dict(fused.state_dict())
