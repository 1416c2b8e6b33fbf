"""DCMHA's and Talking-Heads' ``rope`` and ``qk_norm`` options: against the
NumPy reference fed q/k normalised and rotated independently (NumPy RMS norm
and rotate-half / interleaved RoPE), cached decoding, bitwise unchanged
behaviour when off, and inside a tiny GPT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees

from multihead.modules.dcmha import DCMHA, TalkingHeadsAttention
from multihead.modules.registry import build_attention
from multihead.reference.dcmha import dcmha_attention, talking_heads_attention

F64 = torch.float64
KINDS = ["dcmha", "talking_heads"]


def make(kind="dcmha", seed=0, C=16, H=4, **opts):
    torch.manual_seed(seed)
    cls = DCMHA if kind == "dcmha" else TalkingHeadsAttention
    m = cls(C, H, dtype=F64, **opts)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        if m.qk_norm is not None:
            m.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
            m.qk_norm.k_norm.weight.uniform_(0.5, 1.5)
    return m.eval()


def n(t):
    return None if t is None else t.detach().numpy()


def np_rms(x, w):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w


def np_rope(x, pos, *, base=10000.0, interleaved=False, rotary_dim=None):
    """x [B, H, T, D], pos [T] or [B, T]: rotate pairs by pos·base^(-2i/r)."""
    B, _, T, D = x.shape
    r = D if rotary_dim is None else rotary_dim
    theta = base ** (-2.0 * np.arange(r // 2) / r)
    ang = np.broadcast_to(pos, (B, T)).astype(np.float64)[:, None, :, None] * theta  # [B, 1, T, r/2]
    ia = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    out = x.copy()
    a, b = x[..., ia], x[..., ib]
    out[..., ia] = a * np.cos(ang) - b * np.sin(ang)
    out[..., ib] = b * np.cos(ang) + a * np.sin(ang)
    return out


def reference(m, x, key=None, *, mask=None, q_pos=None, k_pos=None, rope=True, qk_norm=True, **kw):
    """Module ``m`` in NumPy float64 from its own projection: qk_norm -> rope -> composed core."""
    key = x if key is None else key
    q, k, v = (n(t) for t in m.project(x, key))
    if qk_norm and m.qk_norm is not None:
        q, k = np_rms(q, n(m.qk_norm.q_norm.weight)), np_rms(k, n(m.qk_norm.k_norm.weight))
    if rope and m.rope is not None:
        q = np_rope(q, np.arange(q.shape[2]) if q_pos is None else q_pos, **m.rope)
        k = np_rope(k, np.arange(k.shape[2]) if k_pos is None else k_pos, **m.rope)
    if m.dynamic:
        out, w = dcmha_attention(n(x), n(key), q, k, v, n(m.dw1), n(m.qkw), n(m.dd),
                                 n(getattr(m, "pre_static", None)), n(getattr(m, "post_static", None)),
                                 mask=mask, **kw)  # fmt: skip
    else:
        out, w = talking_heads_attention(q, k, v, n(m.pre_static), n(m.post_static), mask=mask, **kw)
    B, H, T, D = out.shape
    out = torch.from_numpy(out).transpose(1, 2).reshape(B, T, H * D)
    return m.out_proj(out).detach(), torch.from_numpy(w)


def close(a, b, tol=1e-10):
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape
    scale = max(1.0, float(b.abs().max()))
    err = float((a - b).abs().max())
    assert err <= tol * scale, err


def far(a, b):
    return float((a.detach() - b.detach()).abs().max()) > 1e-6


ROPES = [True, {"base": 300.0, "interleaved": True}, {"rotary_dim": 2}]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_with_rope_and_qk_norm(kind, rope, causal):
    m = make(kind, rope=rope, qk_norm=True, chunk_size=3)
    torch.manual_seed(1)
    x = torch.randn(2, 7, 16, dtype=F64)
    out, w = m(x, is_causal=causal, return_weights=True)
    want, want_w = reference(m, x, is_causal=causal)
    close(out, want)
    close(w, want_w)
    # honest: the reference without rope, or without qk_norm, is a different function
    assert far(out, reference(m, x, is_causal=causal, rope=False)[0])
    assert far(out, reference(m, x, is_causal=causal, qk_norm=False)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_only_one_of_the_options(kind):
    x = torch.randn(2, 6, 16, dtype=F64)
    for opts in (dict(rope=True, qk_norm=False), dict(rope=False, qk_norm=True)):
        m = make(kind, **opts)
        close(m(x, is_causal=True), reference(m, x, is_causal=True)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_positions_and_cross_attention(kind):
    m = make(kind, rope=True, qk_norm=True)
    x = torch.randn(2, 6, 16, dtype=F64)
    keep = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
    got = m(x, is_causal=True, key_padding_mask=keep, positions=pos)
    want, _ = reference(m, x, mask=n(keep[:, None, None, :]), q_pos=n(pos), k_pos=n(pos), is_causal=True)
    close(got, want)
    close(got[1:, 2:], m(x[1:, 2:], is_causal=True))  # the padded row's tokens equal them unpadded
    # cross-attention: queries at ``positions``, keys at 0 .. S-1
    mem = torch.randn(2, 5, 16, dtype=F64)
    qp = torch.arange(3, 9)
    close(m(x, mem, positions=qp), reference(m, x, mem, q_pos=n(qp))[0])


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_equals_recomputation(kind):
    m = make(kind, C=12, H=2, rope=True, qk_norm=True, chunk_size=2)
    x = torch.randn(2, 8, 12, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 8)
    parts = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    parts += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 8)]
    close(torch.cat(parts, dim=1), full, tol=1e-12)
    # the cache holds rotated keys: without the offset, decoding would differ
    cache2 = m.make_kv_cache(2, 8)
    m(x[:, :4], is_causal=True, kv_cache=cache2)
    wrong = m(x[:, 4:5], is_causal=True, kv_cache=cache2, positions=torch.tensor([0]))
    assert far(wrong, full[:, 4:5])


@pytest.mark.parametrize("kind", KINDS)
def test_cached_left_padded_decoding_with_positions(kind):
    m = make(kind, C=12, H=2, rope={"interleaved": True}, qk_norm=True)
    x = torch.randn(2, 7, 12, dtype=F64)
    keep = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
    full = m(x, is_causal=True, key_padding_mask=keep, positions=pos)
    cache = m.make_kv_cache(2, 7)
    out = [m(x[:, :5], is_causal=True, key_padding_mask=keep[:, :5], positions=pos[:, :5], kv_cache=cache)]
    for t in (5, 6):
        out.append(m(x[:, t : t + 1], is_causal=True, key_padding_mask=keep[:, : t + 1],
                     positions=pos[:, t : t + 1], kv_cache=cache))  # fmt: skip
    close(torch.cat(out, dim=1)[keep], full[keep], tol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_options_off_are_bitwise_unchanged(kind):
    base = make(kind, C=12, H=2)
    off = make(kind, C=12, H=2, rope=False, qk_norm=False, seed=5)
    assert list(off.state_dict()) == list(base.state_dict())
    off.load_state_dict(base.state_dict())
    assert off.rope is None and off.qk_norm is None
    x, mem = torch.randn(2, 6, 12, dtype=F64), torch.randn(2, 4, 12, dtype=F64)
    # options off run the very same operations as the default module: bitwise
    for args, kw in (((x,), {"is_causal": True}), ((x, mem), {}), ((x,), {"return_weights": True})):
        a, b = base(*args, **kw), off(*args, **kw)
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(u, v)
    caches = [base.make_kv_cache(2, 6), off.make_kv_cache(2, 6)]
    for t0, t1 in ((0, 3), (3, 4), (4, 6)):
        a, b = (mod(x[:, t0:t1], is_causal=True, kv_cache=c) for mod, c in zip((base, off), caches))
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="rope"):
        off(x, positions=torch.arange(6))


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_parameters_cost_and_registry(kind):
    m = build_attention(kind, embed_dim=12, num_heads=3, rope={"base": 500.0}, qk_norm=True)  # D = 4
    plain = build_attention(kind, embed_dim=12, num_heads=3)
    keys = list(m.state_dict())
    assert keys[: len(plain.state_dict())] == list(plain.state_dict())  # projections first
    assert keys[len(plain.state_dict()) :] == ["qk_norm.q_norm.weight", "qk_norm.k_norm.weight"]
    assert m.rope["base"] == 500.0 and not m.rope["interleaved"]
    cost = m.cost(9, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters()) == plain.cost(9).parameters + 2 * 4
    assert cost.total_flops == plain.cost(9, batch=2).total_flops
    assert "(rope): Rotary(" in repr(m)


def test_observer_gets_rotated_q_and_k():
    m = make(rope=True, qk_norm=True)
    events = []
    handle = m.register_attention_observer(lambda mod, e: events.append(e))
    x = torch.randn(1, 5, 16, dtype=F64)
    m(x, is_causal=True)
    handle.remove()
    (e,) = events
    q, k, _ = m.project(x)
    q, k = m.qk_norm(q, k)
    q = torch.from_numpy(np_rope(n(q), np.arange(5)))
    k = torch.from_numpy(np_rope(n(k), np.arange(5)))
    close(e.q, q)
    close(e.k, k)


@pytest.mark.parametrize("kind", KINDS)
def test_gpt_generates_cached_equals_uncached(kind):
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    opts = {"rope": True, "qk_norm": True, "chunk_size": 3}
    model = GPT(GPTConfig.from_preset("tiny", attention=kind, attention_options=opts)).eval()
    assert model.blocks[0].attn.rope is not None and model.blocks[0].attn.qk_norm is not None
    idx = torch.randint(0, 256, (2, 5))
    a = assert_cached_generation_agrees(model, idx, 4)
    assert torch.equal(a[:, :5], idx)
