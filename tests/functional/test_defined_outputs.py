"""RELIABILITY.md, defined-outputs table, on both backends: empty rows, non-finite
keys/values, large half-precision activations, empty tensors and dropout."""


import pytest
import torch
from support.attention import BACKENDS, F64, assert_matches, check_against_reference, make_qkv, run_reference

from multihead.functional import WeightSelection, attention, padding_mask_from_lengths

both = pytest.mark.parametrize("backend", BACKENDS)


def _call(q, k, v, backend, **kw):
    """(out, weights): every weight, from the math backend, or rebuilt from
    the fused kernel's log-sum-exp (sdpa; detached)."""
    if backend == "math":
        return attention(q, k, v, backend=backend, return_weights=True, **kw)
    return attention(q, k, v, backend=backend, return_weights=WeightSelection(), **kw)


def _all_false_rows(rng, B, H, T, S):
    m = torch.from_numpy(rng.random((B, H, T, S)) < 0.6)
    m[0, 1, 2] = False
    m[1, :, 0] = False
    return {"attn_mask": m}


def _neg_inf_rows(rng, B, H, T, S):
    m = torch.from_numpy(rng.standard_normal((B, 1, T, S)))
    m[0, 0, 1] = float("-inf")
    m[1, 0, 3, ::2] = float("-inf")
    m[1, 0, 3, 1::2] = float("-inf")
    return {"attn_mask": m}


EMPTY_ROW_CASES = {
    # name: (B, H, G, T, S, kwargs builder)
    "all_false_rows": (2, 4, 2, 5, 6, _all_false_rows),
    "all_neg_inf_float_rows": (2, 4, 1, 5, 6, _neg_inf_rows),
    "s_zero": (2, 4, 2, 3, 0, lambda r, B, H, T, S: {}),
    "s_zero_causal": (2, 4, 4, 3, 0, lambda r, B, H, T, S: {"is_causal": True}),
    "s_zero_mask": (2, 4, 2, 3, 0, lambda r, B, H, T, S: {"attn_mask": torch.ones(T, S, dtype=torch.bool)}),
    "bottom_right_t_gt_s": (2, 4, 2, 7, 3, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "bottom_right_t_gt_s_mha": (1, 4, 4, 5, 1, lambda r, B, H, T, S: {
        "is_causal": True, "causal_alignment": "bottom_right"}),
    "left_padding_len0": (3, 4, 2, 4, 5, lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths([5, 0, 2], S, left=True)}),
    "left_padding_top_left_causal": (2, 4, 1, 5, 5, lambda r, B, H, T, S: {
        "attn_mask": padding_mask_from_lengths([5, 3], S, left=True), "is_causal": True}),
    "everything_masked": (2, 4, 2, 3, 4, lambda r, B, H, T, S: {
        "attn_mask": torch.zeros(T, S, dtype=torch.bool)}),
}


@both
@pytest.mark.parametrize("case", list(EMPTY_ROW_CASES))
def test_rows_that_see_nothing(backend, case, seed):
    """Output 0, weights 0, zero gradients, no NaN anywhere; other rows exact."""
    B, H, G, T, S, build = EMPTY_ROW_CASES[case]
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, 2, requires_grad=True)
    kw = build(seed, B, H, T, S)
    out, w = _call(q, k, v, backend, **kw)
    want_out, want_w = run_reference(q, k, v, kw.get("attn_mask"), is_causal=kw.get("is_causal", False),
                                     causal_alignment=kw.get("causal_alignment", "top_left"))
    empty = (want_w.sum(-1) == 0)  # (B, H, T)
    assert bool(empty.any()), "the case must contain an empty row"
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert_matches(out, want_out)
    if w is not None:
        assert torch.equal(w[empty], torch.zeros_like(w[empty]))
        assert_matches(w, want_w)
    gout = torch.randn_like(out)
    loss = (out * gout).sum() + (0 if w is None else (w * torch.randn_like(w)).sum())
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    for g in (gq, gk, gv):
        assert bool(torch.isfinite(g).all())
    assert torch.equal(gq[empty], torch.zeros_like(gq[empty]))
    # Keys/values that no query sees get zero gradients too.
    if S:
        R = H // G
        seen = (want_w > 0).reshape(B, G, R * T, S).any(2)  # (B, G, S)
        assert torch.equal(gk[~seen], torch.zeros_like(gk[~seen]))
        assert torch.equal(gv[~seen], torch.zeros_like(gv[~seen]))


@both
def test_empty_rows_under_dropout(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 6, 3, 3, requires_grad=True)
    torch.manual_seed(3)
    out = attention(q, k, v, is_causal=True, causal_alignment="bottom_right", dropout_p=0.5,
                    training=True, backend=backend)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    gq, = torch.autograd.grad(out.sum(), (q,))
    assert bool(torch.isfinite(gq).all()) and not bool(gq[:, :, :3].any())


# --------------------------------------------------------- non-finite values


def _poison(x, where, value):
    x = x.detach().clone()
    x[where] = value
    return x


@both
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_in_padded_keys_values_change_nothing(backend, poison, seed):
    B, H, G, T, S = 3, 4, 2, 5, 7
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, 4)
    lengths = [7, 4, 0]
    keep = padding_mask_from_lengths(lengths, S)  # (B, 1, 1, S)
    pad = (~keep[:, 0, 0, :])[:, None, :].expand(B, G, S)  # (B, G, S)
    kp = _poison(k, pad, poison)
    vp = _poison(v, pad, poison)
    vp[0, 1, 6, 2] = 1.0  # visible, finite
    vc = _poison(v, pad, 0.0)
    vc[0, 1, 6, 2] = 1.0
    kp, vp = kp.requires_grad_(), vp.requires_grad_()
    qg = q.clone().requires_grad_()
    out, w = _call(qg, kp, vp, backend, attn_mask=keep)
    clean, w_clean = _call(q, _poison(k, pad, 0.0), vc, backend, attn_mask=keep)
    assert bool(torch.isfinite(out).all())
    assert_matches(out, clean, 1e-12)
    assert_matches(out, run_reference(q, kp, vp, keep)[0])
    if w is not None:
        assert_matches(w, w_clean, 1e-12)
    for g in torch.autograd.grad(out.sum(), (qg, kp, vp)):
        assert bool(torch.isfinite(g).all())


@both
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_nonfinite_in_future_keys_values_change_nothing(backend, align, seed):
    """Causal: a NaN/inf at key j only reaches queries that may see j."""
    B, H, G, T, S = 2, 4, 4, 6, 6
    q, k, v = make_qkv(seed, B, H, G, T, S, 3)
    kp = _poison(k, (slice(None), slice(None), 4), float("nan"))
    vp = _poison(v, (slice(None), slice(None), 5), float("inf"))
    out, w = _call(q, kp, vp, backend, is_causal=True, causal_alignment=align)
    base, w_base = _call(q, k, v, backend, is_causal=True, causal_alignment=align)
    assert_matches(out[:, :, :4], base[:, :, :4], 1e-12)  # rows 0..3 never see keys 4, 5
    assert bool(torch.isnan(out[:, :, 4:]).all())  # rows 4, 5 see the NaN key 4
    assert_matches(out, run_reference(q, kp, vp, is_causal=True, causal_alignment=align)[0])
    if w is not None:
        assert_matches(w[:, :, :4], w_base[:, :, :4], 1e-12)


@both
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_visible_inputs_stays_in_affected_rows(backend, causal, seed):
    B, H, G, T, S = 2, 4, 2, 5, 5
    q, k, v = make_qkv(seed, B, H, G, T, S, 3)
    q = _poison(q, (0, 3, 1, 0), float("nan"))  # one query row
    k = _poison(k, (1, 0, 2, 1), float("nan"))  # key 2 of group 0 in batch 1
    v = _poison(v, (0, 1, 3, 2), float("nan"))  # value 3, feature 2 of group 1 in batch 0
    kw = {"is_causal": causal}
    out = check_against_reference(q, k, v, backend, **kw)
    nan = torch.isnan(out)
    assert bool(nan[0, 3, 1].all())
    assert bool(nan[1, :2, 2 if causal else 0:].all()) and not bool(nan[1, 2:].any())
    assert bool(nan[0, 2:, 3 if causal else 0:, 2].all())
    assert not bool(nan[0, :2].any())
    if causal:
        assert not bool(nan[1, :2, :2].any()) and not bool(nan[0, 2, :3, 2].any())


@both
def test_nan_in_visible_float_mask_entry(backend, seed):
    q, k, v = make_qkv(seed, 1, 4, 2, 3, 4, 3)
    m = torch.zeros(3, 4, dtype=F64)
    m[1, 2] = float("nan")
    out = check_against_reference(q, k, v, backend, attn_mask=m)
    assert bool(torch.isnan(out[:, :, 1]).all()) and bool(torch.isfinite(out[:, :, [0, 2]]).all())


@both
def test_nonfinite_query_rows(backend, seed):
    """A query row holding NaN/inf is NaN (torch's CPU flash kernel returns 0
    for it when D == Dv), unless it may see no key at all (then 0)."""
    q, k, v = make_qkv(seed, 2, 4, 2, 5, 6, 4)
    k = k.abs()
    q = _poison(q, (0, 1, 2, 3), float("nan"))
    q = _poison(q, (1, 0, 0, 1), float("inf"))  # every score +inf
    q = _poison(q, (1, 2, 3, 0), float("nan"))
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[1, 0, 3] = False  # row 3 of batch 1 sees nothing
    for kw in ({"is_causal": True}, {"attn_mask": mask}):
        out = check_against_reference(q, k, v, backend, **kw)
        nan_rows = torch.isnan(out).all(-1)
        assert bool(nan_rows[0, 1, 2]) and bool(nan_rows[1, 0, 0])
        assert bool(nan_rows[1, 2, 3]) != ("attn_mask" in kw)
        assert int(torch.isnan(out).sum()) == 4 * int(nan_rows.sum())


@both
def test_inf_in_visible_values_and_keys(backend, seed):
    q, k, v = make_qkv(seed, 1, 4, 2, 4, 5, 3)
    q = q.abs()
    v = _poison(v, (0, 0, 1, 0), float("inf"))
    v = _poison(v, (0, 0, 2, 1), -float("inf"))
    v = _poison(v, (0, 1, 1, 2), float("inf"))
    v = _poison(v, (0, 1, 3, 2), -float("inf"))  # +inf and -inf in one feature: NaN
    k = _poison(k, (0, 1, 4, 0), float("inf"))  # score +inf for rows that see key 4
    out = check_against_reference(q, k, v, backend, is_causal=True, causal_alignment="bottom_right")
    # bottom_right, T=4, S=5: query t sees keys 0..t+1.
    assert bool(torch.isposinf(out[0, :2, :, 0]).all()) and bool(torch.isneginf(out[0, :2, 1:, 1]).all())
    assert bool(torch.isfinite(out[0, :2, 0, 1]).all())
    assert bool(torch.isposinf(out[0, 2:, :2, 2]).all())  # rows 0, 1 see the +inf only
    assert bool(torch.isnan(out[0, 2:, 2, 2]).all()) and bool(torch.isnan(out[0, 2:, 3]).all())


# ------------------------------------------------------ large half precision


@both
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_large_activations(backend, dtype, causal, seed):
    """q = k = 300, D = 64: scores of 7.2e5 overflow float16 unless accumulated
    in float32. Keys at 299 lose by a score gap of 2400, so each row averages
    the values of the visible keys at 300."""
    B, H, G, T, S, D = 2, 4, 2, 6, 6, 64
    q = torch.full((B, H, T, D), 300.0, dtype=dtype)
    k = torch.full((B, G, S, D), 300.0, dtype=dtype)
    k[:, :, 1::3] = 299.0
    v = torch.randn(B, G, S, 8).to(dtype)
    for kk in (torch.full_like(k, 300.0), k):
        out = attention(q, kk, v, is_causal=causal, backend=backend)
        assert out.dtype == dtype and bool(torch.isfinite(out).all())
        want, _ = run_reference(q, kk, v, is_causal=causal)
        tol = 1e-3 if dtype == torch.float16 else 8e-3
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol * float(want.abs().max()))


# ----------------------------------------------------------- empty tensors


@both
@pytest.mark.parametrize(("B", "T", "S"), [(0, 3, 4), (2, 0, 4), (0, 0, 0), (2, 0, 0)])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"is_causal": True, "causal_alignment": "bottom_right"}])
def test_empty_batch_or_queries(backend, B, T, S, kw, seed):
    q, k, v = make_qkv(seed, B, 4, 2, T, S, 3, 5, requires_grad=True)
    for mask in (None, torch.ones(T, S, dtype=torch.bool), torch.zeros(B, 1, T, S, dtype=F64)):
        out, w = _call(q, k, v, backend, attn_mask=mask, **kw)
        assert out.shape == (B, 4, T, 5) and out.dtype == F64
        if w is not None:
            assert w.shape == (B, 4, T, S)
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        for g, x in ((gq, q), (gk, k), (gv, v)):
            assert g is not None and g.shape == x.shape and not bool(g.any())


@both
@pytest.mark.parametrize(("T", "Dv"), [(0, 3), (4, 0), (0, 0)])
def test_nonfinite_keys_with_empty_queries_or_values(backend, T, Dv, seed):
    """NaN keys/values with T = 0 or Dv = 0 still give the empty result (T = 0
    used to crash with a RuntimeError from an ambiguous reshape)."""
    q, k, v = make_qkv(seed, 2, 4, 2, T, 5, 3, Dv)
    k = _poison(k, (0, 1, 2, 0), float("nan"))
    v = _poison(v, (1, 0, 1), float("inf"))
    out = attention(q, k, v, is_causal=True, backend=backend)
    assert out.shape == (2, 4, T, Dv)


# ----------------------------------------------------------------- dropout


@both
def test_dropout_only_in_training(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 7, 9, 5)
    base = attention(q, k, v, is_causal=True, backend=backend)
    state = torch.get_rng_state()
    assert torch.equal(attention(q, k, v, is_causal=True, dropout_p=0.5, training=False, backend=backend), base)
    assert torch.equal(torch.get_rng_state(), state)


@both
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"attn_mask": torch.arange(63).reshape(7, 9) % 3 != 0}])
def test_dropout_zero_is_bitwise_and_draws_nothing(backend, kw, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 7, 9, 5, requires_grad=True)
    base = attention(q, k, v, backend=backend, **kw)
    state = torch.get_rng_state()
    out = attention(q, k, v, dropout_p=0.0, training=True, backend=backend, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out, base)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(base.sum(), (q, k, v))):
        assert torch.equal(a, b)


@both
def test_dropout_in_training_changes_output_reproducibly(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 7, 9, 5)
    base = attention(q, k, v, backend=backend)
    torch.manual_seed(123)
    a = attention(q, k, v, dropout_p=0.3, training=True, backend=backend)
    after_a = torch.get_rng_state()
    torch.manual_seed(123)
    b = attention(q, k, v, dropout_p=0.3, training=True, backend=backend)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), after_a)
    assert not torch.allclose(a, base)
    c = attention(q, k, v, dropout_p=0.3, training=True, backend=backend)
    assert not torch.equal(a, c)
    assert bool(torch.isfinite(a).all())


def test_dropout_weights_are_pre_dropout(seed):
    """Only math returns weights; they are taken before dropout."""
    q, k, v = make_qkv(seed, 1, 4, 2, 5, 6, 3)
    _, w = attention(q, k, v, backend="math", return_weights=True)
    torch.manual_seed(0)
    out, wd = attention(q, k, v, backend="math", return_weights=True, dropout_p=0.5, training=True)
    assert torch.equal(w, wd)
    # out is (dropped weights / (1 - p)) @ v: each weight kept x2 or zeroed.
    R = 2
    v_h = v.repeat_interleave(R, 1)
    torch.manual_seed(0)
    keep = torch.nn.functional.dropout(torch.ones_like(w), p=0.5, training=True)
    assert_matches(out, (w * keep) @ v_h, 1e-12)


@both
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_float32_mask_extremes(backend, dtype, seed):
    """A float32 mask keeps its meaning with half inputs: finfo(float32).min is a
    (huge) bias, not -inf. The fused kernel would cast it to -inf, so sdpa
    refuses such a mask and says why; auto serves it with math."""
    q, k, v = make_qkv(seed, 2, 4, 2, 5, 6, 8, dtype=dtype)
    lo = torch.finfo(torch.float32).min
    m = torch.from_numpy(seed.standard_normal((5, 6))).float()
    m[0] = lo  # every key behind finfo.min: the reference averages them all
    m[1, :3] = lo
    m[2, 1] = float("-inf")
    m[3] = -1e5  # beyond float16's range: a cast to float16 would hide the whole row
    want, _ = run_reference(q, k, v, m)
    tol = (2e-3 if dtype == torch.float16 else 1.6e-2) * float(want.abs().max())
    out = attention(q, k, v, attn_mask=m, backend="auto" if backend == "sdpa" else backend)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    if backend == "sdpa":
        assert torch.equal(out, attention(q, k, v, attn_mask=m, backend="math"))
        with pytest.raises(ValueError, match=rf"'sdpa' cannot serve.*beyond {dtype}'s range"):
            attention(q, k, v, attn_mask=m, backend="sdpa")
    # Within the dtype's range the fused kernel serves it and agrees.
    m16 = m.clamp(min=torch.finfo(dtype).min / 2 if dtype == torch.float16 else -1e30)
    m16[0] = -1e4
    want, _ = run_reference(q, k, v, m16)
    out = attention(q, k, v, attn_mask=m16, backend=backend)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
