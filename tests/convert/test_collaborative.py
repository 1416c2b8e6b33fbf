"""The official CollaborativeAttention layout against an independent
re-implementation of the official forward (written from the spec)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from multihead import convert
from multihead.convert.official.collaborative import from_official, to_official

F64 = torch.float64


def official_forward(
    sd, cfg, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None, encoder_attention_mask=None
):
    """The official module's forward, step by step from the spec (eval mode)."""
    H, D_kq, D_v = cfg["num_attention_heads"], cfg["dim_key_query_all"], cfg["dim_value_all"]
    x_from = hidden_states
    x_to = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    if encoder_hidden_states is not None:
        attention_mask = encoder_attention_mask
    B, Tq, _ = x_from.shape
    Tk = x_to.shape[1]
    q = x_from @ sd["query.weight"].T  # (B, Tq, D_kq)
    k = x_to @ sd["key.weight"].T  # (B, Tk, D_kq)
    mixed = q[:, None, :, :] * sd["mixing"].view(1, H, 1, D_kq)  # (B, H, Tq, D_kq)
    scores = mixed @ k[:, None].transpose(-1, -2)  # (B, H, Tq, Tk)
    cb = (x_to @ sd["content_bias.weight"].T).transpose(-1, -2)  # (B, H, Tk)
    scores = scores + cb[:, :, None, :]
    scores = scores / math.sqrt(D_kq / H)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    if head_mask is not None:
        probs = probs * head_mask
    v = x_to @ sd["value.weight"].T + sd["value.bias"]
    v = v.view(B, Tk, H, D_v // H).permute(0, 2, 1, 3)
    ctx = (probs @ v).permute(0, 2, 1, 3).reshape(B, Tq, D_v)
    if cfg["use_dense_layer"]:
        ctx = ctx @ sd["dense.weight"].T + sd["dense.bias"]
    if cfg["use_layer_norm"]:
        ctx = F.layer_norm(x_from + ctx, (D_v,), sd["layer_norm.weight"], sd["layer_norm.bias"], eps=1e-5)
    return (ctx, probs) if cfg["output_attentions"] else (ctx,)


def official_state(seed, cfg):
    g = torch.Generator().manual_seed(seed)
    D_in, D_v, D_kq, D_out, H = (
        cfg[k] for k in ("dim_input", "dim_value_all", "dim_key_query_all", "dim_output", "num_attention_heads")
    )
    shapes = {
        "query.weight": (D_kq, D_in),
        "key.weight": (D_kq, D_in),
        "mixing": (H, D_kq),
        "content_bias.weight": (H, D_in),
        "value.weight": (D_v, D_in),
        "value.bias": (D_v,),
    }
    if cfg["use_dense_layer"]:
        shapes |= {"dense.weight": (D_out, D_v), "dense.bias": (D_out,)}
    if cfg["use_layer_norm"]:
        shapes |= {"layer_norm.weight": (D_v,), "layer_norm.bias": (D_v,)}
    return {n: 0.5 * torch.randn(s, generator=g, dtype=F64) for n, s in shapes.items()}


CONFIGS = {
    # BERT adapter: no dense, no LayerNorm; D_kq/H = 10/4 is not an integer
    "bert": dict(
        dim_input=12,
        dim_value_all=12,
        dim_key_query_all=10,
        dim_output=12,
        num_attention_heads=4,
        use_dense_layer=False,
        use_layer_norm=False,
    ),
    # DistilBERT adapter: dense layer, different output width
    "distilbert": dict(
        dim_input=12,
        dim_value_all=8,
        dim_key_query_all=6,
        dim_output=9,
        num_attention_heads=2,
        use_dense_layer=True,
        use_layer_norm=False,
    ),
    # ALBERT adapter: dense and post-LN
    "albert": dict(
        dim_input=12,
        dim_value_all=12,
        dim_key_query_all=5,
        dim_output=12,
        num_attention_heads=3,
        use_dense_layer=True,
        use_layer_norm=True,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("output_attentions", [False, True])
def test_matches_the_official_forward(name, output_attentions):
    cfg = dict(CONFIGS[name], output_attentions=output_attentions, attention_probs_dropout_prob=0.1)
    sd = official_state(0, cfg)
    m = convert.from_official("collaborative", sd, **cfg).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 12, generator=g, dtype=F64)
    enc = torch.randn(2, 5, 12, generator=g, dtype=F64)
    mask = torch.zeros(2, 1, 1, 7, dtype=F64)
    mask[1, ..., -3:] = -10000.0
    enc_mask = torch.zeros(2, 1, 1, 5, dtype=F64)
    enc_mask[0, ..., :2] = -10000.0
    head_mask = torch.tensor([1.0, 0.0, 0.5, 1.0][: cfg["num_attention_heads"]], dtype=F64).view(1, -1, 1, 1)
    calls = [
        dict(),
        dict(attention_mask=mask),
        dict(attention_mask=mask, head_mask=head_mask),
        dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask),
        dict(attention_mask=mask, encoder_hidden_states=enc),  # the mask is dropped
    ]
    for kw in calls:
        got, want = m(x, **kw), official_forward(sd, cfg, x, **kw)
        assert len(got) == len(want) == (2 if output_attentions else 1)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip(name):
    cfg = dict(CONFIGS[name])
    sd = official_state(2, cfg)
    back = to_official(from_official(sd, **cfg))
    assert sorted(back) == sorted(sd)
    for n in sd:
        assert torch.equal(back[n], sd[n])


def test_errors_name_the_values():
    cfg = dict(CONFIGS["distilbert"])
    sd = official_state(0, cfg)
    with pytest.raises(ValueError, match="'mixing'"):
        from_official({k: v for k, v in sd.items() if k != "mixing"}, **cfg)
    with pytest.raises(ValueError, match=r"\(2, 6\)"):
        from_official({**sd, "mixing": torch.zeros(3, 6, dtype=F64)}, **cfg)
    with pytest.raises(ValueError, match="unexpected"):
        from_official({**sd, "extra": torch.zeros(1)}, **cfg)
    with pytest.raises(ValueError, match="dim_value_all=8 must be divisible by num_attention_heads=3"):
        from_official(sd, **{**cfg, "num_attention_heads": 3})
    with pytest.raises(ValueError, match="dim_output=9 must equal dim_value_all=8"):
        from_official(sd, **{**cfg, "use_dense_layer": False})
