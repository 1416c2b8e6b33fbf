"""CollaborativeAttention: against the NumPy reference, caching, cost,
observers, errors, the exact MHA re-parametrisation and the compression."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.modules import random_module
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead.modules.kinds.collaborative import CollaborativeAttention, concatenate_mixing
from multihead.modules.registry import build_attention
from multihead.reference.collaborative import collaborative_attention

F64 = torch.float64


def make(seed=0, **kw) -> CollaborativeAttention:
    """Float64 module in eval mode with every weight drawn from N(0, 0.5²)."""
    torch.manual_seed(seed)
    kw.setdefault("dtype", F64)
    m = CollaborativeAttention(**kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def reference(m: CollaborativeAttention, query, key=None, value=None, mask=None, **kw):
    """The NumPy specification with the module's weights; torch results."""
    key = query if key is None else key
    value = key if value is None else value
    if value is not key:  # the reference takes one x_to: values enter through W_v only
        raise NotImplementedError
    n = lambda t: None if t is None else t.detach().numpy()  # noqa: E731
    out, P = collaborative_attention(
        n(query),
        n(key),
        n(m.q_proj.weight).T,
        n(m.k_proj.weight).T,
        n(m.mixing),
        n(m.content_bias.weight).T,
        n(m.v_proj.weight).T,
        n(m.v_proj.bias),
        n(m.out_proj.weight).T,
        n(m.out_proj.bias),
        mask=n(mask),
        scale=m.scale,
        return_weights=True,
        **kw,
    )
    return torch.from_numpy(out), torch.from_numpy(P)


def explicit(m: CollaborativeAttention, query, key=None, allowed=None, is_causal=False):
    """The same formula in plain differentiable torch, head by head (gradient oracle)."""
    key = query if key is None else key
    Q, K, cb = m.q_proj(query), m.k_proj(key), m.content_bias(key)
    V = m.v_proj(key)
    B, T, S, H, Dv = query.shape[0], query.shape[1], key.shape[1], m.num_heads, m.head_dim
    outs = []
    for h in range(H):
        s = m.scale * ((Q * m.mixing[h]) @ K.transpose(1, 2) + cb[:, None, :, h])  # (B, T, S)
        ok = torch.ones(B, T, S, dtype=torch.bool)
        if allowed is not None:
            ok = ok & allowed
        if is_causal:
            ok = ok & torch.ones(T, S, dtype=torch.bool).tril()
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
        outs.append(p @ V[..., h * Dv : (h + 1) * Dv])
    return m.out_proj(torch.cat(outs, dim=-1))


CASES = {
    "self": dict(T=7, S=None, causal=False, padding=False),
    "causal": dict(T=7, S=None, causal=True, padding=False),
    "padding": dict(T=7, S=None, causal=False, padding=True),
    "causal+padding": dict(T=7, S=None, causal=True, padding=True),
    "cross": dict(T=6, S=5, causal=False, padding=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_matches_reference(case, backend):
    c = CASES[case]
    kdim = 9 if c["S"] else None
    m = make(embed_dim=15, num_heads=3, shared_dim=7, kdim=kdim, vdim=kdim)  # D̃/H = 7/3
    torch.manual_seed(1)
    x = torch.randn(2, c["T"], 15, dtype=F64)
    kv = None if c["S"] is None else torch.randn(2, c["S"], 9, dtype=F64)
    S = c["T"] if kv is None else c["S"]
    pad = None
    if c["padding"]:
        pad = torch.ones(2, S, dtype=torch.bool)
        pad[1, -2:] = False
    out = m(x, kv, kv, key_mask=pad, is_causal=c["causal"], backend=backend)
    out_w, w = m(x, kv, kv, key_mask=pad, is_causal=c["causal"], return_weights=True)
    mask = None if pad is None else pad[:, None, None, :]
    want, want_w = reference(m, x, kv, mask=mask, is_causal=c["causal"])
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(out_w, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, want_w, atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_reference(causal):
    m = make(embed_dim=10, num_heads=2, shared_dim=5, head_dim=3)
    torch.manual_seed(2)
    x = torch.randn(2, 7, 10, dtype=F64, requires_grad=True)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[0, -3:] = False
    g = torch.randn(2, 7, 10, dtype=F64)
    params = [x, *m.parameters()]

    # exact gradients against the plain-torch formula
    got = torch.autograd.grad((m(x, key_mask=pad, is_causal=causal) * g).sum(), params)
    want = torch.autograd.grad((explicit(m, x, allowed=pad[:, None, :], is_causal=causal) * g).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)

    # one directional derivative of the NumPy reference by central differences
    rng = np.random.default_rng(3)
    dirs = [torch.from_numpy(rng.standard_normal(p.shape)) for p in params]
    analytic = sum(float((a * d).sum()) for a, d in zip(got, dirs, strict=True))
    eps, vals = 1e-5, []
    for sign in (1, -1):
        with torch.no_grad():
            mm = make(embed_dim=10, num_heads=2, shared_dim=5, head_dim=3)
            mm.load_state_dict(m.state_dict())
            for p, d in zip(mm.parameters(), dirs[1:], strict=True):
                p.add_(sign * eps * d)
            out, _ = reference(mm, x.detach() + sign * eps * dirs[0], mask=pad[:, None, None, :], is_causal=causal)
        vals.append(float((out * g).sum()))
    assert abs((vals[0] - vals[1]) / (2 * eps) - analytic) < 1e-6 * max(1.0, abs(analytic))


def test_gradcheck_tiny():
    m = make(embed_dim=4, num_heads=2, shared_dim=3, head_dim=2)
    x = torch.randn(1, 3, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True, backend="math"), (x,))
    assert torch.autograd.gradcheck(lambda t: m(t.transpose(0, 1).transpose(0, 1)), (x,))


def test_masked_keys_do_not_leak_and_empty_rows_are_zero():
    m = make(embed_dim=8, num_heads=2, shared_dim=6)
    x = torch.randn(2, 5, 8, dtype=F64)
    kv = torch.randn(2, 4, 8, dtype=F64)
    pad = torch.tensor([[True, True, False, False], [False, False, False, False]])
    poisoned = kv.clone()
    poisoned[0, 2:] = float("nan")
    for backend in ("math", "sdpa"):
        a = m(x, kv, key_mask=pad, backend=backend)
        b = m(x, poisoned, key_mask=pad, backend=backend)
        torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=0)
        assert torch.equal(b[1], m.out_proj.bias.expand(5, 8))  # nothing visible: zero heads


@pytest.mark.parametrize("prefill", [1, 3])
def test_cached_decoding_equals_full_recomputation(prefill):
    m = make(embed_dim=12, num_heads=3, shared_dim=5)
    x = torch.randn(2, 7, 12, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 7)
    assert cache.k.shape == (2, 1, 7, 5 + 3) and cache.v.shape == (2, 3, 7, 4)  # one key head, H value heads
    steps = [m(x[:, :prefill], is_causal=True, kv_cache=cache)]
    for t in range(prefill, 7):
        steps.append(m(x[:, t : t + 1], is_causal=True, kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="overflow"):
        m(x[:, :1], is_causal=True, kv_cache=cache)
    assert cache.length == 7


def _matmul_flops(module, *args, **kwargs) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(*args, backend="math", **kwargs)
    return counter.get_total_flops()


def test_cost_matches_the_module():
    m = CollaborativeAttention(12, 3, shared_dim=7, head_dim=5, kdim=9, vdim=11, out_dim=10)
    cost = m.cost(6, 4, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters())
    assert cost.parameters == 7 * 12 + 7 * 9 + 3 * 9 + 3 * 7 + (15 * 11 + 15) + (10 * 15 + 10)
    assert cost.kv_cache_bytes_per_token == (7 + 3 + 15) * 2
    x, kv, v = torch.randn(2, 6, 12), torch.randn(2, 4, 9), torch.randn(2, 4, 11)
    mixing_multiplies = 2 * 3 * 6 * 7  # B·H·T·D̃, elementwise: not seen by the matmul counter
    assert cost.total_flops == _matmul_flops(m, x, kv, v) + mixing_multiplies
    full, causal = m.cost(8), m.cost(8, causal=True)
    assert (full.core_flops - 3 * 8 * 7) * 36 == (causal.core_flops - 3 * 8 * 7) * 64


def test_observer_receives_the_weights_that_mix_the_values():
    m = make(embed_dim=8, num_heads=2, shared_dim=3)
    x = torch.randn(2, 5, 8, dtype=F64)
    events = []
    handle = m.register_attention_observer(lambda mod, e: events.append(e))
    out = m(x, is_causal=True)
    handle.remove()
    (e,) = events
    _, want = reference(m, x, is_causal=True)
    torch.testing.assert_close(e.weights, want, atol=1e-10, rtol=0)
    assert e.kind == "collaborative" and e.q.shape == (2, 2, 5, 5) and e.k.shape == (2, 1, 5, 5)
    scores = e.scale * e.q @ e.k.transpose(-1, -2)  # (B, H, T, S): the unmasked scores
    torch.testing.assert_close(out, m(x, is_causal=True), atol=1e-12, rtol=0)  # math vs sdpa path
    # the scores in the event reproduce the reference weights
    hidden = torch.ones(5, 5, dtype=torch.bool).tril()
    p = scores.masked_fill(~hidden, float("-inf")).softmax(-1)
    torch.testing.assert_close(p, want, atol=1e-10, rtol=0)


def test_construction_and_call_errors():
    with pytest.raises(ValueError, match="embed_dim=10 is not divisible by num_heads=3"):
        CollaborativeAttention(10, 3)
    with pytest.raises(ValueError, match="shared_dim"):
        CollaborativeAttention(8, 2, shared_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        CollaborativeAttention(8, 2, dropout=1.0)
    with pytest.raises(ValueError, match="scale"):
        CollaborativeAttention(8, 2, scale=float("nan"))
    with pytest.raises(ValueError, match="mixing_init"):
        CollaborativeAttention(8, 2, mixing_init="all_ones")
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        build_attention("collaborative", embed_dim=8, num_heads=2, num_kv_heads=1)
    m = CollaborativeAttention(8, 2, shared_dim=4)
    with pytest.raises(ValueError, match=r"\(B, T, 8\)"):
        m(torch.randn(2, 3, 7))
    cache = m.make_kv_cache(1, 4)
    m(torch.randn(1, 2, 8), kv_cache=cache)
    with pytest.raises(ValueError, match="self-attention"):  # a self-attention cache refuses cross keys
        m(torch.randn(1, 2, 8), torch.randn(1, 2, 8), kv_cache=cache)
    with pytest.raises(ValueError, match="rank"):
        m.compress(5)
    wide = CollaborativeAttention(2, 1, shared_dim=4)  # A_0 is 2 x 2: two singular values for four channels
    with pytest.raises(ValueError, match=r"at most H·min\(C, kdim\) = 2, got rank=3"):
        wide.compress(3)
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        CollaborativeAttention.from_mha(m)


def test_concatenate_mixing_is_block_one_hot_with_ceil_width():
    m = concatenate_mixing(3, 7)  # width ceil(7/3) = 3: the last head gets 1 channel
    assert m.tolist() == [[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1]]


# ---------------------------------------------------------------- from_mha / compress
@pytest.mark.parametrize(
    "options",
    [dict(), dict(num_kv_heads=1), dict(qkv_bias=False, out_bias=False), dict(kdim=7, vdim=9)],
    ids=["mha", "mqa", "no-bias", "kdim-vdim"],
)
def test_from_mha_is_exact(options):
    mha = random_module(0, embed_dim=12, num_heads=3, **options)
    c = CollaborativeAttention.from_mha(mha)
    assert c.shared_dim == 12 and c.scale == 4**-0.5
    x = torch.randn(2, 6, 12, dtype=F64)
    kv = torch.randn(2, 5, options.get("kdim", 12), dtype=F64)
    v = torch.randn(2, 5, options.get("vdim", 12), dtype=F64)
    pad = torch.tensor([[True] * 5, [True, False, True, True, False]])
    bias = torch.randn(6, 5, dtype=F64)
    if "kdim" not in options:
        for kw in (dict(), dict(is_causal=True), dict(is_causal=True, key_mask=pad[:, :5])):
            torch.testing.assert_close(c(x[:, :5], **kw), mha(x[:, :5], **kw), atol=1e-10, rtol=0)
        kv_in = (kv, None)
    else:
        kv_in = (kv, v)
    for kw in (dict(), dict(key_mask=pad, attn_mask=bias)):
        torch.testing.assert_close(c(x, *kv_in, **kw), mha(x, *kv_in, **kw), atol=1e-10, rtol=0)


def test_compression_full_rank_is_exact_and_error_shrinks_with_rank():
    mha = random_module(1, embed_dim=12, num_heads=3)
    c = CollaborativeAttention.from_mha(mha)
    x = torch.randn(2, 6, 12, dtype=F64)
    results = [c.compress(r, query=x, is_causal=True) for r in range(1, 13)]
    errors = [r.product_error for r in results]
    assert all(a >= b for a, b in zip(errors, errors[1:]))
    assert errors[0] > 0.1 and errors[-1] < 1e-12
    full = results[-1]
    assert full.output_error < 1e-12
    torch.testing.assert_close(full.module(x, is_causal=True), mha(x, is_causal=True), atol=1e-10, rtol=0)
    small = CollaborativeAttention.from_mha(mha, shared_dim=4)
    assert small.shared_dim == 4 and small.q_proj.weight.shape == (4, 12)
    torch.testing.assert_close(small.head_products(), results[3].module.head_products(), atol=1e-12, rtol=0)


def test_gpt_generates_the_same_tokens_with_and_without_cache():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("tiny", attention="collaborative", attention_options={"shared_dim": 24})
    model = GPT(cfg).eval()
    idx = torch.randint(0, 256, (2, 5))
    a = assert_cached_generation_agrees(model, idx, 6)
    assert a.shape == (2, 11)


# ---------------------------------------------------------------- rope / qk_norm (beyond tests/modules/test_contract.py)
def test_rope_rotates_the_shared_channels_only_and_the_cache_keeps_the_bias_channels():
    """qk_norm and rope act on the D̃ shared channels (gains [D̃]); the H
    content-bias channels of the cached key head are the raw content bias."""
    m = make(embed_dim=16, num_heads=4, shared_dim=12, rope=True, qk_norm=True)
    assert m.qk_norm.q_norm.weight.shape == (12,)
    x = torch.randn(2, 6, 16, dtype=F64)
    cache = m.make_kv_cache(2, 6)
    m(x[:, :4], is_causal=True, kv_cache=cache)
    m(x[:, 4:], is_causal=True, kv_cache=cache)
    _, k, _ = m.project(x)  # [rope(norm(K)) | cb] at positions 0 .. 5
    assert_paths_agree(cache.k, k)  # written in two calls vs one
    assert_paths_agree(cache.k[..., 12:], m.content_bias(x).unsqueeze(1))
    assert not torch.allclose(cache.k[..., :12], m.qk_norm.k_norm(m.k_proj(x)).unsqueeze(1))  # rotated


def test_rope_option_errors_and_conversions_without_them():
    with pytest.raises(ValueError, match="shared_dim=7"):
        CollaborativeAttention(16, 4, shared_dim=7, rope=True)
    CollaborativeAttention(16, 4, shared_dim=7, rope={"rotary_dim": 6})  # an even rotary_dim is fine
    with pytest.raises(ValueError, match="rotary_dim"):
        CollaborativeAttention(16, 4, shared_dim=8, rope={"rotary_dim": 10})
    with pytest.raises(ValueError, match="rope and qk_norm"):
        CollaborativeAttention(16, 4, rope=True).compress(4)
    from multihead import MultiHeadAttention

    with pytest.raises(ValueError, match="rope and qk_norm"):
        CollaborativeAttention.from_mha(MultiHeadAttention(16, 4, rope=True))
    assert CollaborativeAttention.from_mha(MultiHeadAttention(16, 4)).rope is None


def test_compression_keeps_the_largest_singular_values_of_all_heads():
    """catches: keeping other channels than the largest σ (the error must be Eckart–Young's), a rank
    bound off by one, and relative_error's edge cases."""
    from multihead.modules.kinds.collaborative_compress import relative_error, top_singular_channels

    c = CollaborativeAttention.from_mha(random_module(2, embed_dim=12, num_heads=3))
    A = c.head_products()  # [H, C, kdim]
    sig = torch.linalg.svdvals(A).reshape(-1).sort(descending=True).values  # every head's σ, largest first
    for rank in (1, 4, 9):
        dropped = (sig[rank:].pow(2).sum().sqrt() / A.norm()).detach()
        assert abs(c.compress(rank).product_error - float(dropped)) < 1e-10, rank
    H, n = A.shape[0], min(A.shape[1], A.shape[2])
    assert top_singular_channels(A, H * n)[0].shape == (H * n, A.shape[1])  # every singular value kept
    with pytest.raises(ValueError, match=rf"rank must be at most H·min\(C, kdim\) = {H * n}, got rank={H * n + 1}"):
        top_singular_channels(A, H * n + 1)
    zero, x = torch.zeros(2, 3, dtype=F64), torch.randn(2, 3, dtype=F64)
    assert relative_error(zero, zero) == 0.0 and relative_error(zero, x) == float("inf")
    assert relative_error(x, 2 * x) == pytest.approx(1.0, rel=1e-12) and relative_error(x, x) == 0.0
    small = x / (10 * x.norm())  # a norm below 1 is still a norm
    assert relative_error(small, 3 * small) == pytest.approx(2.0, rel=1e-12)


def test_a_cache_takes_the_layers_dtype_and_device_unless_told():
    """catches: a default cache in float32 for a float64 layer."""
    c = CollaborativeAttention(16, 4).double()
    assert c.make_kv_cache(2, 5).k.dtype == F64
    assert c.make_kv_cache(2, 5, dtype=torch.float32).k.dtype == torch.float32
    assert CollaborativeAttention(16, 4, device="meta").make_kv_cache(2, 5).k.device.type == "meta"
