"""Cost accounting: formulas checked against counts taken from the modules."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.functional import causal_mask, sliding_window_mask
from multihead.modules.cost import visible_pairs
from multihead.tools.flops import attention_cost


@pytest.mark.parametrize("T,S,alignment", [(5, 5, "top_left"), (3, 7, "top_left"), (3, 7, "bottom_right"), (7, 3, "bottom_right")])
def test_visible_pairs_counts_the_causal_mask(T, S, alignment):
    assert visible_pairs(T, S, causal=True, alignment=alignment) == int(causal_mask(T, S, alignment=alignment).sum())
    assert visible_pairs(T, S, causal=False) == T * S


@pytest.mark.parametrize("T,S,window", [(1, 9, 4), (3, 7, 2), (5, 5, 3), (1, 2, 5)])
def test_a_window_counts_its_pairs_where_a_cached_call_puts_the_queries(T, S, window):
    """A windowed call with T < S runs over a cache: its queries are the last T positions (bottom-right)."""
    want = int(sliding_window_mask(T, S, window=window, alignment="bottom_right").sum())
    assert visible_pairs(T, S, causal=False, window=window) == visible_pairs(T, S, causal=True, window=window) == want


def _matmul_flops(module, x, **kwargs):
    """Count 2·M·N·K of every matmul/linear the call runs (torch's FLOP counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(x, backend="math", **kwargs)
    return counter.get_total_flops()


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_mha_cost_matches_the_module(num_kv_heads):
    m = MultiHeadAttention(24, 4, num_kv_heads=num_kv_heads)
    cost = m.cost(9, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters())
    assert cost.kv_cache_bytes_per_token == 2 * m.num_kv_heads * 6 * 2
    # the math backend computes every pair: compare the non-causal total with torch's counter
    assert cost.total_flops == _matmul_flops(m, torch.randn(2, 9, 24))


def test_causal_core_counts_only_visible_pairs():
    m = MultiHeadAttention(16, 2)
    full, causal = m.cost(8), m.cost(8, causal=True)
    assert causal.core_flops * 64 == full.core_flops * 36  # 36 of 64 pairs are visible
    assert causal.projection_flops == full.projection_flops


def test_attention_cost_by_name_at_gpt2_xl_size_without_allocating():
    cost = attention_cost("gqa", embed_dim=1600, num_heads=25, num_kv_heads=5, T=1024)
    assert cost.parameters == 1600 * (25 + 10) * 64 + (25 + 10) * 64 + 1600 * 1600 + 1600
    assert cost.kv_cache_bytes_per_token == 2 * 5 * 64 * 2
