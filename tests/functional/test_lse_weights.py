"""Weights rebuilt from the fused kernel's log-sum-exp (``functional.lse_backend``):
equal to the reference and to the math path on every edge case, only for the
heads and rows asked for, with the kernel's output and gradients."""

import pytest
import torch
from support.attention import F64, assert_matches, make_qkv, run_reference
from support.paths import assert_paths_agree

import multihead.functional.math_backend as math_backend
from multihead.functional import (
    WeightSelection,
    attention,
    merge_masks,
    padding_mask_from_lengths,
    sliding_window_mask,
)


def _float(rng, shape, p_inf=0.2):
    m = torch.from_numpy(rng.standard_normal(shape))
    return m.masked_fill(torch.from_numpy(rng.random(shape) < p_inf), float("-inf"))


def _empty_rows(rng, B, H, T, S):
    m = torch.from_numpy(rng.random((B, H, T, S)) < 0.6)
    m[0, 1, 2] = False
    m[-1, :, 0] = False
    return {"attn_mask": m}


def _neg_inf_rows(rng, B, H, T, S):
    m = _float(rng, (B, 1, T, S))
    m[0, 0, 1] = float("-inf")
    return {"attn_mask": m}


# name -> (B, H, G, T, S, kwargs builder): every row of the defined-outputs table
CASES = {
    "none": (2, 4, 2, 7, 7, lambda r, B, H, T, S: {}),
    "mqa_cross": (2, 4, 1, 5, 9, lambda r, B, H, T, S: {}),
    "causal_top_left": (2, 4, 2, 7, 9, lambda r, B, H, T, S: {"is_causal": True}),
    "causal_top_left_t_gt_s": (1, 4, 4, 9, 5, lambda r, B, H, T, S: {"is_causal": True}),
    "causal_bottom_right_cache": (2, 4, 2, 3, 9, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "causal_bottom_right_t_gt_s": (2, 4, 2, 7, 3, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "decode_step": (3, 4, 2, 1, 8, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "bool_rows_that_see_nothing": (2, 4, 2, 5, 6, _empty_rows),
    "float_rows_of_minus_inf": (2, 4, 1, 5, 6, _neg_inf_rows),
    "float_mask_and_causal": (2, 4, 2, 6, 6, lambda r, B, H, T, S: {
        "attn_mask": _float(r, (1, H, T, S)), "is_causal": True}),
    "padding_right": (3, 4, 2, 5, 6, lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths([6, 0, 2], S)}),
    "padding_left_bottom_right": (2, 4, 2, 4, 6, lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths([6, 3], S, left=True),
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "padding_and_float": (2, 4, 4, 5, 5, lambda r, B, H, T, S: {
        "attn_mask": merge_masks(padding_mask_from_lengths([5, 2], S), _float(r, (T, S)))}),
    "sliding_window": (1, 4, 2, 8, 8, lambda r, B, H, T, S: {
        "attn_mask": sliding_window_mask(T, S, window=3)}),
    "scale": (2, 4, 2, 4, 6, lambda r, B, H, T, S: {"scale": 2.5, "is_causal": True}),
}

SELECTIONS = {
    "all": WeightSelection(),
    "one_head": WeightSelection(heads=[2]),
    "heads_and_a_row": WeightSelection(heads=[0, 3], rows=[-1]),
    "last_row": WeightSelection(rows=slice(-1, None)),
    "every_other_row": WeightSelection(heads=[1, 2, 3], rows=slice(None, None, 2)),
}


def _reference_slice(want_w, heads, rows):
    w = want_w if heads is None else want_w[:, list(heads)]
    return w if rows is None else w[:, :, list(rows)]


@pytest.mark.parametrize("selection", list(SELECTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_selected_weights_equal_the_reference_and_the_math_path(case, selection, seed):
    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, 5)  # D != Dv: the kernel gets zero columns
    kw = build(seed, B, H, T, S)
    sel = SELECTIONS[selection]
    out, w = attention(q, k, v, return_weights=sel, backend="sdpa", **kw)
    out_m, w_m = attention(q, k, v, return_weights=sel, backend="math", **kw)
    want_out, want_w = run_reference(q, k, v, kw.pop("attn_mask", None), **kw)
    heads = None if sel.heads is None else sel.heads
    rows = None if sel.rows is None else range(T)[sel.rows] if isinstance(sel.rows, slice) else [r % T for r in sel.rows]
    assert_matches(out, want_out)
    assert_matches(w, _reference_slice(want_w, heads, rows))
    assert_paths_agree(w, w_m)
    assert_paths_agree(out, out_m)
    assert not w.requires_grad


@pytest.mark.parametrize("case", ["causal_bottom_right_cache", "bool_rows_that_see_nothing", "padding_and_float"])
def test_float32_weights_equal_the_math_path(case, seed):
    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 8, 4, dtype=torch.float32)
    kw = build(seed, B, H, T, S)
    if "attn_mask" in kw and kw["attn_mask"].dtype == F64:
        kw["attn_mask"] = kw["attn_mask"].float()
    out, w = attention(q, k, v, return_weights=True, backend="sdpa", **kw)
    out_m, w_m = attention(q, k, v, return_weights=True, backend="math", **kw)
    assert w.dtype == torch.float32 and w.shape == (B, H, T, S)
    assert_paths_agree(w, w_m)
    assert_paths_agree(out, out_m)


def test_rows_that_see_nothing_get_exact_zeros_and_zero_gradients(seed):
    """catches: a harmless mask row left in place (weights and output of a masked row not zero)."""
    B, H, G, T, S, build = CASES["bool_rows_that_see_nothing"]
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, requires_grad=True)
    kw = build(seed, B, H, T, S)
    out, w = attention(q, k, v, return_weights=WeightSelection(), backend="sdpa", **kw)
    empty = ~kw["attn_mask"].any(-1)  # (B, H, T)
    assert torch.equal(w[empty], torch.zeros_like(w[empty]))  # exact zeros, not rounding
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    (gq,) = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q,))
    assert bool(torch.isfinite(gq).all()) and torch.equal(gq[empty], torch.zeros_like(gq[empty]))


@pytest.mark.parametrize("case", ["causal_bottom_right_cache", "padding_right", "mqa_cross"])
def test_output_gradients_are_the_fused_kernels(case, seed):
    """The output of a call with a selection differentiates like the plain sdpa call."""
    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 4, requires_grad=True)
    kw = build(seed, B, H, T, S)
    out, w = attention(q, k, v, return_weights=WeightSelection(heads=[1]), backend="sdpa", **kw)
    plain = attention(q, k, v, backend="sdpa", **kw)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((plain * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert_paths_agree(a, b)
    assert not w.requires_grad and w.grad_fn is None


def test_non_finite_values_hidden_change_nothing_and_visible_ones_show(seed):
    """NaN at padded keys: weights equal those without it; NaN at a visible key: that row is NaN."""
    B, H, G, T, S = 2, 4, 2, 4, 6
    q, k, v = make_qkv(seed, B, H, G, T, S, 3)
    mask = padding_mask_from_lengths([4, 6], S)
    sel = WeightSelection(heads=[1, 2], rows=[1, 3])
    clean = attention(q, k, v, attn_mask=mask, return_weights=sel)[1]
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 5], v2[0, :, 4] = float("nan"), float("inf")  # keys batch item 0 may not see
    k2[1, 1, 2] = float("nan")  # a key batch item 1 sees, read by heads 2 and 3
    w = attention(q, k2, v2, attn_mask=mask, return_weights=sel, backend="sdpa")[1]
    w_m = attention(q, k2, v2, attn_mask=mask, return_weights=sel, backend="math")[1]
    assert_paths_agree(w[0], clean[0])
    assert bool(torch.isnan(w[1, 1]).all()) and not bool(torch.isnan(w[1, 0]).any())
    assert_paths_agree(w, w_m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_scores_give_the_exact_weights(dtype):
    """q = k = 300, D = 64: scores of 7.2e5, where float32's lse is known to 0.06 only.

    catches: exp(x - lse) without dividing by the row sum (weights 3% off)."""
    B, H, G, T, S, D = 1, 2, 1, 4, 6, 64
    q = torch.full((B, H, T, D), 300.0, dtype=dtype)
    k = torch.full((B, G, S, D), 300.0, dtype=dtype)
    v = torch.randn(B, G, S, D).to(dtype)
    _, w = attention(q, k, v, return_weights=WeightSelection(), backend="sdpa")
    assert w.dtype == dtype
    torch.testing.assert_close(w.float(), torch.full((B, H, T, S), 1 / S), rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_within_twice_the_plain_error(dtype, seed):
    B, H, G, T, S, D = 2, 4, 2, 16, 24, 32
    q, k, v = (t.to(dtype) for t in make_qkv(seed, B, H, G, T, S, D))
    mask = padding_mask_from_lengths([24, 11], S)
    _, w = attention(q, k, v, attn_mask=mask, is_causal=True, return_weights=True, backend="sdpa")
    _, want = run_reference(q, k, v, mask, is_causal=True)
    ke = k.repeat_interleave(H // G, 1)
    plain_scores = (q @ ke.transpose(-1, -2)) * D**-0.5  # the plain computation in the same dtype
    hidden = ~(mask & torch.ones(T, S, dtype=torch.bool).tril())
    plain = torch.softmax(plain_scores.masked_fill(hidden, float("-inf")), -1)
    plain = plain.nan_to_num(0.0)
    err, plain_err = (w.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert float(err) <= 2 * float(plain_err) + 1e-6


def test_only_the_selected_heads_are_formed(seed, monkeypatch):
    """The sdpa path never runs the full softmax of the math path, and the auto backend takes it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the explicit softmax ran")

    monkeypatch.setattr(math_backend, "masked_softmax", refuse)
    q, k, v = make_qkv(seed, 1, 4, 2, 6, 6, 3)
    out, w = attention(q, k, v, is_causal=True, return_weights=WeightSelection(heads=[3], rows=[5]))
    assert w.shape == (1, 1, 1, 6)
    _, full = run_reference(q, k, v, is_causal=True)
    assert_matches(w, full[:, 3:4, 5:6])


def test_return_weights_true_without_gradients_uses_the_kernel(seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 3, 5, 4)
    out_a, w_a = attention(q, k, v, return_weights=True, is_causal=True)
    out_s, w_s = attention(q, k, v, return_weights=True, is_causal=True, backend="sdpa")
    assert torch.equal(out_a, out_s) and torch.equal(w_a, w_s)  # auto runs the sdpa path itself: bitwise


def test_weights_that_need_gradients_use_the_math_path(seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 3, 5, 4, requires_grad=True)
    out_a, w_a = attention(q, k, v, return_weights=True, is_causal=True)
    out_m, w_m = attention(q, k, v, return_weights=True, is_causal=True, backend="math")
    assert torch.equal(out_a, out_m) and torch.equal(w_a, w_m)  # auto runs the math path itself: bitwise
    assert w_a.requires_grad
    with torch.no_grad():  # no gradient wanted: the kernel serves
        assert torch.equal(attention(q, k, v, return_weights=True)[1], attention(q, k, v, return_weights=True,
                                                                                 backend="sdpa")[1])


@pytest.mark.parametrize(("build", "reason"), [
    (lambda q, k, v: dict(return_weights=True, q=q.requires_grad_()), "while an input requires grad"),
    (lambda q, k, v: dict(return_weights=WeightSelection(), dropout_p=0.3, training=True), r"dropout in training"),
    (lambda q, k, v: dict(return_weights=WeightSelection(), attn_mask=torch.zeros(3, 5, dtype=F64).requires_grad_()),
     "attn_mask that requires grad"),
])
def test_the_kernel_path_refuses_what_it_cannot_serve_and_says_why(build, reason, seed):
    q, k, v = make_qkv(seed, 1, 4, 2, 3, 5, 4)
    call = {"q": q, "k": k, "v": v, **build(q, k, v)}
    with pytest.raises(ValueError, match=rf"'sdpa' cannot serve.*{reason}"):
        attention(backend="sdpa", **call)
    out, w = attention(**call)  # auto: the math path, explicitly
    want_out, want_w = attention(backend="math", **call)
    if not call.get("training"):
        assert torch.equal(out, want_out) and torch.equal(w, want_w)


@pytest.mark.parametrize(("selection", "error", "match"), [
    (dict(heads=[4]), ValueError, r"heads=\[4\] asks for head 4, but the call has H=4"),
    (dict(heads=[2, 1]), ValueError, r"ascending head indices.*heads=\[2, 1\]"),
    (dict(heads=[1, 1]), ValueError, r"each once; got heads=\[1, 1\]"),
    (dict(heads=[-1]), ValueError, r"heads=\[-1\]"),
    (dict(heads=[]), ValueError, r"heads is empty"),
    (dict(heads=1), TypeError, r"heads must be a list of ints, got heads=1"),
    (dict(heads=[0.5]), TypeError, r"heads must hold ints, got 0.5"),
    (dict(rows=[3]), ValueError, r"rows=\[3\] asks for row 3, but the call has T=3"),
    (dict(rows=[-4]), ValueError, r"asks for row -4, but the call has T=3"),
    (dict(rows=[2, 0]), ValueError, r"rows=\[2, 0\] are not ascending"),
    (dict(rows=[-1, 0]), ValueError, r"rows=\[-1, 0\] are not ascending"),
    (dict(rows=[0, -3]), ValueError, r"rows=\[0, -3\] are not ascending rows of T=3"),
    (dict(rows=slice(0, None, -1)), ValueError, r"step must be positive"),
    (dict(rows=slice("a", None)), TypeError, r"start must be an int"),
    (dict(rows="0"), TypeError, r"rows must be a list of ints"),
])
def test_bad_selections_name_the_values(selection, error, match, seed):
    q, k, v = make_qkv(seed, 1, 4, 2, 3, 5, 4)
    with pytest.raises(error, match=match):
        attention(q, k, v, return_weights=WeightSelection(**selection))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("case", ["causal_top_left", "causal_bottom_right_cache", "padding_right", "float_mask_and_causal"])
def test_cuda_kernels_give_the_math_weights(kernel, case, seed):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, G, T, S, build = CASES[case]
    kw = build(seed, B, H, T, S)
    kw = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    q, k, v = (t.cuda() for t in make_qkv(seed, B, H, G, T, S, 64, dtype=torch.float16))
    if "attn_mask" in kw and kw["attn_mask"].dtype == F64:
        kw["attn_mask"] = kw["attn_mask"].half()
    sel = WeightSelection(heads=[0, 3], rows=[0, T - 1])
    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        try:
            out, w = attention(q, k, v, return_weights=sel, backend="sdpa", **kw)
        except ValueError as e:  # this kernel does not take the call (e.g. flash with a mask)
            assert "no fused CUDA kernel takes this call" in str(e)
            pytest.skip(f"{kernel} does not take {case}: {e}")
    out_m, w_m = attention(q.double(), k.double(), v.double(), return_weights=sel, backend="math",
                           **{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                              for n, t in kw.items()})
    torch.testing.assert_close(w.double(), w_m, rtol=0, atol=2e-3)
    torch.testing.assert_close(out.double(), out_m, rtol=0, atol=5e-3)


def _cuda_call(tensors, kw, dtype):
    """q, k, v and the call's tensors on the GPU in ``dtype`` (bool masks stay bool)."""
    moved = {n: (t.to("cuda", dtype) if t.is_floating_point() else t.cuda()) if isinstance(t, torch.Tensor) else t
             for n, t in kw.items()}  # fmt: skip
    return tuple(t.to("cuda", dtype) for t in tensors), moved


def _assert_cuda_paths_close(got, want, dtype, atol_half):
    """float32: torch.testing's defaults scaled by the magnitude; half precision: ``atol_half`` scaled."""
    fin = torch.isfinite(want)
    scale = max(1.0, float(want[fin].abs().max())) if bool(fin.any()) else 1.0
    tol = {"rtol": 1.3e-6, "atol": 1e-5 * scale} if dtype == torch.float32 else {"rtol": 0, "atol": atol_half * scale}
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), equal_nan=True, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_rebuilt_weights_equal_the_math_path_on_cuda(case, dtype, seed):
    """Every edge case of the table on the GPU, with a different selection per case (all of them in turn):
    the weights rebuilt from the kernel's log-sum-exp equal the math path's on the same device."""
    B, H, G, T, S, build = CASES[case]
    sel = list(SELECTIONS.values())[list(CASES).index(case) % len(SELECTIONS)]
    (q, k, v), kw = _cuda_call(make_qkv(seed, B, H, G, T, S, 16), build(seed, B, H, T, S), dtype)
    out, w = attention(q, k, v, return_weights=sel, backend="sdpa", **kw)
    out_m, w_m = attention(q, k, v, return_weights=sel, backend="math", **kw)
    assert w.device.type == "cuda" and w.dtype == dtype and not w.requires_grad
    _assert_cuda_paths_close(w, w_m, dtype, 1e-2)
    _assert_cuda_paths_close(out, out_m, dtype, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_non_finite_values_hidden_change_nothing_and_visible_ones_show(dtype, seed):
    """NaN and inf at padded keys: the selected weights equal those without them; NaN at a visible key:
    that row is NaN; the same on the math path on the GPU and on the CPU in float64."""
    B, H, G, T, S = 2, 4, 2, 4, 6
    q, k, v = make_qkv(seed, B, H, G, T, S, 16)
    k[0, :, 5], v[0, :, 4] = float("nan"), float("inf")  # keys batch item 0 may not see
    k[1, 1, 2] = float("nan")  # a key batch item 1 sees, read by heads 2 and 3
    kw = {"attn_mask": padding_mask_from_lengths([4, 6], S), "return_weights": WeightSelection(heads=[1, 2], rows=[1, 3])}
    cpu_w = attention(q, k, v, backend="math", **kw)[1]
    clean_w = attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0, 0.0, 0.0), backend="math", **kw)[1]
    (qc, kc, vc), kwc = _cuda_call((q, k, v), kw, dtype)
    w = attention(qc, kc, vc, backend="sdpa", **kwc)[1]
    w_m = attention(qc, kc, vc, backend="math", **kwc)[1]
    assert bool(torch.isnan(w[1, 1]).all()) and not bool(torch.isnan(w[1, 0]).any())
    assert not bool(torch.isnan(w[0]).any())
    _assert_cuda_paths_close(w, w_m, dtype, 1e-2)
    _assert_cuda_paths_close(w[0], clean_w[0], dtype, 1e-2)
    _assert_cuda_paths_close(w, cpu_w, dtype, 1e-2)


@pytest.mark.parametrize("case", ["causal_top_left", "causal_top_left_t_gt_s", "causal_bottom_right_cache",
                                  "causal_bottom_right_t_gt_s", "padding_left_bottom_right", "float_mask_and_causal",
                                  "bool_rows_that_see_nothing"])
@pytest.mark.parametrize("selection", ["all", "every_other_row", "heads_and_a_row"])
def test_weights_formed_in_blocks_of_rows_equal_the_reference(case, selection, seed, monkeypatch):
    """Blocks of one to three rows, each reading only the keys its last row may see.

    catches: a block that stops at the keys of its first row, or masks the causal band of another block."""
    import multihead.functional.weights as weights

    B, H, G, T, S, build = CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 3)
    kw = build(seed, B, H, T, S)
    sel = SELECTIONS[selection]
    want_out, want_w = run_reference(q, k, v, kw.get("attn_mask"), **{n: x for n, x in kw.items() if n != "attn_mask"})
    monkeypatch.setattr(weights, "MIN_BLOCK_ROWS", 1)
    for block in (1, 2 * H * S, 3 * B * H * S):
        monkeypatch.setattr(weights, "BLOCK_SCORES", block)
        out, w = attention(q, k, v, return_weights=sel, backend="sdpa", **kw)
        w_m = attention(q, k, v, return_weights=sel, backend="math", **kw)[1]
        assert_paths_agree(w, w_m)
        assert_matches(out, want_out)


@pytest.mark.parametrize("Dv", [4, 2])
def test_inputs_and_masks_whose_rows_are_not_contiguous(Dv, seed):
    """q, k, v with a last stride other than 1 (a head-interleaved layout, as a kind's
    view of a projection gives) and a transposed mask.

    catches: the CPU kernel called on such rows (wrong outputs, NaN read from outside the tensors)."""
    B, H, G, T, S, D = 2, 8, 4, 6, 6, 2
    q0, k0, v0 = make_qkv(seed, B, H, G, T, S, D, Dv)
    q = q0.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # strides (T*D*H, 1, D*H, H)
    k = k0.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    v = v0.transpose(-1, -2).contiguous().transpose(-1, -2)  # last stride S
    mask = _float(seed, (B, 1, S, T)).transpose(-1, -2)  # (B, 1, T, S), last stride T
    assert q.stride(-1) != 1 and k.stride(-1) != 1 and v.stride(-1) != 1 and mask.stride(-1) != 1
    for kw in ({"is_causal": True}, {"attn_mask": mask}):
        out, w = attention(q, k, v, return_weights=WeightSelection(heads=[0, 5]), backend="sdpa", **kw)
        want_out, want_w = run_reference(q0, k0, v0, kw.pop("attn_mask", None), **kw)
        assert_matches(out, want_out)
        assert_matches(w, want_w[:, [0, 5]])


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("selection", ["all", "one_head", "every_other_row"])
def test_causal_keys_whose_scores_overflow_stay_hidden(alignment, selection, monkeypatch):
    """Every later key scores 100 above the one before it (q·k · scale = 100 s), so
    exp(score - lse) of a hidden key overflows float32; each row keeps its weight
    on the keys it may see, in one block and in blocks of one to three rows.

    catches: hidden keys of the causal band leaking inf or NaN into a row, or
    zeroed before the exponential (exp(0) = 1) or after the row sum."""
    import multihead.functional.weights as weights

    B, H, G, T, S, D = 1, 4, 2, 6, (6 if alignment == "top_left" else 9), 4
    k = (torch.arange(S, dtype=torch.float32) * 50.0)[None, None, :, None].expand(B, G, S, D)  # scale 1/2
    q = torch.ones(B, H, T, D)
    v = torch.randn(B, G, S, D, generator=torch.Generator().manual_seed(0))
    call = {"is_causal": True, "causal_alignment": alignment, "return_weights": SELECTIONS[selection]}
    want = attention(q, k, v, backend="math", **call)[1]
    assert bool(torch.isfinite(want).all())
    monkeypatch.setattr(weights, "MIN_BLOCK_ROWS", 1)
    for block in (1 << 19, 1, 2 * H * S, 3 * H * S):
        monkeypatch.setattr(weights, "BLOCK_SCORES", block)
        w = attention(q, k, v, backend="sdpa", **call)[1]
        assert bool(torch.isfinite(w).all())
        assert_paths_agree(w, want)
