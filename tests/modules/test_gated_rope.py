"""GatedHeadAttention's ``rope`` and ``qk_norm`` options: against an independent
NumPy float64 computation, with a KV cache, cross-attention, observers,
``from_attention``, the builder, a tiny GPT, and bitwise unchanged behaviour
when both are off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead import MultiHeadAttention
from multihead.modules.gated import GatedHeadAttention
from multihead.modules.registry import build_attention
from multihead.reference.attention import attention as np_attention
from multihead.reference.gated import hard_concrete_eval_gate

F64 = torch.float64
TOL = 1e-10
LOG_ALPHA = [-3.0, -0.8, 0.3, 1.7, 4.0]  # closed, partly open (three), fully open


def _module(seed=0, num_heads=5, embed_dim=30, **kw) -> GatedHeadAttention:
    torch.manual_seed(seed)
    m = GatedHeadAttention(embed_dim, num_heads, dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        if m.qk_norm is not None:
            m.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
            m.qk_norm.k_norm.weight.uniform_(0.5, 1.5)
        m.log_alpha.copy_(torch.tensor(LOG_ALPHA[:num_heads], dtype=F64))
    return m.eval()


def _np(t):
    return t.detach().numpy()


def np_rope(x, pos, *, base=10000.0, interleaved=False, rotary_dim=None):
    """x [B, H, T, D], pos [T] or [B, T]: rotate channel pairs by pos·base^(-2i/r)."""
    B, _, T, D = x.shape
    r = D if rotary_dim is None else rotary_dim
    theta = base ** (-2.0 * np.arange(r // 2) / r)  # [r/2]
    ang = np.broadcast_to(pos, (B, T)).astype(np.float64)[:, None, :, None] * theta  # [B, 1, T, r/2]
    ia = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    out = x.copy()
    a, b = x[..., ia], x[..., ib]
    out[..., ia] = a * np.cos(ang) - b * np.sin(ang)
    out[..., ib] = b * np.cos(ang) + a * np.sin(ang)
    return out


def np_forward(m, x, key=None, *, causal=False, keep=None, pos=None, rope=None, qk_norm=False):
    """The gated module's eval forward in NumPy float64, built from its weights only."""
    B, T, _ = x.shape
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    kv = x if key is None else key
    S = kv.shape[1]
    w = m.projection_weights()
    lin = {n: (_np(W), _np(b)) for n, (W, b) in w.items()}
    q = (x @ lin["q"][0].T + lin["q"][1]).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    k = (kv @ lin["k"][0].T + lin["k"][1]).reshape(B, S, G, D).transpose(0, 2, 1, 3)
    v = (kv @ lin["v"][0].T + lin["v"][1]).reshape(B, S, G, D).transpose(0, 2, 1, 3)
    if qk_norm:

        def rms(t, g):
            return t / np.sqrt((t**2).mean(-1, keepdims=True) + 1e-6) * g

        q, k = rms(q, _np(m.qk_norm.q_norm.weight)), rms(k, _np(m.qk_norm.k_norm.weight))
    if rope is not None:
        q_pos = np.arange(T) if pos is None else pos
        k_pos = np.arange(S) if key is not None or pos is None else pos
        q, k = np_rope(q, q_pos, **rope), np_rope(k, k_pos, **rope)
    mask = None if keep is None else keep[:, None, None, :]
    heads = np_attention(q, k, v, mask=mask, is_causal=causal)  # (B, H, T, D)
    heads = heads * hard_concrete_eval_gate(_np(m.log_alpha))[:, None, None]
    out = heads.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return out @ _np(m.out_proj.weight).T + _np(m.out_proj.bias)


def _close(got, want, tol=TOL):
    got = _np(got)
    assert got.shape == want.shape and np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= tol * max(1.0, np.abs(want).max()), err


CASES = [
    dict(rope=True, qk_norm=True),
    dict(rope=True, qk_norm=True, num_kv_heads=1),
    dict(rope={"interleaved": True, "base": 300.0}, qk_norm=True, num_heads=4, embed_dim=24, num_kv_heads=2),
    dict(rope={"rotary_dim": 4}, qk_norm=False),  # rotate 4 of D = 6 channels
    dict(rope={"rotary_dim": 2, "interleaved": True}, qk_norm=True, embed_dim=25),  # D = 5
    dict(rope=False, qk_norm=True),
]


# ---------------------------------------------------------------- (1) vs independent computation


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy(opts, causal):
    m = _module(**opts)
    torch.manual_seed(1)
    x = torch.randn(2, 7, m.embed_dim, dtype=F64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    want = np_forward(m, x.numpy(), causal=causal, keep=keep.numpy(), rope=m.rope, qk_norm=opts["qk_norm"])
    _close(m(x, is_causal=causal, key_padding_mask=keep), want)
    if m.rope is not None:  # the check is sensitive to rope: skipping it would fail
        no_rope = np_forward(m, x.numpy(), causal=causal, keep=keep.numpy(), qk_norm=opts["qk_norm"])
        assert np.abs(no_rope - want).max() > 1e-3


def test_explicit_positions_and_cross_attention():
    m = _module(rope=True, qk_norm=True)
    x, mem = torch.randn(2, 6, 30, dtype=F64), torch.randn(2, 4, 30, dtype=F64)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3]])
    _close(m(x, is_causal=True, positions=pos), np_forward(m, x.numpy(), causal=True, pos=pos.numpy(), rope={},
                                                           qk_norm=True))  # fmt: skip
    # cross-attention: queries at `positions` (default 0 .. T-1), keys at 0 .. S-1
    _close(m(x, mem), np_forward(m, x.numpy(), mem.numpy(), rope={}, qk_norm=True))
    _close(m(x, mem, positions=pos), np_forward(m, x.numpy(), mem.numpy(), pos=pos.numpy(), rope={}, qk_norm=True))
    with pytest.raises(ValueError, match="only used with rope"):
        _module()(x, positions=pos)


# ---------------------------------------------------------------- (2) cache


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_cached_decoding_equals_recomputation_with_rope(num_kv_heads):
    m = _module(num_kv_heads=num_kv_heads, rope=True, qk_norm=True)
    x = torch.randn(2, 9, 30, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    # the cache holds normalised, rotated keys
    q, k, v = m.project(x)
    _, k = m.position_qk(q, k, None, None)
    torch.testing.assert_close(cache.k[:, :, :9], k, rtol=0, atol=1e-12)


def test_cached_left_padded_decoding_with_positions():
    m = _module(num_heads=4, embed_dim=24, num_kv_heads=2, rope={"interleaved": True}, qk_norm=True)
    x = torch.randn(2, 7, 24, dtype=F64)
    keep = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
    full = m(x, is_causal=True, key_padding_mask=keep, positions=pos)
    cache = m.make_kv_cache(2, 7)
    out = [m(x[:, :5], is_causal=True, key_padding_mask=keep[:, :5], positions=pos[:, :5], kv_cache=cache)]
    for t in (5, 6):
        out.append(m(x[:, t : t + 1], is_causal=True, key_padding_mask=keep[:, : t + 1],
                     positions=pos[:, t : t + 1], kv_cache=cache))  # fmt: skip
    torch.testing.assert_close(torch.cat(out, 1)[keep], full[keep], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- (3) off = unchanged


@pytest.mark.parametrize("training", [False, True])
def test_options_off_are_bitwise_unchanged(training):
    plain = _module(num_kv_heads=1)
    off = GatedHeadAttention(30, 5, num_kv_heads=1, rope=False, qk_norm=False, dtype=F64)
    off.load_state_dict(plain.state_dict())
    assert list(off.state_dict()) == list(plain.state_dict())
    assert off.rope is None and off.qk_norm is None
    plain.train(training), off.train(training)
    x = torch.randn(2, 7, 30, dtype=F64)
    torch.manual_seed(5)
    a, wa = plain(x, is_causal=True, return_weights=True)
    torch.manual_seed(5)
    b, wb = off(x, is_causal=True, return_weights=True)
    assert torch.equal(a, b) and torch.equal(wa, wb)


def test_rope_changes_the_output():
    plain = _module()
    roped = GatedHeadAttention(30, 5, rope=True, dtype=F64).eval()
    roped.load_state_dict(plain.state_dict())
    x = torch.randn(1, 6, 30, dtype=F64)
    assert not torch.allclose(plain(x), roped(x))


# ---------------------------------------------------------------- state, cost, observer, builders


def test_state_dict_order_and_cost():
    m = GatedHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    assert list(m.state_dict()) == [  # own parameter first (as before), then projections, then the norm
        "log_alpha", "qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias",
        "qk_norm.q_norm.weight", "qk_norm.k_norm.weight",
    ]  # fmt: skip
    base = GatedHeadAttention(24, 4, num_kv_heads=2).cost(7, causal=True)
    cost = m.cost(7, causal=True)
    assert cost.parameters == sum(p.numel() for p in m.parameters()) == base.parameters + 2 * 6
    assert (cost.core_flops, cost.projection_flops) == (base.core_flops, base.projection_flops)
    assert "(rope): Rotary(" in repr(m)


def test_observer_sees_rotated_queries_and_keys():
    m = _module(rope=True, qk_norm=True)
    events = []
    m.register_attention_observer(lambda mod, ev: events.append(ev))
    x = torch.randn(1, 5, 30, dtype=F64)
    m(x)
    ev = events[0]
    q, k, _ = m.project(x)
    q, k = m.position_qk(q, k, None, None)  # the forward's own operations on the same shapes: bitwise
    torch.testing.assert_close(ev.q, q, rtol=0, atol=0)
    torch.testing.assert_close(ev.k, k, rtol=0, atol=0)
    g = m.gate_values()[:, None, None]
    torch.testing.assert_close(torch.softmax(ev.q @ ev.k.transpose(-1, -2) * ev.scale, -1) * g, ev.weights,
                               rtol=0, atol=1e-12)  # fmt: skip


def test_builder_and_from_attention_pass_the_options():
    m = build_attention("gated", embed_dim=24, num_heads=4, rope={"rotary_dim": 4}, qk_norm=True)
    assert isinstance(m, GatedHeadAttention) and m.rope["rotary_dim"] == 4 and m.qk_norm is not None
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 4, num_kv_heads=2, rope={"interleaved": True}, qk_norm=True, dtype=F64).eval()
    with torch.no_grad():
        mha.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
    g = GatedHeadAttention.from_attention(mha)
    assert g.rope.options == mha.rope.options and torch.equal(g.qk_norm.q_norm.weight, mha.qk_norm.q_norm.weight)
    with torch.no_grad():
        g.log_alpha.fill_(3.0)  # all gates 1: the same as the MHA
    x = torch.randn(2, 5, 24, dtype=F64)
    assert_paths_agree(g(x, is_causal=True), mha(x, is_causal=True))
    off = GatedHeadAttention.from_attention(mha, rope=False, qk_norm=False)
    assert off.rope is None and off.qk_norm is None
    on = GatedHeadAttention.from_attention(MultiHeadAttention(24, 4), rope=True, qk_norm=True)
    assert on.rope is not None and on.qk_norm.k_norm.weight.eq(1).all()


# ---------------------------------------------------------------- (4) tiny GPT


def test_gpt_by_name_generates_the_same_with_and_without_cache():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    opts = {"rope": True, "qk_norm": True, "l0_coef": 0.5}
    model = GPT(GPTConfig.from_preset("tiny", attention="gated", attention_options=opts)).eval()
    assert all(isinstance(b.attn, GatedHeadAttention) and b.attn.rope is not None and b.attn.qk_norm is not None
               for b in model.blocks)  # fmt: skip
    idx = torch.randint(0, 256, (2, 5))
    assert_cached_generation_agrees(model, idx, 4)
