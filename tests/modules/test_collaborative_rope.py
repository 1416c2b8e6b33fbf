"""CollaborativeAttention's ``rope`` and ``qk_norm`` options.

qk_norm normalises the shared Q and K over D̃ before the mixing; rope rotates
the mixed queries Q ⊙ m_h and the shared keys K (never the content-bias
channels). Checked against an independent NumPy float64 computation, with a
KV cache, for relative-position invariance, and for bitwise unchanged
behaviour when both are off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.collaborative import CollaborativeAttention
from multihead.modules.registry import build_attention

F64 = torch.float64
TOL = 1e-10


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def np_rope(x, pos, *, base=10000.0, interleaved=False, rotary_dim=None):
    """x [B, H, T, D], pos [T] or [B, T]: rotate channel pairs by pos·base^(-2i/r)."""
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


def np_forward(m, x, key=None, *, causal=False, pos=None, rope=None, qk_norm=False):
    """Collaborative attention head by head in NumPy float64 (self- or cross-attention)."""
    key = x if key is None else key
    B, T, _ = x.shape
    S = key.shape[1]
    H, Dv = m.num_heads, m.head_dim
    Q = x @ _np(m.q_proj.weight).T  # (B, T, D̃)
    K = key @ _np(m.k_proj.weight).T  # (B, S, D̃)
    cb = key @ _np(m.content_bias.weight).T  # (B, S, H)
    V = (key @ _np(m.v_proj.weight).T + _np(m.v_proj.bias)).reshape(B, S, H, Dv)
    if qk_norm:
        def rms(t, w):
            return t / np.sqrt((t**2).mean(-1, keepdims=True) + 1e-6) * w

        Q, K = rms(Q, _np(m.qk_norm.q_norm.weight)), rms(K, _np(m.qk_norm.k_norm.weight))
    mixing = _np(m.mixing)
    if rope is not None:
        qpos = np.arange(T) if pos is None else pos
        kpos = np.arange(S) if pos is None or S != T else pos
        K = np_rope(K[:, None], kpos, **rope)[:, 0]
    outs = []
    for h in range(H):
        qh = Q * mixing[h]  # mixing first, then rope
        if rope is not None:
            qh = np_rope(qh[:, None], qpos, **rope)[:, 0]
        scores = m.scale * (np.einsum("btc,bsc->bts", qh, K) + cb[:, None, :, h])
        if causal:
            scores = np.where(np.tril(np.ones((T, S), dtype=bool)), scores, -np.inf)
        scores = scores - scores.max(-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(-1, keepdims=True)
        outs.append(p @ V[:, :, h])  # (B, T, Dv)
    out = np.concatenate(outs, axis=-1)
    return out @ _np(m.out_proj.weight).T + _np(m.out_proj.bias)


def make(seed=0, **kw) -> CollaborativeAttention:
    torch.manual_seed(seed)
    kw.setdefault("embed_dim", 16)
    kw.setdefault("num_heads", 4)
    kw.setdefault("dtype", F64)
    m = CollaborativeAttention(**kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "qk_norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5)
    return m.eval()


ROPES = [{}, {"interleaved": True}, {"rotary_dim": 6, "base": 100.0}]


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_with_rope_and_qk_norm(rope, causal):
    m = make(rope=rope, qk_norm=True, shared_dim=12)
    x = torch.randn(2, 7, 16, dtype=F64)
    y = m(x, is_causal=causal)
    expected = np_forward(m, _np(x), causal=causal, rope={"base": 10000.0, **rope}, qk_norm=True)
    np.testing.assert_allclose(_np(y), expected, atol=TOL, rtol=0)
    # honesty: the same computation without rope (or without qk_norm) differs
    assert not np.allclose(_np(y), np_forward(m, _np(x), causal=causal, qk_norm=True), atol=1e-4)
    assert not np.allclose(_np(y), np_forward(m, _np(x), causal=causal, rope={"base": 10000.0, **rope}), atol=1e-4)


def test_matches_numpy_with_explicit_positions_and_cross_attention():
    m = make(rope=True, qk_norm=True)
    x = torch.randn(2, 5, 16, dtype=F64)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 2, 4, 6, 8]])
    y = m(x, positions=pos)
    np.testing.assert_allclose(_np(y), np_forward(m, _np(x), pos=_np(pos), rope={"base": 10000.0}, qk_norm=True), atol=TOL, rtol=0)
    mem = torch.randn(2, 9, 16, dtype=F64)  # cross-attention: keys at 0 .. S-1
    y = m(x, mem, positions=pos)
    expected = np_forward(m, _np(x), _np(mem), pos=_np(pos), rope={"base": 10000.0}, qk_norm=True)
    np.testing.assert_allclose(_np(y), expected, atol=TOL, rtol=0)


def test_scores_depend_on_relative_positions_only():
    """Rope after the mixing: shifting every position leaves the output unchanged."""
    m = make(rope=True, qk_norm=True)
    x = torch.randn(2, 6, 16, dtype=F64)
    base = m(x, is_causal=True)
    shifted = m(x, is_causal=True, positions=torch.arange(6) + 37)
    torch.testing.assert_close(shifted, base, atol=1e-10, rtol=0)


@pytest.mark.parametrize("rope", ROPES)
def test_cached_decoding_equals_full_recomputation(rope):
    m = make(rope=rope, qk_norm=True)
    x = torch.randn(2, 9, 16, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    parts = [m(x[:, :5], is_causal=True, kv_cache=cache)]
    for t in range(5, 9):
        parts.append(m(x[:, t : t + 1], is_causal=True, kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-10, rtol=0)
    # the cache holds the rotated keys [rope(norm(K)) | cb] at positions 0 .. 8, cb untouched
    _, k, _ = m.project(x)
    torch.testing.assert_close(cache.k, k, atol=1e-12, rtol=0)
    D = m.shared_dim
    assert_paths_agree(cache.k[..., D:], m.content_bias(x).unsqueeze(1))  # written in chunks vs one batch
    assert not torch.allclose(cache.k[..., :D], m.qk_norm.k_norm(m.k_proj(x)).unsqueeze(1))


def test_returned_weights_come_from_rotated_and_normalised_q_k():
    m = make(rope=True, qk_norm=True)
    x = torch.randn(1, 5, 16, dtype=F64)
    q, k, _ = m.project(x)
    _, w = m(x, return_weights=True)
    scores = m.scale * q @ k.transpose(-1, -2)
    torch.testing.assert_close(torch.softmax(scores, -1), w, atol=1e-12, rtol=0)


def test_observer_receives_rotated_and_normalised_q_k():
    m = make(rope=True, qk_norm=True)
    x = torch.randn(1, 5, 16, dtype=F64)
    events = []
    handle = m.register_attention_observer(lambda module, event: events.append(event))
    m(x, positions=torch.arange(5) + 2)
    handle.remove()
    q, k, _ = m.project(x, positions=torch.arange(5) + 2, key_positions=torch.arange(5) + 2)
    # same projection on the same shapes: bitwise
    torch.testing.assert_close(events[0].q, q, atol=0, rtol=0)
    torch.testing.assert_close(events[0].k, k, atol=0, rtol=0)
    raw_k = torch.cat([m.k_proj(x), m.content_bias(x)], dim=-1).unsqueeze(1)  # before qk_norm/rope
    assert not torch.allclose(events[0].k, raw_k)


@pytest.mark.parametrize("kw", [{}, {"shared_dim": 12, "kdim": 10, "vdim": 6, "head_dim": 3}])
def test_off_is_bitwise_unchanged(kw):
    torch.manual_seed(1)
    ref = CollaborativeAttention(16, 4, **kw)
    torch.manual_seed(1)
    off = CollaborativeAttention(16, 4, rope=False, qk_norm=False, **kw)
    assert off.rope is None and off.qk_norm is None
    assert list(off.state_dict()) == list(ref.state_dict())
    off.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 16)
    # options off run the very same operations as the default module: bitwise
    if "kdim" in kw:  # cross-attention only
        mem, val = torch.randn(2, 4, 10), torch.randn(2, 4, 6)
        assert torch.equal(off(x, mem, val), ref(x, mem, val))
    else:
        assert torch.equal(off(x, is_causal=True), ref(x, is_causal=True))
        assert torch.equal(off(x, x[:, :4]), ref(x, x[:, :4]))
        c1, c2 = ref.make_kv_cache(2, 6), off.make_kv_cache(2, 6)
        assert torch.equal(off(x[:, :4], is_causal=True, kv_cache=c2), ref(x[:, :4], is_causal=True, kv_cache=c1))
        assert torch.equal(off(x[:, 4:], is_causal=True, kv_cache=c2), ref(x[:, 4:], is_causal=True, kv_cache=c1))
    assert off.cost(6).parameters == ref.cost(6).parameters


def test_parameters_state_dict_and_cost():
    m = CollaborativeAttention(16, 4, shared_dim=12, rope=True, qk_norm=True)
    names = list(m.state_dict())
    assert names[-2:] == ["qk_norm.q_norm.weight", "qk_norm.k_norm.weight"]
    assert m.qk_norm.q_norm.weight.shape == (12,)
    plain = CollaborativeAttention(16, 4, shared_dim=12)
    assert m.cost(5).parameters == sum(p.numel() for p in m.parameters()) == plain.cost(5).parameters + 2 * 12
    assert "(rope): Rotary(" in repr(m)


def test_errors():
    with pytest.raises(ValueError, match="shared_dim=7"):
        CollaborativeAttention(16, 4, shared_dim=7, rope=True)
    CollaborativeAttention(16, 4, shared_dim=7, rope={"rotary_dim": 6})  # an even rotary_dim is fine
    with pytest.raises(ValueError, match="rotary_dim"):
        CollaborativeAttention(16, 4, shared_dim=8, rope={"rotary_dim": 10})
    with pytest.raises(ValueError, match="unknown rope options"):
        CollaborativeAttention(16, 4, rope={"theta": 3})
    with pytest.raises(TypeError, match="qk_norm"):
        CollaborativeAttention(16, 4, qk_norm=1)
    with pytest.raises(ValueError, match="only used with rope"):
        CollaborativeAttention(16, 4)(torch.randn(1, 3, 16), positions=torch.arange(3))
    with pytest.raises(ValueError, match="rope and qk_norm"):
        CollaborativeAttention(16, 4, rope=True).compress(4)
    from multihead import MultiHeadAttention

    with pytest.raises(ValueError, match="rope and qk_norm"):
        CollaborativeAttention.from_mha(MultiHeadAttention(16, 4, rope=True))
    assert CollaborativeAttention.from_mha(MultiHeadAttention(16, 4)).rope is None


def test_registry_builds_with_options():
    m = build_attention("collaborative", embed_dim=16, num_heads=4, rope={"interleaved": True}, qk_norm=True)
    assert m.rope["interleaved"] is True and m.qk_norm is not None


def test_gpt_generates_the_same_cached():
    torch.manual_seed(0)
    config = GPTConfig.from_preset(
        "tiny", attention="collaborative", attention_options={"rope": True, "qk_norm": True}
    )
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 5))
    assert_cached_generation_agrees(model, idx, 4)
