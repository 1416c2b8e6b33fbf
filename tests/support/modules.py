"""Building modules with non-trivial, seeded weights for tests."""

from __future__ import annotations

import torch

from multihead import MultiHeadAttention

F64 = torch.float64


def random_module(seed: int = 0, **kwargs) -> MultiHeadAttention:
    """A MultiHeadAttention (float64 unless ``dtype`` is given) in eval mode
    whose weights and biases are all drawn from N(0, 0.5²), so bias bugs show."""
    torch.manual_seed(seed)
    m = MultiHeadAttention(dtype=kwargs.pop("dtype", F64), **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()
