"""The fused backend's less common paths against the explicit one."""

from __future__ import annotations

import torch

from multihead.functional import attention

F64 = torch.float64


def _qkv(H: int, G: int, T: int, S: int):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(2, n, L, 4, dtype=F64, generator=g) for n, L in ((H, T), (G, S), (G, S)))


def test_a_float_mask_with_causality_equals_the_explicit_path():
    """catches: handing the kernel its own causal flag together with a float mask."""
    q, k, v = _qkv(H=2, G=2, T=4, S=4)
    bias = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(6))
    got = attention(q, k, v, attn_mask=bias, is_causal=True, backend="sdpa")
    torch.testing.assert_close(got, attention(q, k, v, attn_mask=bias, is_causal=True, backend="math"),
                               rtol=0, atol=1e-12)  # fmt: skip


def test_a_per_row_mask_with_grouped_heads_equals_the_explicit_path():
    """catches: a (T, S) mask left unfolded when the group's queries are folded into rows (T = 3)."""
    q, k, v = _qkv(H=4, G=2, T=3, S=5)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    got = attention(q, k, v, attn_mask=mask, backend="sdpa")
    torch.testing.assert_close(got, attention(q, k, v, attn_mask=mask, backend="math"), rtol=0, atol=1e-12)


def test_a_per_row_mask_over_one_key_with_grouped_heads_equals_the_explicit_path():
    """catches: a (T, 1) mask taken for a per-key mask because its last dim is 1."""
    q, k, v = _qkv(H=4, G=2, T=3, S=1)
    mask = torch.tensor([[True], [False], [True]])
    got = attention(q, k, v, attn_mask=mask, backend="sdpa")
    torch.testing.assert_close(got, attention(q, k, v, attn_mask=mask, backend="math"), rtol=0, atol=1e-12)
