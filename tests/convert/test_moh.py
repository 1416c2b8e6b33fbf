"""MoH-DiT converter against an independent re-implementation of the official forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multihead.convert import from_official
from multihead.convert.official.moh_dit import to_official

F64 = torch.float64


def official_forward(sd, x, *, num_heads, shared_head, routed_head, head_dim=None, training=False, losses=None):
    """MoH-DiT ``MoHAttention.forward`` written from the spec (docs/variants/moh.md, sections 1-4, 6)."""
    B, N, C = x.shape
    H, hs, hr = num_heads, shared_head, routed_head
    d = head_dim or C // H
    qkv = F.linear(x, sd["qkv.weight"], sd.get("qkv.bias")).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # each (B, H, N, d)
    attn = ((q * d**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    o = (attn @ v).transpose(1, 2).reshape(B * N, H, d)  # rows b*N + n
    xt = x.reshape(B * N, C)
    if hr > 0:
        E = H - hs
        logits = xt @ sd["wg.weight"].t()
        p = logits.softmax(dim=1)
        vals, idx = torch.topk(p, k=hr, dim=1)
        vals = vals / vals.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(vals.dtype).eps)
        g_r = torch.zeros_like(p).scatter(1, idx, vals) * hr
        if training and losses is not None:
            mask = torch.zeros_like(p).scatter(1, idx, 1.0)
            me, ce = p.mean(0), mask.float().mean(0)  # the official float32 frequencies
            losses.append(torch.mean(me * ce) * E * E)
        if hs > 0:
            g_s = (xt @ sd["wg_1.weight"].t()).softmax(dim=1) * hs
            w = (xt @ sd["wg_0.weight"].t()).softmax(dim=1) * 2
            gates = torch.cat([g_s * w[:, :1], g_r * w[:, 1:]], dim=1)
        else:
            gates = g_r
    else:
        gates = (xt @ sd["wg_1.weight"].t()).softmax(dim=1) * hs
    o = (o * gates.unsqueeze(-1)).reshape(B, N, H * d)
    return F.linear(o, sd["proj.weight"], sd["proj.bias"])


def official_state(C, H, hs, hr, head_dim=None, qkv_bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = head_dim or C // H
    E = H - hs
    shapes = {"qkv.weight": (3 * H * d, C), "proj.weight": (C, H * d), "proj.bias": (C,)}
    if qkv_bias:
        shapes["qkv.bias"] = (3 * H * d,)
    if hr > 0:
        shapes["wg.weight"] = (E, C)
        if hs > 0:
            shapes["wg_0.weight"] = (2, C)
    if hs > 1:
        shapes["wg_1.weight"] = (hs, C)
    return {n: 0.5 * torch.randn(s, generator=g, dtype=F64) for n, s in shapes.items()}


CONFIGS = [
    dict(dim=20, num_heads=4, shared_head=2, routed_head=1),
    dict(dim=24, num_heads=6, shared_head=3, routed_head=2, head_dim=5),  # H·d != C (MoH-DiT-L/XL style)
    dict(dim=15, num_heads=5, shared_head=0, routed_head=2),
    dict(dim=12, num_heads=3, shared_head=3, routed_head=0),  # the all-shared softmax branch
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_the_official_forward(cfg):
    sd = official_state(cfg["dim"], cfg["num_heads"], cfg["shared_head"], cfg["routed_head"], cfg.get("head_dim"))
    module = from_official("moh_dit", sd, qkv_bias=True, **cfg)
    x = torch.randn(2, 7, cfg["dim"], dtype=F64)
    want = official_forward(sd, x, **{k: v for k, v in cfg.items() if k != "dim"})
    for path in ("sparse", "dense"):
        module.attention.path = path
        torch.testing.assert_close(module(x), want, rtol=0, atol=1e-10)


def test_load_balance_loss_matches_the_official_list():
    cfg = dict(dim=20, num_heads=5, shared_head=2, routed_head=2)
    sd = official_state(20, 5, 2, 2)
    module = from_official("moh_dit", sd, qkv_bias=True, **cfg).train()
    x = torch.randn(3, 6, 20, dtype=F64)
    losses: list[torch.Tensor] = []
    official_forward(sd, x, num_heads=5, shared_head=2, routed_head=2, training=True, losses=losses)
    module(x)
    # the official frequencies are float32 (mask.float()); ours use the model dtype
    torch.testing.assert_close(module.aux_loss, losses[0], rtol=1e-6, atol=1e-7)
    assert module.eval()(x) is not None and module.aux_loss is None


def test_round_trip():
    sd = official_state(24, 6, 3, 2, head_dim=5, qkv_bias=False)
    module = from_official("moh_dit", sd, dim=24, num_heads=6, shared_head=3, routed_head=2, head_dim=5)
    back = to_official(module)
    assert set(back) == set(sd)
    for name in sd:
        assert torch.equal(back[name], sd[name])
    assert from_official("moh_dit", back, dim=24, num_heads=6, shared_head=3, routed_head=2, head_dim=5) is not None


def test_refuses_what_the_official_class_cannot_run():
    sd = official_state(20, 4, 2, 1)
    with pytest.raises(ValueError, match="shared_head=0 and routed_head=0"):
        from_official("moh_dit", sd, dim=20, num_heads=4)
    with pytest.raises(ValueError, match="shared_head=1"):
        from_official("moh_dit", sd, dim=20, num_heads=4, shared_head=1, routed_head=1)
    with pytest.raises(ValueError, match="qk_norm"):
        from_official("moh_dit", sd, dim=20, num_heads=4, shared_head=2, routed_head=1, qk_norm=True)
    with pytest.raises(ValueError, match="unexpected official key 'qkv.bias'"):
        from_official("moh_dit", sd, dim=20, num_heads=4, shared_head=2, routed_head=1)  # qkv_bias defaults to False
    partial = {k: v for k, v in sd.items() if k != "wg_0.weight"}
    with pytest.raises(ValueError, match="lacks.*wg_0.weight"):
        from_official("moh_dit", partial, dim=20, num_heads=4, shared_head=2, routed_head=1, qkv_bias=True)
    with pytest.raises(ValueError, match="'wg.weight' has shape"):
        from_official(
            "moh_dit", {**sd, "wg.weight": sd["wg.weight"][:1]}, dim=20, num_heads=4, shared_head=2,
            routed_head=1, qkv_bias=True,
        )
