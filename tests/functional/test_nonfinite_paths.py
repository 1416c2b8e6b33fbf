"""Non-finite keys on the less common mask paths: a per-head mask with grouped key/value
heads, and top-left causality with more queries than keys. A row that cannot see the NaN
is finite and equals the result with the NaN replaced; a row that can see it is NaN."""

from __future__ import annotations

import pytest
import torch

from multihead.functional import attention

F64 = torch.float64


def _qkv(H: int, G: int, T: int, S: int):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, n, L, 4, dtype=F64, generator=g) for n, L in ((H, T), (G, S), (G, S)))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("H, G", [(4, 2), (2, 1)])
def test_a_per_head_mask_hides_a_nan_key_from_some_heads_of_a_group(backend, H, G):
    """catches: taking the per-key fast path for a mask that differs between heads."""
    q, k, v = _qkv(H=H, G=G, T=3, S=5)
    k[0, 0, 2] = float("nan")  # key 2 of group 0 (query heads 0 and 1)
    mask = torch.ones(1, H, 1, 5, dtype=torch.bool)
    mask[0, 0, 0, 2] = False  # head 0 may not see key 2; head 1 may
    out = attention(q, k, v, attn_mask=mask, backend=backend)
    clean = attention(q, k.nan_to_num(0.0), v, attn_mask=mask, backend=backend)
    assert out[0, 1].isnan().all()  # head 1 sees the NaN in every row
    others = [h for h in range(H) if h != 1]
    torch.testing.assert_close(out[0, others], clean[0, others], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_top_left_causal_with_more_queries_than_keys_keeps_clean_groups_finite(backend):
    """catches: rows past the last key counted as seeing a flag that no key of their group has."""
    q, k, v = _qkv(H=2, G=2, T=4, S=2)
    v[0, 0, 1] = float("inf")  # group 0's last key holds an inf value; group 1 is clean
    out = attention(q, k, v, is_causal=True, backend=backend)
    clean = attention(q, k, v.nan_to_num(0.0, 0.0, 0.0), is_causal=True, backend=backend)
    torch.testing.assert_close(out[0, 1], clean[0, 1], rtol=0, atol=1e-12)  # group 1: every row finite
    assert torch.isfinite(out[0, 0, 0]).all() and not torch.isfinite(out[0, 0, 1:]).all(dim=-1).any()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_a_mask_that_differs_between_query_rows_hides_a_nan_key_from_one_row(backend):
    """catches: reading only the first row of a (T, S) mask when deciding who sees a NaN."""
    q, k, v = _qkv(H=2, G=1, T=2, S=3)
    k[0, 0, 2] = float("nan")
    mask = torch.tensor([[True, True, False], [True, True, True]])  # row 0 cannot see key 2, row 1 can
    out = attention(q, k, v, attn_mask=mask, backend=backend)
    clean = attention(q, k.nan_to_num(0.0), v, attn_mask=mask, backend=backend)
    torch.testing.assert_close(out[0, :, 0], clean[0, :, 0], rtol=0, atol=1e-12)
    assert out[0, :, 1].isnan().all()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("part", [0, 1, 2])
def test_views_of_one_fused_buffer_are_checked_in_every_part(backend, part):
    """catches: the check reading only part of a fused [B, T, 3, H, D] buffer
    (q, k and v are views of it, checked through their base)."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 4, 3, 2, 4, dtype=F64, generator=g)  # (B, T, 3, H, D)
    clean = attention(*(t.transpose(1, 2) for t in qkv.unbind(2)), is_causal=True, backend=backend)
    qkv[0, 3, part, 1, 2] = float("nan")  # the last position: in every earlier row's future
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # 3 x (B, H, T, D), views of qkv
    out = attention(q, k, v, is_causal=True, backend=backend)
    torch.testing.assert_close(out[0, :, :3], clean[0, :, :3], rtol=0, atol=1e-12)  # rows 0-2 cannot see it
    assert out[0, 1 if part == 0 else slice(None), 3].isnan().any()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("mask_shape", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, 5)], ids=["one", "per-batch", "per-key"])
@pytest.mark.parametrize("fill", [0.5, float("-inf")], ids=["finite", "hides-all"])
def test_causal_calls_with_a_mask_broadcast_over_the_keys_match_the_reference(backend, alignment, mask_shape, fill):
    """catches: prefix sums over the keys of a mask whose key dimension is 1 (broadcast), which
    gave an empty slice and a shape error instead of the output."""
    from support.attention import check_against_reference

    q, k, v = (t.expand(2, -1, -1, -1).clone() for t in _qkv(H=2, G=1, T=3, S=5))
    q[0, 0, 0, 1], k[1, 0, 3, 0], v[0, 0, 4, 2] = float("nan"), float("nan"), float("-inf")
    mask = torch.full(mask_shape, fill, dtype=F64)
    check_against_reference(q, k, v, backend, attn_mask=mask, is_causal=True, causal_alignment=alignment)
