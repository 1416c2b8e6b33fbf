"""RELIABILITY.md, call-time table: every bad input raises a typed error whose
message names the offending shapes or values, on every backend; odd layouts
(non-contiguous, stride 0, transposed) give correct results."""

import re

import pytest
import torch
from support.attention import BACKENDS, F64, assert_matches, check_against_reference, make_qkv, run_reference

from multihead.functional import (
    attention,
    causal_mask,
    merge_masks,
    padding_mask_from_ignore,
    padding_mask_from_lengths,
)

pytestmark = pytest.mark.parametrize("backend", BACKENDS)


def t(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


def shapes(**ts):
    return re.escape(", ".join(f"{n}={tuple(x.shape)}" for n, x in ts.items()))


# ------------------------------------------------------- q, k, v validation


def test_wrong_rank_names_each_shape(backend):
    q, k, v = t(2, 5, 8), t(2, 1, 7, 8), t(2, 1, 7, 8)
    with pytest.raises(ValueError, match="must be 4-D.*" + shapes(q=q, k=k, v=v)):
        attention(q, k, v, backend=backend)
    q, k, v = t(2, 1, 5, 8), t(2, 1, 7, 8), t(1, 2, 1, 7, 8)
    with pytest.raises(ValueError, match="must be 4-D.*" + shapes(q=q, k=k, v=v)):
        attention(q, k, v, backend=backend)


def test_mismatched_batch(backend):
    q, k, v = t(2, 4, 5, 8), t(3, 2, 7, 8), t(3, 2, 7, 8)
    with pytest.raises(ValueError, match="batch sizes differ: " + shapes(q=q, k=k, v=v)):
        attention(q, k, v, backend=backend)
    v = t(2, 2, 7, 8)
    with pytest.raises(ValueError, match="batch sizes differ"):
        attention(q, k[:2], v[:1], backend=backend)


def test_head_dim_mismatch(backend):
    q, k, v = t(2, 4, 5, 8), t(2, 2, 7, 6), t(2, 2, 7, 8)
    with pytest.raises(ValueError, match="q and k head dims differ: " + shapes(q=q, k=k)):
        attention(q, k, v, backend=backend)


def test_key_value_length_mismatch(backend):
    q, k, v = t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 6, 8)
    with pytest.raises(ValueError, match="key and value lengths differ: " + shapes(k=k, v=v)):
        attention(q, k, v, backend=backend)


@pytest.mark.parametrize("G", [3, 5, 0])
def test_kv_heads_must_divide_query_heads(backend, G):
    q, k, v = t(1, 4, 5, 8), t(1, G, 7, 8), t(1, G, 7, 8)
    with pytest.raises(ValueError, match=rf"G={G} must divide query heads H=4"):
        attention(q, k, v, backend=backend)


def test_k_v_head_counts_differ(backend):
    q, k, v = t(1, 4, 5, 8), t(1, 2, 7, 8), t(1, 4, 7, 8)
    with pytest.raises(ValueError, match="k and v head counts differ: " + shapes(k=k, v=v)):
        attention(q, k, v, backend=backend)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dtype_mismatch_names_dtypes(backend, which):
    qkv = {"q": t(1, 2, 3, 4), "k": t(1, 2, 5, 4), "v": t(1, 2, 5, 4)}
    qkv[which] = qkv[which].float()
    with pytest.raises(ValueError, match=r"dtypes differ:.*torch\.float32"):
        attention(**qkv, backend=backend)


def test_device_mismatch_meta(backend):
    """The meta device stands in for a second device on a CPU-only machine."""
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(ValueError, match="devices differ: cpu, meta, cpu"):
        attention(q, k.to("meta"), v, backend=backend)
    with pytest.raises(ValueError, match="attn_mask is on meta but q is on cpu"):
        attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool, device="meta"), backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_cuda(backend):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(ValueError, match="devices differ"):
        attention(q, k, v.cuda(), backend=backend)
    with pytest.raises(ValueError, match="attn_mask is on cuda"):
        attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool).cuda(), backend=backend)


@pytest.mark.parametrize("bad", [[[1.0]], 3.0, None])
def test_non_tensor_inputs_type_error(backend, bad):
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention(bad, t(1, 1, 2, 1), t(1, 1, 2, 1), backend=backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_floating_inputs_type_error(backend, dtype):
    k = torch.zeros(1, 1, 2, 3, dtype=dtype)
    with pytest.raises(TypeError, match=rf"k must be a floating tensor, got dtype {dtype}"):
        attention(t(1, 1, 2, 3), k, t(1, 1, 2, 3), backend=backend)


# ------------------------------------------------------------ mask validation

ACCEPTED = re.escape("accepted: (T, S) = (5, 7) or 4-D broadcastable to (B, H, T, S) = (2, 4, 5, 7)")


@pytest.mark.parametrize("mshape", [(2, 3, 5, 7), (3, 1, 1, 7), (1, 1, 5, 6), (2, 4, 7, 5), (1, 1, 1, 8)])
def test_mask_not_broadcastable(backend, mshape):
    q, k, v = t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8)
    for dtype in (torch.bool, F64):
        mask = torch.zeros(mshape, dtype=dtype)
        with pytest.raises(ValueError, match=re.escape(f"{mshape} does not broadcast") + ".*" + ACCEPTED):
            attention(q, k, v, attn_mask=mask, backend=backend)


@pytest.mark.parametrize("mshape", [(7, 7), (5, 5), (7, 5), (1, 7), (5, 1), (2, 7)])
def test_2d_mask_must_be_t_by_s(backend, mshape):
    q, k, v = t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8)
    with pytest.raises(ValueError, match=re.escape(f"2-D attn_mask must be (T, S); got {mshape}") + ".*" + ACCEPTED):
        attention(q, k, v, attn_mask=torch.ones(mshape, dtype=torch.bool), backend=backend)


@pytest.mark.parametrize("mshape", [(7,), (4, 5, 7), (2, 5, 7), (1, 2, 4, 5, 7), ()])
def test_masks_of_other_ranks_refused(backend, mshape):
    q, k, v = t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8)
    with pytest.raises(ValueError, match=re.escape(f"must be 2-D or 4-D, got shape {mshape}") + ".*" + ACCEPTED):
        attention(q, k, v, attn_mask=torch.ones(mshape, dtype=torch.bool), backend=backend)


def test_b_eq_t_eq_h_padding_mask_as_attn_mask(backend, seed):
    """B == T == H: a (B, S) padding mask cannot be told from a (T, S) mask by its
    shape, so it is read as (T, S) (never broadcast over batch), and every other
    way of passing it is refused; the padding builders give the (B, 1, 1, S) form."""
    B = H = T = 4
    S = 6
    q, k, v = make_qkv(seed, B, H, 2, T, S, 5)
    keep = torch.from_numpy(seed.random((B, S)) < 0.6)
    keep[:, 0] = True
    # Read as (T, S): row i of the mask applies to query i in every batch.
    check_against_reference(q, k, v, backend, attn_mask=keep)
    # The padding form differs from it (masks batch b's keys for every query).
    as_padding = attention(q, k, v, attn_mask=padding_mask_from_ignore(~keep), backend=backend)
    assert not torch.allclose(as_padding, attention(q, k, v, attn_mask=keep, backend=backend))
    check_against_reference(q, k, v, backend, attn_mask=keep[:, None, None, :])
    # (B, T, S), (B, S, T) and the transposed (S, B) are all refused.
    for bad in (keep[:, None, :].expand(B, T, S), keep.T, keep[:, :, None].expand(B, S, T)):
        with pytest.raises(ValueError, match=re.escape(str(tuple(bad.shape)))):
            attention(q, k, v, attn_mask=bad, backend=backend)
    # B == H != T: a (B, S) mask is refused.
    q2 = q[:, :, :3]
    with pytest.raises(ValueError, match=re.escape("2-D attn_mask must be (T, S); got (4, 6)")):
        attention(q2, k, v, attn_mask=keep, backend=backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_mask_type_error(backend, dtype):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(TypeError, match=rf"bool .* or floating .*got dtype {dtype}"):
        attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=dtype), backend=backend)


def test_mask_not_a_tensor(backend):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None, got list"):
        attention(q, k, v, attn_mask=[[True] * 5] * 3, backend=backend)


# ------------------------------------------------------- scalar arguments


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), True, "0.1", None])
def test_bad_dropout(backend, p):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(ValueError, match=re.escape(f"dropout_p must be a float in [0, 1), got dropout_p={p!r}")):
        attention(q, k, v, dropout_p=p, training=True, backend=backend)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), True, "0.5", [1.0]])
def test_bad_scale(backend, scale):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(ValueError, match=re.escape(f"scale must be a finite float or None, got {scale!r}")):
        attention(q, k, v, scale=scale, backend=backend)


@pytest.mark.parametrize("align", ["top-left", "bottom", "", None])
def test_bad_alignment(backend, align):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"causal_alignment must be one of \('top_left', 'bottom_right'\), got "
                       + re.escape(repr(align))):
        attention(q, k, v, is_causal=True, causal_alignment=align, backend=backend)


@pytest.mark.parametrize("flag", [1, 0, "yes", None])
def test_is_causal_must_be_bool(backend, flag):
    q, k, v = t(1, 2, 3, 4), t(1, 2, 5, 4), t(1, 2, 5, 4)
    with pytest.raises(TypeError, match=f"is_causal must be a bool, got {flag!r}"):
        attention(q, k, v, is_causal=flag, backend=backend)


# ----------------------------------------------- combined masks (AND rule)


def test_bool_mask_and_causal_combine_by_and(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 2, 7, 9, 5)
    mask = torch.from_numpy(seed.random((2, 1, 7, 9)) < 0.6)
    for align in ("top_left", "bottom_right"):
        both = attention(q, k, v, attn_mask=mask, is_causal=True, causal_alignment=align, backend=backend)
        anded = mask & causal_mask(7, 9, alignment=align)
        assert_matches(both, attention(q, k, v, attn_mask=anded, backend=backend), 1e-12)


@pytest.mark.parametrize("compute", [F64, torch.float32])
def test_padding_plus_attn_mask_two_finfo_min_planes(backend, compute, seed):
    """transformers#27114: two float32 finfo.min planes sum to -inf; the merged
    mask must still give finite results equal to the reference, including rows
    where every key is hidden twice (which then output 0)."""
    B, H, T, S = 3, 4, 6, 6
    q, k, v = make_qkv(seed, B, H, 2, T, S, 5, dtype=compute)
    lo = torch.finfo(torch.float32).min
    lengths = torch.tensor([6, 4, 0])
    pad = torch.zeros(B, 1, 1, S).masked_fill(~padding_mask_from_lengths(lengths, S, left=True), lo)
    causal = torch.zeros(T, S).masked_fill(~causal_mask(T, S), lo)
    causal[-1] = lo  # the last query is hidden from every key
    merged = merge_masks(pad, causal)
    hidden_twice = torch.isneginf(merged).all(-1)  # (B, 1, T)
    assert bool(hidden_twice[2, 0, -1]) and int(hidden_twice.sum()) == 1
    out = attention(q, k, v, attn_mask=merged, backend=backend)
    assert bool(torch.isfinite(out).all())
    want, _ = run_reference(q, k, v, merged)
    if compute == F64:
        assert_matches(out, want)
    else:
        torch.testing.assert_close(out.double(), want, rtol=1.3e-6, atol=1e-5)
    # Length 0, last query: every key hidden twice (-inf) -> output 0. The
    # other rows of batch 2 see keys hidden once (finfo.min, still visible).
    assert torch.equal(out[2, :, -1], torch.zeros_like(out[2, :, -1]))
    assert bool(out[2, :, :-1].abs().sum(-1).gt(0).all())
    # The bool forms merge by AND and give the same visibility.
    keep = padding_mask_from_lengths(lengths, S, left=True)
    anded = merge_masks(keep, causal_mask(T, S))
    assert torch.equal(anded, keep & causal_mask(T, S))
    check_against_reference(q.double(), k.double(), v.double(), backend, attn_mask=anded)


def test_bool_and_float_masks_merge(backend, seed):
    q, k, v = make_qkv(seed, 2, 4, 4, 5, 7, 3)
    keep = padding_mask_from_lengths([7, 3], 7)
    bias = torch.from_numpy(seed.standard_normal((5, 7)))
    merged = merge_masks(keep, bias)
    assert merged.dtype == F64 and merged.shape == (2, 1, 5, 7)
    want, _ = run_reference(q, k, v, bias[None, None].masked_fill(~keep, float("-inf")))
    assert_matches(attention(q, k, v, attn_mask=merged, backend=backend), want)


# ------------------------------------------- layouts: strides, views, stride 0


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    """Same values, transposed storage plus a stride-2 slice."""
    big = torch.empty(*x.shape[:-2], x.shape[-1], 2 * x.shape[-2], dtype=x.dtype)
    big[..., ::2] = x.transpose(-1, -2)
    return big[..., ::2].transpose(-1, -2)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_noncontiguous_inputs_and_masks(backend, kind, seed):
    B, H, G, T, S, D = 2, 4, 2, 7, 9, 5
    q, k, v = make_qkv(seed, B, H, G, T, S, D, 3)
    mask, kw = None, {}
    if kind == "causal":
        kw = {"is_causal": True, "causal_alignment": "bottom_right"}
    elif kind == "bool":
        mask = torch.from_numpy(seed.random((B, H, T, S)) < 0.6)
    elif kind == "float":
        mask = torch.from_numpy(seed.standard_normal((B, 1, T, S)))
    base = attention(q, k, v, attn_mask=mask, backend=backend, **kw)
    qn, kn, vn = (_noncontig(x) for x in (q, k, v))
    assert not any(x.is_contiguous() for x in (qn, kn, vn))
    mn = None if mask is None else _noncontig(mask)
    assert_matches(attention(qn, kn, vn, attn_mask=mn, backend=backend, **kw), base, 1e-12)
    # (B, T, H, D) storage viewed as (B, H, T, D), as a projection produces it.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches(attention(qt, kt, v, attn_mask=mask, backend=backend, **kw), base, 1e-12)


def test_expanded_stride0_inputs_and_masks(backend, seed):
    B, H, G, T, S, D = 3, 4, 2, 5, 6, 4
    q1, k1, v1 = make_qkv(seed, 1, H, G, T, S, D)
    q, k, v = q1.expand(B, H, T, D), k1.expand(B, G, S, D), v1[:, :, :1].expand(B, G, S, D)
    assert q.stride(0) == k.stride(0) == v.stride(2) == 0
    row = torch.from_numpy(seed.random((1, 1, 1, S)) < 0.7)
    row[..., 0] = True
    mask = row.expand(B, H, T, S)
    fmask = torch.from_numpy(seed.standard_normal((1, S))).expand(T, S)
    for m in (mask, fmask):
        got = attention(q, k, v, attn_mask=m, is_causal=True, backend=backend)
        want = attention(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=m.contiguous(),
                         is_causal=True, backend=backend)
        assert_matches(got, want, 1e-12)
        check_against_reference(q, k, v, backend, attn_mask=m, is_causal=True)


def test_noncontiguous_gqa_expand_over_heads(backend, seed):
    """k/v expanded along the head axis with stride 0 (G = H view of one head)."""
    q, k1, v1 = make_qkv(seed, 2, 4, 1, 5, 7, 3)
    k, v = k1.expand(2, 4, 7, 3), v1.expand(2, 4, 7, 3)
    assert_matches(attention(q, k, v, backend=backend), attention(q, k1, v1, backend=backend), 1e-12)
