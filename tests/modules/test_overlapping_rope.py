"""OverlappingHeadAttention's ``rope`` and ``qk_norm`` options: they act on the
widened heads (Dw = D + 2·overlap) and are checked against an independent
float64 loop, with a per-head KV cache, inside a GPT, and bitwise unchanged
behaviour when both are off."""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_cached_generation_agrees

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.overlapping import OverlappingHeadAttention
from multihead.modules.registry import build_attention

F64 = torch.float64
TOL = 1e-10
C, H, D = 12, 3, 4  # Dw = 4 + 2·ov is even


def make(overlap=1, seed=0, embed_dim=C, num_heads=H, **kw):
    torch.manual_seed(seed)
    m = OverlappingHeadAttention(embed_dim, num_heads, overlap=overlap, dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)  # qk_norm gains too, so they are not all ones
    return m.eval()


def x_(B=2, T=7, seed=1, width=C):
    return torch.randn(B, T, width, dtype=F64, generator=torch.Generator().manual_seed(seed))


def manual_rope(t, pos, *, base=10000.0, interleaved=False, rotary_dim=None):
    """t [B, H, N, Dw], pos [N] or [B, N]: rotate channel pairs by pos·base^(-2i/r)."""
    B, _, N, Dw = t.shape
    r = Dw if rotary_dim is None else rotary_dim
    theta = base ** (-2.0 * torch.arange(r // 2, dtype=F64) / r)
    ang = pos.to(F64).expand(B, N)[:, None, :, None] * theta  # [B, 1, N, r/2]
    ia = torch.arange(0, r, 2) if interleaved else torch.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    out = t.clone()
    a, b = t[..., ia], t[..., ib]
    out[..., ia] = a * ang.cos() - b * ang.sin()
    out[..., ib] = b * ang.cos() + a * ang.sin()
    return out


def manual_forward(m, x, ctx=None, *, causal=False, keep=None, pos=None, rope=None, qk_norm=False):
    """Loop over heads and channels: widened heads, RMS norm over Dw, rope over Dw, softmax(q̃k̃ᵀ/√D)ṽ."""
    self_attn = ctx is None
    ctx = x if ctx is None else ctx
    Hh, Dd, ov = m.num_heads, m.head_dim, m.overlap
    HD = Hh * Dd
    W, b = m.qkv_proj.weight, m.qkv_proj.bias
    q, k, v = (inp @ W[i * HD : (i + 1) * HD].T + b[i * HD : (i + 1) * HD] for i, inp in enumerate((x, ctx, ctx)))
    T, S = x.shape[1], ctx.shape[1]

    def take(t, i):
        zero = torch.zeros_like(t[..., 0])
        cols = range(i * Dd - ov, (i + 1) * Dd + ov)
        return torch.stack([t[..., c] if 0 <= c < HD else zero for c in cols], dim=-1)  # (B, N, Dw)

    qh = torch.stack([take(q, i) for i in range(Hh)], 1)  # (B, H, T, Dw)
    kh = torch.stack([take(k, i) for i in range(Hh)], 1)
    vh = torch.stack([take(v, i) for i in range(Hh)], 1)
    if qk_norm:
        def rms(t, w):
            return t / torch.sqrt((t**2).mean(-1, keepdim=True) + 1e-6) * w

        qh, kh = rms(qh, m.qk_norm.q_norm.weight), rms(kh, m.qk_norm.k_norm.weight)
    if rope is not None:
        q_pos = torch.arange(T) if pos is None else pos
        k_pos = q_pos if self_attn else torch.arange(S)
        qh, kh = manual_rope(qh, q_pos, **rope), manual_rope(kh, k_pos, **rope)
    allowed = torch.ones(x.shape[0], 1, T, S, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    s = qh @ kh.transpose(-1, -2) * Dd**-0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (p @ vh).transpose(1, 2).reshape(x.shape[0], T, -1)
    return m.out_proj(out), p


ROPE = {"base": 10000.0, "interleaved": False, "rotary_dim": None}


# ---------------------------------------------------------------- (1) reference
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("overlap", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_rope_qk_norm_match_manual_float64(backend, overlap, causal):
    m, x = make(overlap, rope=True, qk_norm=True), x_()
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False  # padding that leaves every causal row a visible key
    want_y, want_A = manual_forward(m, x, causal=causal, keep=keep, rope=ROPE, qk_norm=True)
    y = m(x, key_padding_mask=keep, is_causal=causal, backend=backend)
    torch.testing.assert_close(y, want_y, atol=TOL, rtol=0)
    if backend == "math":
        _, A = m(x, key_padding_mask=keep, is_causal=causal, return_weights=True, backend=backend)
        torch.testing.assert_close(A, want_A, atol=TOL, rtol=0)
    # honesty: the same computation without rope (or without the norm) is far off
    assert (manual_forward(m, x, causal=causal, keep=keep, qk_norm=True)[0] - y).abs().max() > 1e-3
    assert (manual_forward(m, x, causal=causal, keep=keep, rope=ROPE)[0] - y).abs().max() > 1e-3


@pytest.mark.parametrize(
    "rope", [{"interleaved": True}, {"base": 500.0}, {"rotary_dim": 4}], ids=["interleaved", "base", "rotary_dim"]
)
def test_rope_options_and_positions_match_manual(rope):
    m, x = make(2, rope=rope), x_()
    opts = {**ROPE, **rope}
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])
    want, _ = manual_forward(m, x, causal=True, pos=pos, rope=opts)
    torch.testing.assert_close(m(x, is_causal=True, positions=pos), want, atol=TOL, rtol=0)


def test_cross_attention_keys_at_zero_to_s_minus_one():
    m = make(1, rope=True, qk_norm=True)
    x, ctx = x_(T=4), x_(T=6, seed=2)
    pos = torch.arange(10, 14)
    want, _ = manual_forward(m, x, ctx, pos=pos, rope=ROPE, qk_norm=True)
    torch.testing.assert_close(m(x, ctx, positions=pos), want, atol=TOL, rtol=0)


def test_odd_wide_head_needs_even_rotary_dim():
    # D = 5, ov = 1: Dw = 7
    with pytest.raises(ValueError, match="Dw = D \\+ 2\\*overlap = 5 \\+ 2\\*1 = 7"):
        OverlappingHeadAttention(15, 3, overlap=1, rope=True)
    with pytest.raises(ValueError, match="= 7"):
        OverlappingHeadAttention(15, 3, overlap=1, rope={"base": 100.0})
    m = make(1, embed_dim=15, num_heads=3, rope={"rotary_dim": 6}, qk_norm=True)
    x = x_(width=15)
    want, _ = manual_forward(m, x, causal=True, rope={**ROPE, "rotary_dim": 6}, qk_norm=True)
    torch.testing.assert_close(m(x, is_causal=True), want, atol=TOL, rtol=0)


def test_positions_need_rope_and_norm_gains_are_dw_wide():
    with pytest.raises(ValueError, match="rope"):
        make(1)(x_(), positions=torch.arange(7))
    m = make(2, qk_norm=True)
    assert m.qk_norm.q_norm.weight.shape == (m.wide_head_dim,) == (8,)
    assert list(m.state_dict())[:4] == ["qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias"]
    assert m.cost(5).parameters == sum(p.numel() for p in m.parameters())
    assert m.cost(5).kv_cache_bytes_per_token == 2 * H * m.wide_head_dim * 2
    assert "(rope): Rotary(" in repr(make(1, rope=True))


# ---------------------------------------------------------------- (2) cache
@pytest.mark.parametrize("opts", [dict(rope=True, qk_norm=True), dict(rope=True), dict(qk_norm=True)])
@pytest.mark.parametrize("overlap", [1, 5])
def test_cached_decoding_equals_full_recompute(opts, overlap):
    m, x = make(overlap, **opts), x_(T=8)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 8)
    assert cache.k.shape == (2, H, 8, m.wide_head_dim)
    steps = [m(x[:, :5], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=TOL, rtol=0)


def test_cached_decoding_with_explicit_positions():
    m, x = make(2, rope=True, qk_norm=True), x_(T=6)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4]])
    full = m(x, is_causal=True, positions=pos)
    cache = m.make_kv_cache(2, 6)
    steps = [m(x[:, :3], is_causal=True, kv_cache=cache, positions=pos[:, :3])]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, positions=pos[:, t : t + 1]) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=TOL, rtol=0)


# ---------------------------------------------------------------- (3) off is unchanged
@pytest.mark.parametrize("overlap", [0, 2])
def test_options_off_are_bitwise_unchanged(overlap):
    base = make(overlap)
    off = OverlappingHeadAttention(C, H, overlap=overlap, rope=False, qk_norm=False, dtype=F64).eval()
    off.load_state_dict(base.state_dict())
    assert list(off.state_dict()) == list(base.state_dict())
    x = x_(T=6)  # options off run the very same operations as the default module: bitwise
    y0, A0 = base(x, is_causal=True, return_weights=True)
    y1, A1 = off(x, is_causal=True, return_weights=True)
    assert torch.equal(y0, y1) and torch.equal(A0, A1)
    c0, c1 = base.make_kv_cache(2, 6), off.make_kv_cache(2, 6)
    assert c1.k.shape == c0.k.shape == (2, 1, 6, H * D + 2 * overlap)
    for a, b in ((0, 4), (4, 5), (5, 6)):
        assert torch.equal(base(x[:, a:b], is_causal=True, kv_cache=c0), off(x[:, a:b], is_causal=True, kv_cache=c1))
    assert off.cost(6) == base.cost(6)


def test_registry_passes_options():
    m = build_attention("overlapping", embed_dim=C, num_heads=H, overlap=1, rope={"base": 100.0}, qk_norm=True)
    assert m.rope["base"] == 100.0 and m.qk_norm is not None


# ---------------------------------------------------------------- (4) GPT
def test_tiny_gpt_generate_cached_equals_uncached():
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(
        "tiny", attention="overlapping", attention_options={"rope": True, "qk_norm": True, "overlap": 2}
    )
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    assert_cached_generation_agrees(model, idx, 4)
