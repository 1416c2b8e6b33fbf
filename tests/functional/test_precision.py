"""Gradients and low precision (RELIABILITY.md, "How to test numerics"):
gradcheck in float64, and the fp16/bf16 error budget against float64."""


import pytest
import torch
from support.attention import BACKENDS, F64, make_qkv, run_reference
from torch.autograd import gradcheck

from multihead.functional import attention, padding_mask_from_lengths


def _noncontig(x):
    """The values of x in a transposed layout with stride 2; differentiable."""
    xt = x.transpose(-1, -2)
    y = torch.stack([xt, torch.zeros_like(xt)], dim=-1)[..., 0].transpose(-1, -2)
    assert not y.is_contiguous() and y.stride(-1) > 1
    return y


GRAD_CASES = {
    # name: (B, H, G, T, S, D, Dv, kwargs builder); small: gradcheck is O(numel^2)
    "plain": (1, 2, 2, 3, 4, 2, 2, lambda r: {}),
    "gqa_g1": (1, 4, 1, 2, 3, 2, 2, lambda r: {}),
    "gqa_g2_causal": (1, 4, 2, 3, 3, 2, 2, lambda r: {"is_causal": True}),
    "causal_bottom_right_t_gt_s": (1, 2, 1, 4, 2, 2, 2, lambda r: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "bool_mask": (2, 2, 1, 2, 3, 2, 2, lambda r: {
        "attn_mask": torch.from_numpy(r.random((2, 2, 2, 3)) < 0.6)}),
    "float_mask_with_neg_inf": (1, 2, 2, 3, 4, 2, 1, lambda r: {
        "attn_mask": torch.tensor([[0.3, float("-inf"), -1.0, 0.0]] * 3, dtype=F64)}),
    "padding_and_causal_gqa": (2, 4, 2, 3, 3, 1, 2, lambda r: {
        "attn_mask": padding_mask_from_lengths([3, 1], 3, left=True), "is_causal": True}),
    "scale": (1, 2, 1, 2, 3, 3, 2, lambda r: {"scale": 0.7}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck(backend, contiguous, case, seed):
    B, H, G, T, S, D, Dv, build = GRAD_CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, D, Dv)
    kw = build(seed)
    leaves = tuple(x.requires_grad_() for x in (q, k, v))
    layout = (lambda x: x) if contiguous else _noncontig

    def fn(q, k, v):
        return attention(layout(q), layout(k), layout(v), backend=backend, **kw)

    assert gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float_mask_is_differentiable(backend, seed):
    q, k, v = make_qkv(seed, 1, 2, 1, 2, 3, 2, 2, requires_grad=True)
    bias = torch.from_numpy(seed.standard_normal((1, 2, 2, 3))).requires_grad_()

    def fn(q, k, v, bias):
        return attention(q, k, v, attn_mask=bias, backend=backend, is_causal=True)

    assert gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_math_weights(backend, seed):
    """The returned weights are differentiable too (math; sdpa has none)."""
    q, k, v = make_qkv(seed, 1, 4, 2, 2, 3, 2, 2, requires_grad=True)
    if backend == "sdpa":
        with pytest.raises(ValueError, match="return_weights"):
            attention(q, k, v, backend=backend, return_weights=True)
        return

    def fn(q, k, v):
        return attention(q, k, v, backend=backend, return_weights=True, is_causal=True)

    assert gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------ low precision

NOISE_FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _plain(q, k, v, causal, scale):
    """softmax(q kᵀ · scale) v entirely in the input dtype, GQA by repeat_interleave."""
    R = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(R, 1), v.repeat_interleave(R, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        T, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _out_and_grads(fn, q, k, v, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return out.detach().double(), [x.double() for x in torch.autograd.grad((out * g).sum(), (q, k, v))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_budget(backend, dtype, causal):
    """error(attention, fp64) <= 2x (outputs) / 3x (grads) error(plain, fp64) + floor."""
    gen = torch.Generator().manual_seed(7)
    B, H, G, T, S, D = 2, 4, 2, 96, 96, 64
    q, k, v = (torch.randn(*s, generator=gen).to(dtype)
               for s in ((B, H, T, D), (B, G, S, D), (B, G, S, D)))
    g = torch.randn(B, H, T, D, generator=gen).to(dtype)
    scale = D ** -0.5
    ref_np, _ = run_reference(q, k, v, is_causal=causal)
    ref_out, ref_grads = _out_and_grads(lambda a, b, c: _plain(a, b, c, causal, scale),
                                        q.double(), k.double(), v.double(), g.double())
    assert (ref_out - ref_np).abs().max() < 1e-12  # the float64 plain path is the reference
    mod_out, mod_grads = _out_and_grads(
        lambda a, b, c: attention(a, b, c, is_causal=causal, backend=backend), q, k, v, g)
    pl_out, pl_grads = _out_and_grads(lambda a, b, c: _plain(a, b, c, causal, scale), q, k, v, g)
    floor = NOISE_FLOOR[dtype]

    def err(a, b):
        return float((a - b).abs().max())

    assert mod_out.dtype == F64 and torch.isfinite(mod_out).all()
    e_mod, e_plain = err(mod_out, ref_np), err(pl_out, ref_np)
    assert e_mod <= 2 * e_plain + floor, f"output: {e_mod:.2e} > 2 x {e_plain:.2e} + {floor}"
    for name, gm, gp, gr in zip("qkv", mod_grads, pl_grads, ref_grads):
        e_mod, e_plain = err(gm, gr), err(gp, gr)
        assert e_mod <= 3 * e_plain + floor, f"d{name}: {e_mod:.2e} > 3 x {e_plain:.2e} + {floor}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_grads_match_float64(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 63, 63, 59, 5)
    g = torch.randn(2, 4, 63, 5, dtype=F64)
    ref_out, ref_grads = _out_and_grads(
        lambda a, b, c: attention(a, b, c, is_causal=True, backend="math"), q, k, v, g)
    out, gr = _out_and_grads(lambda a, b, c: attention(a, b, c, is_causal=True, backend=backend),
                             q.float(), k.float(), v.float(), g.float())
    torch.testing.assert_close(out, ref_out, rtol=1.3e-6, atol=1e-5)
    for a, b in zip(gr, ref_grads):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)
