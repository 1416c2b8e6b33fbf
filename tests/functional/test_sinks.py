"""Learned sinks (``functional.sinks``): one extra softmax column per head that mixes no
value. Both paths equal the float64 reference on every edge case (rows that see no
key, NaN behind the mask, GQA, both causal alignments, float masks), exact weights
carry the sink's share, and the fused path's backward passes gradcheck in q, k, v and
the sink logits."""

import numpy as np
import pytest
import torch
from support.attention import F64, assert_matches, make_qkv, run_reference
from support.paths import assert_paths_agree

from multihead.functional import WeightSelection, attention, padding_mask_from_lengths
from multihead.functional.request import make_request
from multihead.functional.sinks import augmented_attention


def _empty_rows(rng, B, H, T, S):
    m = torch.from_numpy(rng.random((B, H, T, S)) < 0.6)
    m[0, 1, 2] = False  # one row of one head sees nothing
    m[-1, :, 0] = False
    return {"attn_mask": m}


def _float(rng, B, H, T, S):
    m = torch.from_numpy(rng.standard_normal((1, H, T, S)))
    m[0, 0, 1] = float("-inf")  # a row of -inf: sees nothing
    return {"attn_mask": m, "is_causal": True}


CASES = {
    "none": (2, 4, 2, 5, 6, lambda r, B, H, T, S: {}),
    "mqa": (1, 4, 1, 3, 7, lambda r, B, H, T, S: {}),
    "causal_top_left": (2, 4, 2, 6, 6, lambda r, B, H, T, S: {"is_causal": True}),
    "causal_top_left_t_gt_s": (1, 2, 2, 6, 4, lambda r, B, H, T, S: {"is_causal": True}),
    "causal_bottom_right_cache": (2, 4, 2, 3, 8, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "causal_bottom_right_t_gt_s": (2, 4, 4, 6, 3, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "rows_that_see_nothing": (2, 4, 2, 5, 6, _empty_rows),
    "float_mask_and_causal": (2, 4, 2, 5, 5, _float),
    "padding": (3, 4, 2, 4, 5, lambda r, B, H, T, S: {"attn_mask": padding_mask_from_lengths([5, 0, 2], S)}),
}


def _sinks(H, seed=3):
    return torch.randn(H, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 2


def _reference(q, k, v, kw, sinks):
    kw = dict(kw)
    return run_reference(q, k, v, kw.pop("attn_mask", None), sinks=sinks.detach().numpy(), **kw)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_weights_equal_the_reference(case, backend, seed):
    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, 5)
    kw, sinks = build(seed, B, H, T, S), _sinks(H)
    want_out, want_w = _reference(q, k, v, kw, sinks)
    out, w = attention(q, k, v, sinks=sinks, backend=backend, return_weights=WeightSelection(), **kw)
    assert_matches(out, want_out)
    assert_matches(w, want_w)
    assert_matches(attention(q, k, v, sinks=sinks, backend=backend, **kw), want_out)
    sums = want_w.sum(-1)
    assert bool((sums < 1).all())  # the sink keeps a share of every row
    blind = sums == 0  # rows that may see no key: all on the sink, output 0
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    picked = attention(q, k, v, sinks=sinks, backend=backend, return_weights=WeightSelection(heads=[1], rows=[-1]), **kw)
    assert_matches(picked[1], want_w[:, [1]][:, :, [-1]])


def test_without_sinks_the_reference_is_unchanged_and_sinks_move_the_output(seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 5, 6, 3)
    plain = attention(q, k, v)
    assert_matches(plain, _reference(q, k, v, {}, torch.full((4,), -torch.inf, dtype=F64))[0])
    assert not torch.allclose(attention(q, k, v, sinks=_sinks(4)), plain)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_nan_behind_the_mask_changes_nothing(backend, seed):
    B, H, G, T, S = 2, 4, 2, 4, 6
    q, k, v = make_qkv(seed, B, H, G, T, S, 4)
    keep = padding_mask_from_lengths([4, 2], S)
    sinks = _sinks(H)
    clean = attention(q, k, v, attn_mask=keep, is_causal=True, causal_alignment="bottom_right", sinks=sinks,
                      backend=backend)  # fmt: skip
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 2:], v2[1, :, 2:] = float("nan"), float("nan")
    dirty = attention(q, k2, v2, attn_mask=keep, is_causal=True, causal_alignment="bottom_right", sinks=sinks,
                      backend=backend)  # fmt: skip
    assert_paths_agree(dirty, clean)


@pytest.mark.parametrize("case", ["causal_top_left", "causal_bottom_right_cache", "rows_that_see_nothing",
                                  "float_mask_and_causal", "mqa"])  # fmt: skip
def test_fused_backward_passes_gradcheck_in_inputs_and_sinks(case, seed):
    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, min(B, 2), H, G, T, S, 3, 2, requires_grad=True)
    kw = build(seed, min(B, 2), H, T, S)
    if "attn_mask" in kw:
        kw["attn_mask"] = kw["attn_mask"][: min(B, 2)]
    sinks = _sinks(H).requires_grad_(True)

    def fused(q, k, v, sinks):
        return attention(q, k, v, sinks=sinks, backend="sdpa", **kw)

    assert torch.autograd.gradcheck(fused, (q, k, v, sinks))
    out_m = attention(q, k, v, sinks=sinks, backend="math", **kw)
    g = torch.randn(out_m.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    for a, b in zip(torch.autograd.grad((fused(q, k, v, sinks) * g).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((out_m * g).sum(), (q, k, v, sinks))):  # fmt: skip
        assert_paths_agree(a, b)


def test_sink_gradient_matches_its_closed_form(seed):
    """d out / d s_h = -p_sink · out per row (the sink column mixes a zero value)."""
    q, k, v = make_qkv(seed, 1, 2, 2, 3, 4, 3)
    sinks = _sinks(2).requires_grad_(True)
    out = attention(q, k, v, sinks=sinks, backend="sdpa")
    w = _reference(q, k, v, {}, sinks)[1]
    p_sink = 1 - w.sum(-1, keepdim=True)  # (1, H, T, 1)
    (grad,) = torch.autograd.grad(out.sum(), sinks)
    want = (-(p_sink * out.detach()).sum(-1)).sum(dim=(0, 2))  # (H,)
    assert_paths_agree(grad, want)


def test_augmented_attention_with_zero_scale_uses_the_explicit_path(seed):
    q, k, v = make_qkv(seed, 1, 2, 1, 3, 4, 3)
    sinks = _sinks(2)
    req = make_request(q, k, v, attn_mask=None, is_causal=True, causal_alignment="top_left", scale=0.0,
                       dropout_p=0.0, training=False, return_weights=False, sinks=sinks)  # fmt: skip
    want = _reference(q, k, v, {"is_causal": True, "scale": 0.0}, sinks)[0]
    assert_matches(augmented_attention(req, q, k, v, sinks), want)
    assert_matches(attention(q, k, v, is_causal=True, scale=0.0, sinks=sinks, backend="math"), want)


def test_float32_paths_agree(seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 5, 7, 8, dtype=torch.float32)
    sinks = _sinks(4).float()
    a = attention(q, k, v, is_causal=True, causal_alignment="bottom_right", sinks=sinks, backend="sdpa")
    b = attention(q, k, v, is_causal=True, causal_alignment="bottom_right", sinks=sinks, backend="math")
    assert_paths_agree(a, b)


def test_bad_sinks_are_refused_by_name(seed):
    q, k, v = make_qkv(seed, 1, 4, 2, 2, 3, 3)
    with pytest.raises(ValueError, match=r"sinks must be \[H\] = \[4\].*got \(3,\)"):
        attention(q, k, v, sinks=torch.zeros(3, dtype=F64))
    with pytest.raises(TypeError, match="sinks must be a floating"):
        attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long))
    assert np.isfinite(attention(q, k, v, sinks=torch.zeros(4, dtype=F64)).numpy()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_with_sinks_follow_the_math_path():
    """float32 and bfloat16 on CUDA: the fused kernel corrected by its log-sum-exp, and its
    backward, against the math path (float32: torch.testing's tolerances; bfloat16: 2e-2)."""
    rng = np.random.default_rng(0)
    for dtype, tol in ((torch.float32, None), (torch.bfloat16, 2e-2)):
        q, k, v = (t.cuda() for t in make_qkv(rng, 2, 8, 2, 33, 40, 64, dtype=dtype, requires_grad=True))
        sinks = _sinks(8).to("cuda", torch.float32).requires_grad_(True)
        kw = {"is_causal": True, "causal_alignment": "bottom_right"}
        outs, grads = [], []
        for backend in ("sdpa", "math"):
            out = attention(q, k, v, sinks=sinks, backend=backend, **kw)
            outs.append(out.float())
            grads.append([g.float() for g in torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks))])
        kws = {} if tol is None else {"rtol": tol, "atol": tol}
        torch.testing.assert_close(outs[0], outs[1], **kws)
        with torch.no_grad():  # exact weights of some heads and rows: the rebuilt softmax times the sink factor
            sel = WeightSelection(heads=[1, 6], rows=[0, -1])
            w = [attention(q, k, v, sinks=sinks, backend=b, return_weights=sel, **kw)[1].float() for b in ("sdpa", "math")]
        torch.testing.assert_close(w[0], w[1], **kws)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, **({} if tol is None else {"rtol": tol, "atol": tol * b.abs().max().item()}))
