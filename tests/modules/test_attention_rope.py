"""MultiHeadAttention's ``rope`` and ``qk_norm`` options: against a NumPy
float64 computation, with a KV cache, GQA, left padding, state dicts, and
bitwise unchanged behaviour when both are off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.modules import random_module
from support.paths import assert_cached_generation_agrees

from multihead import MultiHeadAttention
from multihead.functional import attention

F64 = torch.float64
TOL = 1e-10


def _np(t: torch.Tensor) -> np.ndarray:
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


def np_forward(m, x, *, causal=False, keep=None, pos=None, qk_norm=False, rope=None):
    """Self-attention of module ``m`` in NumPy float64: x [B, T, C], keep [B, S] bool."""
    B, T, _ = x.shape
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    W, b = _np(m.qkv_proj.weight), _np(m.qkv_proj.bias)
    qkv = x @ W.T + b
    q = qkv[..., : H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
    k = qkv[..., H * D : (H + G) * D].reshape(B, T, G, D).transpose(0, 2, 1, 3)
    v = qkv[..., (H + G) * D :].reshape(B, T, G, D).transpose(0, 2, 1, 3)
    if qk_norm:
        def rms(t, w):
            return t / np.sqrt((t**2).mean(-1, keepdims=True) + 1e-6) * w

        q, k = rms(q, _np(m.qk_norm.q_norm.weight)), rms(k, _np(m.qk_norm.k_norm.weight))
    if rope is not None:
        pos = np.arange(T) if pos is None else pos
        q, k = np_rope(q, pos, **rope), np_rope(k, pos, **rope)
    k, v = np.repeat(k, H // G, axis=1), np.repeat(v, H // G, axis=1)  # head h reads group h // (H/G)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    visible = np.ones((B, 1, T, T), dtype=bool)
    if causal:
        visible &= np.tril(np.ones((T, T), dtype=bool))
    if keep is not None:
        visible &= keep[:, None, None, :]
    scores = np.where(visible, scores, -np.inf)
    mx = scores.max(-1, keepdims=True)
    e = np.where(visible, np.exp(scores - np.where(np.isfinite(mx), mx, 0)), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return out @ _np(m.out_proj.weight).T + _np(m.out_proj.bias)


def _module(seed=0, **kw):
    m = random_module(seed, **kw)
    if m.qk_norm is not None:
        with torch.no_grad():
            m.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
            m.qk_norm.k_norm.weight.uniform_(0.5, 1.5)
    return m


def _assert_close(actual: torch.Tensor, expected: np.ndarray) -> None:
    actual = _np(actual)
    assert actual.shape == expected.shape and np.isfinite(actual).all()
    err = np.abs(actual - expected).max()
    assert err <= TOL * max(1.0, np.abs(expected).max()), err


CASES = [
    dict(embed_dim=16, num_heads=4, rope=True, qk_norm=False),
    dict(embed_dim=24, num_heads=4, rope=True, qk_norm=True),
    dict(embed_dim=24, num_heads=4, num_kv_heads=2, rope={"interleaved": True, "base": 300.0}, qk_norm=True),
    dict(embed_dim=24, num_heads=4, num_kv_heads=1, rope={"rotary_dim": 4}, qk_norm=False),
    dict(embed_dim=15, num_heads=3, rope={"rotary_dim": 2, "interleaved": True}, qk_norm=True),  # D = 5
    dict(embed_dim=24, num_heads=4, rope=False, qk_norm=True),
]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy(opts, causal):
    m = _module(**opts)
    torch.manual_seed(1)
    x = torch.randn(2, 7, opts["embed_dim"], dtype=F64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    want = np_forward(m, x.numpy(), causal=causal, keep=keep.numpy(), qk_norm=opts["qk_norm"], rope=m.rope)
    _assert_close(m(x, is_causal=causal, key_padding_mask=keep), want)


def test_positions_for_a_left_padded_batch():
    m = _module(embed_dim=24, num_heads=4, num_kv_heads=2, rope=True, qk_norm=True)
    x = torch.randn(2, 6, 24, dtype=F64)
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
    want = np_forward(m, x.numpy(), causal=True, keep=keep.numpy(), pos=pos.numpy(), qk_norm=True, rope={})
    got = m(x, is_causal=True, key_padding_mask=keep, positions=pos)
    _assert_close(got, want)
    # the padded row's real tokens equal the same tokens unpadded
    alone = m(x[1:, 2:], is_causal=True)
    torch.testing.assert_close(got[1:, 2:], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cached_equals_uncached(num_kv_heads):
    m = _module(embed_dim=24, num_heads=4, num_kv_heads=num_kv_heads, rope=True, qk_norm=True)
    x = torch.randn(2, 9, 24, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps.append(m(x[:, 4:6], is_causal=True, kv_cache=cache))
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)


def test_cached_left_padded_decoding_with_positions():
    m = _module(embed_dim=24, num_heads=4, num_kv_heads=2, rope={"interleaved": True}, qk_norm=True)
    x = torch.randn(2, 7, 24, dtype=F64)
    keep = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
    full = m(x, is_causal=True, key_padding_mask=keep, positions=pos)
    cache = m.make_kv_cache(2, 7)
    out = [m(x[:, :5], is_causal=True, key_padding_mask=keep[:, :5], positions=pos[:, :5], kv_cache=cache)]
    for t in (5, 6):
        out.append(
            m(x[:, t : t + 1], is_causal=True, key_padding_mask=keep[:, : t + 1], positions=pos[:, t : t + 1],
              kv_cache=cache)
        )
    got = torch.cat(out, dim=1)
    torch.testing.assert_close(got[keep], full[keep], rtol=0, atol=1e-12)


def test_cross_attention_keys_at_their_own_positions():
    m = _module(embed_dim=24, num_heads=4, rope=True, qk_norm=True)
    q_in, kv_in = torch.randn(1, 3, 24, dtype=F64), torch.randn(1, 5, 24, dtype=F64)
    q, k, v = m.project(q_in, kv_in)
    q, k = m.qk_norm(q, k)
    from multihead.functional.rope import apply_rope

    want = m.merge_heads(attention(apply_rope(q, torch.arange(3)), apply_rope(k, torch.arange(5)), v))
    torch.testing.assert_close(m(q_in, kv_in), want, rtol=0, atol=1e-12)


def test_gradcheck():
    m = _module(embed_dim=8, num_heads=2, num_kv_heads=1, rope={"rotary_dim": 2}, qk_norm=True)
    x = torch.randn(1, 3, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True), (x,))
    m(x).sum().backward()
    assert m.qk_norm.q_norm.weight.grad is not None and m.qk_norm.k_norm.weight.grad is not None


def test_state_dict_keys_and_flat_norm_names():
    m = MultiHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    assert list(m.state_dict()) == [
        "qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias",
        "qk_norm.q_norm.weight", "qk_norm.k_norm.weight",
    ]
    assert list(MultiHeadAttention(24, 4, rope=True).state_dict()) == [
        "qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias",
    ]
    sd = {k.replace("qk_norm.", ""): torch.full_like(v, 2.0) if "norm" in k else v for k, v in m.state_dict().items()}
    other = MultiHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    other.load_state_dict(sd)  # Hugging Face's flat q_norm.weight / k_norm.weight
    assert torch.equal(other.qk_norm.k_norm.weight, torch.full((6,), 2.0))


def test_cost_counts_norm_weights():
    m = MultiHeadAttention(24, 4, num_kv_heads=2, rope=True, qk_norm=True)
    plain = MultiHeadAttention(24, 4, num_kv_heads=2)
    cost, base = m.cost(7, causal=True), plain.cost(7, causal=True)
    assert cost.parameters == sum(p.numel() for p in m.parameters()) == base.parameters + 2 * 6
    assert (cost.core_flops, cost.projection_flops) == (base.core_flops, base.projection_flops)


def test_observer_sees_rotated_queries_and_keys():
    m = _module(embed_dim=24, num_heads=4, rope=True, qk_norm=True)
    events = []
    m.register_attention_observer(lambda mod, ev: events.append(ev))
    x = torch.randn(1, 5, 24, dtype=F64)
    _, w = m(x, return_weights=True)
    ev = events[0]
    scores = (ev.q @ ev.k.transpose(-1, -2)) * ev.scale
    torch.testing.assert_close(torch.softmax(scores, -1), w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_off_is_bitwise_the_plain_path(num_kv_heads):
    """rope=False, qk_norm=False: project -> functional.attention -> merge_heads, bit for bit."""
    m = random_module(3, embed_dim=24, num_heads=4, num_kv_heads=num_kv_heads, rope=False, qk_norm=False)
    assert m.rope is None and m.qk_norm is None
    assert "rope" not in repr(m) and "qk_norm" not in repr(m)
    x = torch.randn(2, 7, 24, dtype=F64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 6] = False
    q, k, v = m.project(x)
    want = m.merge_heads(attention(q, k, v, attn_mask=keep[:, None, None, :], is_causal=True))
    assert torch.equal(m(x, is_causal=True, key_padding_mask=keep), want)
    default = random_module(3, embed_dim=24, num_heads=4, num_kv_heads=num_kv_heads)
    assert torch.equal(default(x, is_causal=True, key_padding_mask=keep), want)
    assert list(default.state_dict()) == list(m.state_dict())


def test_gpt_with_rope_and_qk_norm_generates_the_same_cached():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", attention="gqa",
                                   attention_options={"num_kv_heads": 1, "rope": True, "qk_norm": True})
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 5))
    assert_cached_generation_agrees(model, idx, 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(rope={"theta": 1.0}), ValueError, "theta"),
        (dict(rope={"rotary_dim": 5}), ValueError, "rotary_dim=5"),
        (dict(rope={"rotary_dim": 8}), ValueError, "head_dim=6"),
        (dict(rope="yes"), TypeError, "rope"),
        (dict(qk_norm=1), TypeError, "qk_norm=1"),
    ],
)
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(24, 4, **kwargs)


def test_call_errors():
    x = torch.randn(2, 5, 24)
    with pytest.raises(ValueError, match="only used with rope"):
        MultiHeadAttention(24, 4)(x, positions=torch.arange(5))
    m = MultiHeadAttention(24, 4, rope=True)
    with pytest.raises(ValueError, match=r"\[T\] = \[5\]"):
        m(x, positions=torch.arange(4))
    with pytest.raises(TypeError, match="torch.bool"):
        m(x, positions=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="list"):
        m(x, positions=[0, 1, 2, 3, 4])
