"""Shared fixtures for the whole test suite."""

import numpy as np
import pytest
import torch


@pytest.fixture
def seed():
    """Seed torch's global generator; return a seeded NumPy generator."""
    torch.manual_seed(0)
    return np.random.default_rng(0)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tests use small tensors: extra intra-op threads only add contention
    on a shared 2-core machine (the benchmarks set their own threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
