"""The stretched hard-concrete gate (Louizos, Welling and Kingma, arXiv:1712.01312),
as the gated heads of Voita et al. use it.

One gate per entry of ``log_alpha`` (any shape, usually [H])::

    sample:   u ~ U(eps, 1 - eps);  s = sigmoid((ln u - ln(1 - u) + log_alpha) / T)
    eval:     s = sigmoid(log_alpha)                   (no noise, no temperature)
    both:     g = clip(s (high - low) + low, 0, 1)     (low, high) = (-0.1, 1.1)
    P(g != 0) = clip(sigmoid(log_alpha - T ln(-low / high)), eps, 1 - eps)

The sum of P(g != 0) is the L0 penalty: the expected number of open gates,
differentiable in ``log_alpha``. Used by ``modules.kinds.gated`` (gates
inside the attention module) and ``tools.gate_importance`` (gates put on any
model's heads by a head hook).
"""

from __future__ import annotations

import math

import torch

__all__ = ["stretch", "eval_gates", "sample_gates", "open_probabilities", "TEMPERATURE", "STRETCH", "EPS"]

TEMPERATURE = 0.33
STRETCH = (-0.1, 1.1)
EPS = 1e-6


def stretch(s: torch.Tensor, limits: tuple[float, float] = STRETCH) -> torch.Tensor:
    """clip(s (high - low) + low, 0, 1), elementwise."""
    low, high = limits
    return (s * (high - low) + low).clamp(0.0, 1.0)


def eval_gates(log_alpha: torch.Tensor, limits: tuple[float, float] = STRETCH) -> torch.Tensor:
    """Deterministic gates, the shape of ``log_alpha``: clip(sigmoid(log_alpha) (high - low) + low, 0, 1)."""
    return stretch(torch.sigmoid(log_alpha), limits)


def sample_gates(
    log_alpha: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    *,
    temperature: float = TEMPERATURE,
    limits: tuple[float, float] = STRETCH,
    eps: float = EPS,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Training-time gates, differentiable in ``log_alpha``.

    Draws ``torch.rand(shape)`` (default: the shape of ``log_alpha``) from
    ``generator`` (default: torch's global generator), u = eps + (1 - 2 eps)
    rand; ``shape`` must broadcast with ``log_alpha`` (e.g. (N, H) for N
    samples of [H] gates).
    """
    shape = tuple(log_alpha.shape) if shape is None else shape
    u = torch.rand(shape, dtype=log_alpha.dtype, device=log_alpha.device, generator=generator)
    u = u * (1 - 2 * eps) + eps
    return stretch(torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / temperature), limits)


def open_probabilities(
    log_alpha: torch.Tensor,
    *,
    temperature: float = TEMPERATURE,
    limits: tuple[float, float] = STRETCH,
    eps: float = EPS,
) -> torch.Tensor:
    """P(g != 0), the shape of ``log_alpha``: clip(sigmoid(log_alpha - T ln(-low / high)), eps, 1 - eps)."""
    low, high = limits
    return torch.sigmoid(log_alpha - temperature * math.log(-low / high)).clamp(eps, 1 - eps)
