"""Rotary positions at their edges and defaults (each test names the bug it catches)."""

from __future__ import annotations

import math

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.functional import apply_rope
from multihead.functional.rope import rope_frequencies

F64 = torch.float64


def test_the_default_base_is_10000_as_in_roformer_and_llama():
    """catches: another default base."""
    D, T = 8, 5
    cos, sin = rope_frequencies(D, T, dtype=F64)
    angles = torch.tensor([[m / 10000.0 ** (2 * i / D) for i in range(D // 2)] for m in range(T)], dtype=F64)
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-12)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-12)
    x = torch.randn(1, 1, T, D, dtype=F64)
    assert_paths_agree(apply_rope(x), apply_rope(x, base=10000.0))


def test_any_base_above_one_is_taken_and_one_is_refused():
    """catches: a stricter bound than base > 1."""
    cos, _ = rope_frequencies(4, 3, base=1.5, dtype=F64)
    assert math.isclose(float(cos[2, 1]), math.cos(2 / 1.5 ** 0.5), rel_tol=1e-12)
    with pytest.raises(ValueError, match="base must be a real number > 1, got base=1.0"):
        rope_frequencies(4, 3, base=1.0)


def test_rotary_dim_must_be_a_positive_even_int():
    """catches: rotary_dim 0 (no rotation at all) or True (an int to isinstance) slipping through."""
    x = torch.randn(1, 1, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even int <= head_dim=4, got rotary_dim=0"):
        apply_rope(x, rotary_dim=0)
    with pytest.raises(TypeError, match="rotary_dim must be an int or None, got rotary_dim=True"):
        apply_rope(x, rotary_dim=True)
    torch.testing.assert_close(apply_rope(x, rotary_dim=2)[..., 2:], x[..., 2:])  # the rest kept


def test_zero_positions_and_positions_shared_by_a_batch():
    """catches: max_len 0 refused; a [1, T] positions tensor refused for a batch of 3."""
    cos, sin = rope_frequencies(4, 0)
    assert cos.shape == sin.shape == (0, 2)
    x = torch.randn(3, 2, 5, 4, dtype=F64)
    shared = torch.arange(5)[None]  # (1, T): the same positions for every item
    torch.testing.assert_close(apply_rope(x, shared), apply_rope(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"positions must be \[T\] = \[5\] or \[B, T\] = \[3, 5\]"):
        apply_rope(x, torch.arange(5)[None].expand(2, 5))
