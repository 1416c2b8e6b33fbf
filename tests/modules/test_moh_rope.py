"""MoHAttention with rope / qk_norm: independent float64 reference, sparse == dense, cache, defaults, GPT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees

from multihead.functional import apply_rope
from multihead.modules.moh import MoHAttention
from multihead.reference.attention import attention as ref_attention
from multihead.reference.moh import moh_learned_gates, moh_query_norm_gates

F64 = torch.float64


def make(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("embed_dim", 20)
    kw.setdefault("num_heads", 4)
    m = MoHAttention(kw.pop("embed_dim"), kw.pop("num_heads"), dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        if m.qk_norm is not None:  # gains near 1, but not 1, so a skipped gain is seen
            m.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
            m.qk_norm.k_norm.weight.uniform_(0.5, 1.5)
    return m.eval()


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, float(b.detach().abs().max())))


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def np_(t):
    return None if t is None else t.detach().numpy()


def independent(m, x, *, positions=None, mask=None, is_causal=False, rope_opts=None, use_norm=True, rotate=True):
    """y from the module's weights, computed without its forward: project, route on the raw q,
    RMS-norm, rotate, NumPy reference attention, gate, out_proj."""
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    B, T, _ = x.shape
    W, b = m.qkv_proj.weight.detach(), m.qkv_proj.bias
    qkv = x @ W.T + (0 if b is None else b.detach())
    q = qkv[..., : H * D].reshape(B, T, H, D).transpose(1, 2)
    k = qkv[..., H * D : (H + G) * D].reshape(B, T, G, D).transpose(1, 2)
    v = qkv[..., (H + G) * D :].reshape(B, T, G, D).transpose(1, 2)
    if m.router == "query_norm":
        gates, _ = moh_query_norm_gates(q.numpy(), m.shared_heads, m.routed_heads)  # before norm / rope
    else:
        gates, _, _ = moh_learned_gates(
            x.numpy(), np_(m.routed_gate and m.routed_gate.weight), np_(m.mix_gate and m.mix_gate.weight),
            np_(m.shared_gate and m.shared_gate.weight), m.shared_heads, m.routed_heads,
        )
    if use_norm:
        eps = m.qk_norm.q_norm.eps
        q = rms(q, m.qk_norm.q_norm.weight.detach(), eps)
        k = rms(k, m.qk_norm.k_norm.weight.detach(), eps)
    if rotate:
        q = apply_rope(q, positions, **(rope_opts or {}))
        k = apply_rope(k, positions, **(rope_opts or {}))
    o = ref_attention(q.numpy(), k.numpy(), v.numpy(), mask=None if mask is None else mask.numpy(), is_causal=is_causal)
    mixed = torch.from_numpy(np.ascontiguousarray(o)) * torch.from_numpy(gates).transpose(1, 2).unsqueeze(-1)
    mixed = mixed.transpose(1, 2).reshape(B, T, H * D)
    return mixed @ m.out_proj.weight.detach().T + m.out_proj.bias.detach()


SETTINGS = [
    dict(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2, head_dim=6),  # E = 5
    dict(embed_dim=30, num_heads=6, shared_heads=3, routed_heads=1, num_kv_heads=2, head_dim=4),  # cut group
    dict(embed_dim=20, num_heads=4, shared_heads=0, routed_heads=2, head_dim=6),
    dict(embed_dim=24, num_heads=6, shared_heads=2, routed_heads=2, router="query_norm", head_dim=4),
]


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_independent_computation(kw, path, causal):
    m = make(rope=True, qk_norm=True, path=path, **kw)
    torch.manual_seed(1)
    x = torch.randn(2, 7, m.embed_dim, dtype=F64)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[0, :2] = False
    mask = pad[:, None, None, :]
    pos = (torch.cumsum(pad.long(), 1) - 1).clamp(min=0)  # left-padded positions, [B, T]
    want = independent(m, x, positions=pos, mask=mask, is_causal=causal)
    got = m(x, key_padding_mask=pad, is_causal=causal, positions=pos)
    close(got, want)
    # honest: skipping rope or the norm would be detected
    assert (got - independent(m, x, positions=pos, mask=mask, is_causal=causal, rotate=False)).abs().max() > 1e-4
    assert (got - independent(m, x, positions=pos, mask=mask, is_causal=causal, use_norm=False)).abs().max() > 1e-4
    # default positions 0..T-1 and dict rope options
    m2 = make(rope={"base": 100.0, "interleaved": True, "rotary_dim": 2}, qk_norm=True, path=path, **kw)
    close(m2(x, is_causal=causal), independent(m2, x, is_causal=causal,
                                               rope_opts={"base": 100.0, "interleaved": True, "rotary_dim": 2}))


def test_query_norm_router_reads_q_before_qk_norm():
    # with qk_norm and unit gains the normalised head norms are all sqrt(D): routing after the norm
    # would be a tie; routing on the raw q must still pick the heads with the largest raw norms
    m = make(embed_dim=24, num_heads=6, shared_heads=2, routed_heads=2, router="query_norm", head_dim=4,
             rope=True, qk_norm=True)
    x = torch.randn(2, 5, 24, dtype=F64)
    q, _, _ = m.project(x)
    _, chosen, _ = m.route(x, q)
    _, ref_sel = moh_query_norm_gates(q.detach().numpy(), 2, 2)
    assert torch.equal(chosen, torch.from_numpy(ref_sel))
    close(m(x), independent(m, x))


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_sparse_equals_dense_with_rope(kw, causal):
    m = make(rope=True, qk_norm=True, **kw)
    x = torch.randn(3, 8, m.embed_dim, dtype=F64, requires_grad=True)
    pos = torch.randint(0, 50, (3, 8))
    a = m(x, is_causal=causal, positions=pos, path="sparse")
    b = m(x, is_causal=causal, positions=pos, path="dense")
    close(a, b)
    ga, = torch.autograd.grad(a.sum(), x)
    gb, = torch.autograd.grad(b.sum(), x)
    close(ga, gb)


@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("router", ["learned", "query_norm"])
def test_cached_decoding_equals_full_recomputation(path, router):
    m = make(embed_dim=30, num_heads=6, shared_heads=2, routed_heads=2, num_kv_heads=3, head_dim=4, path=path,
             router=router, rope=True, qk_norm=True)
    x = torch.randn(2, 9, 30, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    close(torch.cat(steps, dim=1), full)
    # explicit [B, T] positions through the cache match the full call with the same positions
    pos = torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    full = m(x, is_causal=True, positions=pos)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache, positions=pos[:, :4])]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, positions=pos[:, t : t + 1]) for t in range(4, 9)]
    close(torch.cat(steps, dim=1), full)


def test_cross_attention_keys_at_zero():
    m = make(embed_dim=20, num_heads=4, shared_heads=1, routed_heads=2, head_dim=4, rope=True)
    x, kv = torch.randn(2, 3, 20, dtype=F64), torch.randn(2, 6, 20, dtype=F64)
    pos = torch.tensor([5, 6, 7])
    close(m(x, kv, positions=pos, path="sparse"), m(x, kv, positions=pos, path="dense"))
    q, k, v = m.project(x, kv)
    gates, _, _ = m.route(x, q)
    q, k = apply_rope(q, pos), apply_rope(k)
    mixed, _ = m.mix_heads(q, k, v, gates, None, path="dense")
    close(m(x, kv, positions=pos), m.out_proj(mixed.reshape(2, 3, -1)))


@pytest.mark.parametrize("kw", SETTINGS)
def test_defaults_off_are_bitwise_unchanged(kw):
    base = make(**kw)
    off = MoHAttention(base.embed_dim, base.num_heads, dtype=F64, rope=False, qk_norm=False,
                       **{k: v for k, v in kw.items() if k not in ("embed_dim", "num_heads")})
    off.load_state_dict(base.state_dict())
    assert list(off.state_dict()) == list(base.state_dict())
    assert off.rope is None and off.qk_norm is None
    x = torch.randn(2, 6, base.embed_dim, dtype=F64)
    for path in ("sparse", "dense"):  # options off: the same operations as the default, bitwise
        for causal in (False, True):
            assert torch.equal(off(x, is_causal=causal, path=path), base(x, is_causal=causal, path=path))
    with pytest.raises(ValueError, match="rope"):
        off(x, positions=torch.arange(6))


def test_parameters_state_dict_and_cost():
    m = make(embed_dim=20, num_heads=4, head_dim=6, rope=True, qk_norm=True)
    base = make(embed_dim=20, num_heads=4, head_dim=6)
    keys = list(m.state_dict())
    assert keys[: len(base.state_dict())] == list(base.state_dict())  # projections first
    assert keys[-2:] == ["qk_norm.q_norm.weight", "qk_norm.k_norm.weight"]
    c = m.cost(5)
    assert c.parameters == sum(p.numel() for p in m.parameters()) == base.cost(5).parameters + 2 * 6
    assert "(rope): Rotary(" in repr(m)
    with pytest.raises(TypeError, match="qk_norm"):
        MoHAttention(20, 4, qk_norm=1)
    with pytest.raises((TypeError, ValueError)):
        MoHAttention(20, 4, rope={"rotary_dim": 3})


def test_observer_gets_rotated_q_and_k():
    m = make(embed_dim=20, num_heads=4, shared_heads=2, routed_heads=1, head_dim=4, rope=True, qk_norm=True)
    events = []
    handle = m.register_attention_observer(lambda mod, e: events.append(e))
    x = torch.randn(1, 5, 20, dtype=F64)
    m(x)
    handle.remove()
    q, k, _ = m.project(x)
    q, k = m.position_qk(q, k, None, None)
    close(events[0].q, q.detach())
    close(events[0].k, k.detach())


@pytest.mark.parametrize("options", [{"rope": True, "qk_norm": True},
                                     {"rope": True, "qk_norm": True, "router": "query_norm"}])
def test_gpt_generates_the_same_with_and_without_cache(options):
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="moh", attention_options=options)).eval()
    idx = torch.randint(0, 256, (2, 5))
    assert_cached_generation_agrees(model, idx, 4)
