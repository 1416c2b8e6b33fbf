"""OverlappingHeadAttention (MOHSA) against the NumPy reference, MHA, the cache and its cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attention import assert_matches, grads, np64
from support.modules import random_module
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead.modules.kinds.overlapping import OverlappingHeadAttention, overlapped_heads
from multihead.modules.registry import build_attention
from multihead.reference.overlapping import overlapping_attention

F64 = torch.float64
C, H, D = 15, 3, 5  # odd sizes


def make(overlap, seed=0, **kw):
    torch.manual_seed(seed)
    m = OverlappingHeadAttention(kw.pop("embed_dim", C), kw.pop("num_heads", H), overlap=overlap, dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def x_(B=2, T=7, seed=1, width=C):
    return torch.randn(B, T, width, dtype=F64, generator=torch.Generator().manual_seed(seed))


def reference(m, x, ctx=None, **kw):
    ctx = x if ctx is None else ctx
    HD = m.num_heads * m.head_dim
    W, b = np64(m.qkv_proj.weight), np64(m.qkv_proj.bias)
    y, A = overlapping_attention(
        np64(x), np64(ctx), W[:HD], W[HD : 2 * HD], W[2 * HD :], np64(m.out_proj.weight), m.num_heads, m.overlap,
        b[:HD], b[HD : 2 * HD], b[2 * HD :], np64(m.out_proj.bias), return_weights=True, **kw,
    )  # fmt: skip
    return torch.from_numpy(y), torch.from_numpy(A)


def loop_forward(m, x, ctx=None, *, is_causal=False, keep=None):
    """The reference's formula in torch with a Python loop over heads and channels (for exact gradients)."""
    ctx = x if ctx is None else ctx
    Hh, Dd, ov = m.num_heads, m.head_dim, m.overlap
    HD = Hh * Dd
    W, b = m.qkv_proj.weight, m.qkv_proj.bias
    q, k, v = (inp @ W[i * HD : (i + 1) * HD].T + b[i * HD : (i + 1) * HD] for i, inp in enumerate((x, ctx, ctx)))
    T, S = x.shape[1], ctx.shape[1]
    allowed = torch.ones(x.shape[0], 1, T, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    outs = []
    for i in range(Hh):
        cols = range(i * Dd - ov, (i + 1) * Dd + ov)

        def take(t, cols=cols):
            zero = torch.zeros_like(t[..., 0])
            return torch.stack([t[..., c] if 0 <= c < HD else zero for c in cols], dim=-1)

        s = take(q) @ take(k).transpose(-1, -2) * Dd**-0.5
        p = torch.softmax(s.masked_fill(~allowed[:, 0], float("-inf")), dim=-1)
        outs.append(p @ take(v))
    return m.out_proj(torch.cat(outs, dim=-1))


# ---------------------------------------------------------------- reference
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("overlap", [0, 1, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_outputs_and_weights(backend, overlap, causal):
    m, x = make(overlap), x_()
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, :2] = False  # left padding in the second sequence
    want_y, want_A = reference(m, x, mask=np64(keep[:, None, None, :]), is_causal=causal)
    y = m(x, key_mask=keep, is_causal=causal, backend=backend)
    assert_matches(y, want_y)
    _, A = m(x, key_mask=keep, is_causal=causal, return_weights=True)
    assert_matches(A, want_A)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("overlap", [0, 2, 6])
def test_gradients_match_the_loop_form(backend, overlap):
    m = make(overlap)
    x = x_().requires_grad_()
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, -2:] = False
    params = list(m.parameters())
    got = grads(m(x, key_mask=keep, is_causal=True, backend=backend), x, *params)
    want = grads(loop_forward(m, x, is_causal=True, keep=keep), x, *params)
    assert_matches(m(x, key_mask=keep, is_causal=True), loop_forward(m, x, is_causal=True, keep=keep).detach())
    for g, w in zip(got, want):
        assert_matches(g, w)


def test_input_gradient_matches_finite_differences_of_the_numpy_reference():
    m, x = make(2), x_(B=1, T=4)
    dx = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    g = torch.randn(1, 4, C, dtype=F64, generator=torch.Generator().manual_seed(6))
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad((m(xr, is_causal=True) * g).sum(), xr)
    h = 1e-5
    fd = ((reference(m, x + h * dx, is_causal=True)[0] - reference(m, x - h * dx, is_causal=True)[0]) * g).sum() / (2 * h)
    assert abs(float((gx * dx).sum()) - float(fd)) < 1e-7 * max(1.0, abs(float(fd)))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_cross_attention_matches_reference(backend):
    m, x = make(2), x_(T=5)
    key, value = x_(T=4, seed=2), x_(T=4, seed=3)
    y = m(x, key, key, backend=backend)
    assert_matches(y, reference(m, x, key)[0])
    # distinct key and value tensors: compare with the loop form fed the same projections
    HD = H * D
    want = m.out_proj(
        torch.cat(
            [
                torch.softmax(qh @ kh.transpose(-1, -2) * D**-0.5, -1) @ vh
                for qh, kh, vh in zip(
                    *(m.heads(torch.nn.functional.pad(t, (2, 2))).unbind(1) for t in (
                        x @ m.qkv_proj.weight[:HD].T + m.qkv_proj.bias[:HD],
                        key @ m.qkv_proj.weight[HD : 2 * HD].T + m.qkv_proj.bias[HD : 2 * HD],
                        value @ m.qkv_proj.weight[2 * HD :].T + m.qkv_proj.bias[2 * HD :],
                    ))
                )
            ],
            dim=-1,
        )
    )  # fmt: skip
    assert_matches(m(x, key, value, backend=backend), want.detach())


def test_gradcheck_tiny():
    m = make(1, embed_dim=4, num_heads=2)
    x = torch.randn(1, 3, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: m(a, is_causal=True, backend="math"), (x,))
    assert torch.autograd.gradcheck(lambda a: m(a, backend="sdpa"), (x.detach().clone().requires_grad_(),))


# ---------------------------------------------------------------- plain MHA at overlap 0
def test_zero_overlap_equals_multi_head_attention_with_the_same_weights():
    mha = random_module(0, embed_dim=C, num_heads=H)
    m = OverlappingHeadAttention(C, H, overlap=0, dtype=F64).eval()
    m.load_state_dict(mha.state_dict())
    x, keep = x_(), torch.ones(2, 7, dtype=torch.bool)
    keep[0, :3] = False
    for kw in ({}, {"is_causal": True, "key_mask": keep}):
        for backend in ("math", "sdpa"):
            assert_paths_agree(m(x, backend=backend, **kw), mha(x, backend=backend, **kw))
        assert_paths_agree(m(x, return_weights=True, **kw)[1], mha(x, return_weights=True, **kw)[1])
    ctx = x_(T=4, seed=9)
    assert_paths_agree(m(x, ctx), mha(x, ctx))


def test_heads_are_a_strided_view_without_copies():
    padded = torch.randn(2, 7, H * D + 4)
    heads = overlapped_heads(padded, H, D, 2)
    assert heads.shape == (2, H, 7, D + 4)
    assert heads.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
    assert torch.equal(heads[:, 1, :, :], padded[..., D : 2 * D + 4])
    for width in (H * D + 3, H * D + 4 + D):  # one channel short; one head's width too many
        with pytest.raises(ValueError, match=rf"padded has {width} channels; .* need H·D \+ 2·ov = {H * D + 4}"):
            overlapped_heads(torch.randn(2, 7, width), H, D, 2)


# ---------------------------------------------------------------- cache
@pytest.mark.parametrize("overlap", [0, 2])
def test_cached_decoding_equals_full_recomputation(overlap):
    m, x = make(overlap), x_()
    full = m(x, is_causal=True).detach()
    cache = m.make_kv_cache(2, 9)
    assert tuple(cache.k.shape) == (2, 1, 9, H * D + 2 * overlap)
    steps = [m(x[:, :3], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, backend="sdpa") for t in range(3, 7)]
    assert_matches(torch.cat(steps, dim=1), full)


def test_refused_cache_write_leaves_the_cache_unchanged():
    m, x = make(1), x_(T=3)
    cache = m.make_kv_cache(2, 4)
    m(x, kv_cache=cache, is_causal=True)
    with pytest.raises(ValueError, match="overflow"):
        m(x[:, :2], kv_cache=cache, is_causal=True)
    assert cache.length == 3
    with pytest.raises(ValueError, match="self-attention"):
        m(x, x, kv_cache=cache)


# ---------------------------------------------------------------- masks
def test_masked_values_do_not_leak_and_empty_rows_are_zero():
    m, x = make(2), x_(T=4)
    ctx = x_(T=4, seed=3)
    keep = torch.tensor([[True, True, False, False], [False, False, False, False]])
    y = m(x, ctx, key_mask=keep).detach()
    poisoned = ctx.clone()
    poisoned[0, 2:] = float("nan")
    poisoned[1] = float("inf")
    for backend in ("math", "sdpa"):
        out = m(x, poisoned, key_mask=keep, backend=backend)
        assert_matches(out, y)
        torch.testing.assert_close(out[1], m.out_proj.bias.expand(4, C))  # nothing visible: zero heads


# ---------------------------------------------------------------- cost
def _matmul_flops(module, x, **kw):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(x, backend="math", **kw)
    return counter.get_total_flops()


@pytest.mark.parametrize("overlap", [0, 3])
def test_cost_matches_counts(overlap):
    m = OverlappingHeadAttention(12, 4, overlap=overlap)
    Dw = 3 + 2 * overlap
    cost = m.cost(9, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters()) == 12 * 36 + 36 + 12 * 4 * Dw + 12
    assert cost.total_flops == _matmul_flops(m, torch.randn(2, 9, 12))
    assert cost.core_flops == 2 * 2 * 4 * 81 * 2 * Dw
    cache = m.make_kv_cache(1, 5, dtype=torch.float16)
    assert cost.kv_cache_bytes_per_token == (cache.k.numel() + cache.v.numel()) * 2 // 5
    causal = m.cost(8, causal=True)
    assert causal.core_flops * 64 == m.cost(8).core_flops * 36
    assert m.cost(2, 6).projection_flops == 2 * (2 * 12 * 12 + 2 * 6 * 12 * 12 + 2 * 4 * Dw * 12)


# ---------------------------------------------------------------- observers
def test_observer_receives_the_widened_heads_weights():
    m, x = make(2), x_()
    events = []
    handle = m.register_attention_observer(lambda mod, e: events.append(e))
    out = m(x, is_causal=True)
    handle.remove()
    _, A = m(x, is_causal=True, return_weights=True)
    (e,) = events
    # observed calls keep the fused kernel (weights from its log-sum-exp): another path than math
    assert_paths_agree(out, m(x, is_causal=True, backend="math"))
    assert_matches(e.weights, reference(m, x, is_causal=True)[1])
    assert_paths_agree(e.weights, A.detach())
    assert e.kind == "overlapping" and e.scale == D**-0.5
    assert e.q.shape == (2, H, 7, D + 4) and e.k.shape == (2, H, 7, D + 4)
    assert torch.equal(e.q[:, 0, :, :2], torch.zeros(2, 7, 2, dtype=F64))  # head 0's outer padding


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"overlap": -1}, ValueError, "overlap=-1"),
        ({"overlap": 1.5}, TypeError, "overlap"),
        ({"overlap": True}, TypeError, "overlap"),
        ({"num_kv_heads": 1}, ValueError, "num_kv_heads=1"),
        ({"embed_dim": 10}, ValueError, "embed_dim=10"),
        ({"num_heads": 0}, ValueError, "num_heads"),
        ({"dropout": 1.0}, ValueError, "dropout"),
    ],
)
def test_construction_errors(kw, exc, match):
    args = {"embed_dim": 12, "num_heads": 4, **kw}
    with pytest.raises(exc, match=match):
        OverlappingHeadAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_call_errors():
    m = make(1)
    with pytest.raises(ValueError, match=r"\(B, T, 15\)"):
        m(torch.randn(2, 7, 14, dtype=F64))
    with pytest.raises(ValueError, match="lengths differ"):
        m(x_(), x_(T=4), x_(T=5))
    with pytest.raises(ValueError, match="key_mask"):
        m(x_(), key_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating"):
        m(x_(), key_mask=torch.ones(2, 7, dtype=torch.long))


# ---------------------------------------------------------------- registry and models
def test_registry_and_gpt_generation_cached_equals_uncached():
    from multihead.models.gpt import GPT, GPTConfig

    m = build_attention("overlapping", embed_dim=12, num_heads=4, overlap=2)
    assert isinstance(m, OverlappingHeadAttention) and m.kind == "overlapping" and m.overlap == 2
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_preset("tiny", attention="overlapping", attention_options={"overlap": 3})).eval()
    assert gpt.blocks[0].attn.out_proj.in_features == 4 * (16 + 6)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert_cached_generation_agrees(gpt, idx, 6)


def test_seeded_numbers_are_bitwise_reproducible():
    m, x = make(2), x_()
    assert np.array_equal(np64(m(x)), np64(m(x)))


def test_fused_flash_kernel_runs_on_the_overlapping_views():
    """Forced to the flash kernel (CPU here; heads Dw = D + 2·ov wide, strided views), the result is unchanged."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = OverlappingHeadAttention(16, 4, overlap=3)
    x = torch.randn(2, 9, 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        y = m(x, is_causal=True, backend="sdpa")
    torch.testing.assert_close(y, m(x, is_causal=True, backend="math"))


# ---------------------------------------------------------------- rope / qk_norm (beyond tests/modules/test_contract.py)
def _close_to_numpy(got, m, x, **kw):
    from support.kinds import numpy_forward

    assert_matches(got, torch.from_numpy(numpy_forward(m, x, **kw)[0]))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_rope_and_qk_norm_act_on_the_widened_heads(backend):
    m = make(3, embed_dim=12, num_heads=3, rope=True, qk_norm=True)  # D = 4, Dw = 10
    assert m.qk_norm.q_norm.weight.shape == (m.wide_head_dim,) == (10,)
    x = x_(width=12)
    _close_to_numpy(m(x, is_causal=True, backend=backend), m, x, is_causal=True)


def test_odd_wide_head_needs_an_even_rotary_dim():
    with pytest.raises(ValueError, match=r"Dw = D \+ 2\*overlap = 5 \+ 2\*1 = 7"):  # C, H = 15, 3: D = 5
        OverlappingHeadAttention(C, H, overlap=1, rope=True)
    with pytest.raises(ValueError, match="= 7"):
        OverlappingHeadAttention(C, H, overlap=1, rope={"base": 100.0})
    m = make(1, rope={"rotary_dim": 6}, qk_norm=True)
    x = x_()
    _close_to_numpy(m(x, is_causal=True), m, x, is_causal=True)


@pytest.mark.parametrize("opts", [dict(qk_norm=True), dict(rope={"rotary_dim": 4})])
def test_either_option_switches_the_cache_to_widened_heads(opts):
    rows, m = make(2), make(2, **opts)
    assert rows.make_kv_cache(2, 6).k.shape == (2, 1, 6, H * D + 4)  # padded rows, shared channels once
    cache = m.make_kv_cache(2, 6)
    assert cache.k.shape == (2, H, 6, m.wide_head_dim)
    assert m.cost(5).kv_cache_bytes_per_token == 2 * H * m.wide_head_dim * 2
    x = x_(T=6)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)] + [m(x[:, t : t + 1], is_causal=True, kv_cache=cache)
                                                            for t in (4, 5)]  # fmt: skip
    assert_paths_agree(torch.cat(steps, 1), m(x, is_causal=True))


def test_no_overlap_by_default():
    """catches: another default overlap (0: plain heads unless asked)."""
    assert OverlappingHeadAttention(16, 4).overlap == 0
