"""MOHSA ViT attention (ZTX-100/MOHSA models/vit.py) -> multihead, against a re-implementation of the
official forward written in this file from the official code's steps (the official module itself is not run)."""

from __future__ import annotations

import pytest
import torch
from support.attention import assert_matches

from multihead.convert import from_official as from_official_by_kind
from multihead.convert.official.mohsa_vit import MOHSAViTAttention, from_official, to_official, vit_layer_state_dict
from multihead.modules.kinds.overlapping import OverlappingHeadAttention

F64 = torch.float64


def official_forward(x, sd, *, heads, dim_head, depths):
    """The official ViT ``Attention.forward`` re-implemented from the spec (eval mode, ov = depths).

    Fused projection, chunk into q, k, v, concatenate zero blocks of ov channels
    at both ends, slice head i as padded channels [i*dh, (i+1)*dh + 2*ov),
    softmax(q k^T * dh^-0.5) v, concatenate head-major, to_out (or identity).
    """
    ov = depths
    q, k, v = (x @ sd["to_qkv.weight"].T).chunk(3, dim=-1)

    def split(t):
        if ov == 0:
            B, N, _ = t.shape
            return t.reshape(B, N, heads, dim_head).permute(0, 2, 1, 3)  # b n (h d) -> b h n d
        zeros = torch.zeros(*t.shape[:-1], ov, dtype=t.dtype)
        t = torch.cat([zeros, t, zeros], dim=-1)
        return torch.stack([t[..., i * dim_head : (i + 1) * dim_head + 2 * ov] for i in range(heads)], dim=1)

    q, k, v = split(q), split(k), split(v)
    attn = torch.softmax(q @ k.transpose(-1, -2) * dim_head**-0.5, dim=-1)
    out = attn @ v  # b h n d'
    out = out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)  # b h n d -> b n (h d)
    if "to_out.0.weight" not in sd:
        return out
    return out @ sd["to_out.0.weight"].T + sd["to_out.0.bias"]


def official_state(dim, heads, dim_head, depths, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"to_qkv.weight": torch.randn(3 * heads * dim_head, dim, generator=g, dtype=F64) * 0.4}
    if not (heads == 1 and dim_head == dim):
        sd["to_out.0.weight"] = torch.randn(dim, heads * (dim_head + 2 * depths), generator=g, dtype=F64) * 0.3
        sd["to_out.0.bias"] = torch.randn(dim, generator=g, dtype=F64)
    return sd


@pytest.mark.parametrize("dim,heads,dim_head,depths", [(12, 3, 4, 0), (12, 3, 4, 1), (10, 4, 3, 5), (9, 2, 5, 11)])
def test_converted_layer_equals_the_reimplemented_official_forward(dim, heads, dim_head, depths):
    sd = official_state(dim, heads, dim_head, depths)
    layer = from_official_by_kind("mohsa_vit", sd, dim=dim, heads=heads, dim_head=dim_head, depths=depths, total_depths=12)
    assert isinstance(layer.attention, OverlappingHeadAttention) and layer.attention.overlap == depths
    x = torch.randn(2, 7, dim, dtype=F64, generator=torch.Generator().manual_seed(1))
    want = official_forward(x, sd, heads=heads, dim_head=dim_head, depths=depths)
    assert_matches(layer.eval()(x), want)
    # the overlap can also be read off the to_out width
    inferred = from_official(sd, dim=dim, heads=heads, dim_head=dim_head)
    assert inferred.attention.overlap == depths
    assert_matches(inferred.eval()(x), want)


def test_round_trip_and_vit_checkpoint_keys():
    sd = official_state(12, 3, 4, 2)
    layer = from_official(sd, dim=12, heads=3, dim_head=4, depths=2)
    back = to_official(layer)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    vit = {f"transformer.layers.2.0.fn.{k}": v for k, v in sd.items()}
    vit["transformer.layers.2.0.norm.weight"] = torch.ones(12)
    vit = {k: v for k, v in vit.items() if ".fn." in k}
    assert vit_layer_state_dict(vit, 2).keys() == sd.keys()
    with pytest.raises(ValueError, match="transformer.layers.3.0.fn."):
        vit_layer_state_dict(vit, 3)


def test_identity_to_out_when_one_head_spans_the_width():
    sd = official_state(6, 1, 6, 0)
    layer = from_official(sd, dim=6, heads=1, dim_head=6, depths=0)
    x = torch.randn(1, 5, 6, dtype=F64)
    assert isinstance(layer, MOHSAViTAttention) and not layer.project_out
    assert_matches(layer(x), official_forward(x, sd, heads=1, dim_head=6, depths=0))
    assert set(to_official(layer)) == {"to_qkv.weight"}
    with pytest.raises(ValueError, match="identity"):
        from_official(sd, dim=6, heads=1, dim_head=6, depths=2)


def test_layout_errors_name_the_problem():
    sd = official_state(12, 3, 4, 1)
    with pytest.raises(ValueError, match=r"to_out.0.weight must be \(12, 12\) .*overlap=0; got \(12, 18\)"):
        from_official(sd, dim=12, heads=3, dim_head=4, depths=0)
    with pytest.raises(ValueError, match="missing"):
        from_official({"to_qkv.weight": sd["to_qkv.weight"]}, dim=12, heads=3, dim_head=4, depths=1)
    with pytest.raises(ValueError, match=r"to_qkv.weight must be"):
        from_official(sd, dim=12, heads=2, dim_head=4, depths=1)
    with pytest.raises(ValueError, match="in_features=19"):
        bad = dict(sd, **{"to_out.0.weight": torch.zeros(12, 19, dtype=F64)})
        from_official(bad, dim=12, heads=3, dim_head=4)
