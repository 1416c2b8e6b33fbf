"""An input of another dtype than an attention layer's parameters is a TypeError naming both dtypes
(every kind, the torch drop-in, a GPT whose parameters mix dtypes); ``torch.autocast`` still runs.

The drop-in keeps each parameter's dtype as torch does (torch's
``test_multihead_attn_fast_path_query_and_bias_have_different_dtypes``: a float16 ``in_proj_bias``
on a float64 module) through every way a module is made or changed, with torch's output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.kinds import OPTIONS, C, build
from support.paths import assert_matches_peer
from torch import nn

from multihead import TorchMultiheadAttention
from multihead.models.gpt import GPT, GPTConfig

F32, F64, F16 = torch.float32, torch.float64, torch.float16


@pytest.mark.parametrize("kind", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [F64, F16], ids=["float64", "float16"])
def test_every_kind_names_both_dtypes(kind, dtype):
    layer = build(kind, dtype=F32)
    x = torch.randn(2, 3, C).to(dtype)
    with pytest.raises(TypeError, match=rf"query has dtype {dtype} but the layer's parameters are torch.float32"):
        layer(x)
    assert layer(x.float()).dtype == F32  # the same input in the layer's dtype runs


def test_autocast_casts_inside_the_layer():
    layer = build("mha", dtype=F32)
    x = torch.randn(2, 3, C, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).shape == (2, 3, C)


def test_a_gpt_of_mixed_dtypes_names_both():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    model.blocks[1].double()
    with pytest.raises(TypeError, match=r"parameters mix dtypes torch.float32 \(token_embedding.weight, ...\), "
                                        r"torch.float64 \(blocks.1.ln_1.weight, ...\)"):  # fmt: skip
        model(torch.zeros(1, 4, dtype=torch.long))
    model.double()
    assert model(torch.zeros(1, 4, dtype=torch.long)).dtype == F64


def test_the_drop_in_names_both_dtypes():
    ours = TorchMultiheadAttention(8, 2, batch_first=True, dtype=F64)
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match=r"query has dtype torch.float32 but the layer's parameters are torch.float64"):
        ours(x, x, x)
    with pytest.raises(TypeError, match=r"value has dtype torch.float32"):
        ours(x.double(), x.double(), x)


def _half_bias(module):
    module.in_proj_bias = nn.Parameter(module.in_proj_bias.detach().to(F16))
    return module


def _dtypes(module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in module.named_parameters()}


WAYS = {  # how a module with a float16 in_proj_bias comes about, applied to torch's module and to ours
    "assigned": lambda m: m,
    "deepcopy": copy.deepcopy,
    "to_cpu": lambda m: m.to("cpu"),
    "requires_grad_off": lambda m: m.requires_grad_(False),
    "float": lambda m: m.float(),  # every floating parameter becomes float32, the bias too
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_drop_in_keeps_each_parameters_dtype_as_torch(way, dtype):
    torch.manual_seed(0)
    mha = _half_bias(nn.MultiheadAttention(4, 4, batch_first=True, dtype=dtype)).eval()
    built = _half_bias(TorchMultiheadAttention(4, 4, batch_first=True, dtype=dtype)).eval()
    built.load_state_dict(mha.state_dict())
    copied = TorchMultiheadAttention.from_torch(mha)
    want = WAYS[way](mha)
    q = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(1)).to(want.in_proj_weight.dtype)
    with torch.no_grad():
        ref, ref_weights = want(q, q, q)
    for ours in (WAYS[way](built), WAYS[way](copied)):
        assert _dtypes(ours) == _dtypes(want)
        assert ours.attention.qkv_proj.bias is ours.in_proj_bias  # the inner module computes with that very tensor
        with torch.no_grad():
            out, weights = ours(q, q, q)
        assert out.dtype == ref.dtype
        assert_matches_peer(out, ref, way)
        assert_matches_peer(weights, ref_weights, way)


def test_drop_in_loads_a_float16_bias_with_assign_as_torch():
    torch.manual_seed(0)
    source = _half_bias(nn.MultiheadAttention(4, 4, batch_first=True, dtype=F64))
    mha, ours = nn.MultiheadAttention(4, 4, batch_first=True, dtype=F64), TorchMultiheadAttention(4, 4, batch_first=True, dtype=F64)
    for module in (mha, ours):
        module.load_state_dict(source.state_dict(), assign=True)
    assert _dtypes(ours) == _dtypes(mha) and ours.in_proj_bias.dtype == F16
    q = torch.randn(2, 5, 4, dtype=F64)
    with torch.no_grad():
        assert_matches_peer(ours(q, q, q)[0], mha(q, q, q)[0])
