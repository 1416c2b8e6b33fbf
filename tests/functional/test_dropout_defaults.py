"""Dropout in ``functional.attention`` acts only in training, and draws nothing at p = 0."""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.functional import attention

F64 = torch.float64
BACKENDS = ["math", "sdpa"]


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 2, 5, 4, dtype=F64, generator=g) for _ in range(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropout_rate_without_training_drops_nothing(backend):
    """catches: training defaulting to True (a rate given for later would drop at evaluation)."""
    q, k, v = _qkv()
    assert_paths_agree(attention(q, k, v, dropout_p=0.5, backend=backend), attention(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_at_rate_zero_draws_no_random_numbers(backend):
    """catches: a dropout call at p = 0 (the docstring promises no draws: a run's random stream stays as it was)."""
    q, k, v = _qkv()
    state = torch.get_rng_state()
    attention(q, k, v, dropout_p=0.0, training=True, backend=backend)
    assert torch.equal(torch.get_rng_state(), state)
