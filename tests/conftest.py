"""Shared fixtures for the whole test suite."""

import numpy as np
import pytest
import torch


@pytest.fixture
def seed():
    """Seed torch's global generator; return a seeded NumPy generator."""
    torch.manual_seed(0)
    return np.random.default_rng(0)
