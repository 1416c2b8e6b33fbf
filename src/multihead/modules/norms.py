"""Per-head RMS normalisation of queries and keys (QK-norm).

Each head vector of the queries and of the keys is RMS-normalised over its
D channels before the scores are formed, with one learned gain per channel
shared by all heads (one vector for q, one for k), as in OLMo-2, Gemma-3
and Qwen3:

    q [B, H, T, D] --q_norm--> q / sqrt(mean_D(q²) + eps) · q_norm.weight
    k [B, G, S, D] --k_norm--> k / sqrt(mean_D(k²) + eps) · k_norm.weight

With ``unit_offset`` the gain is (1 + weight), the weight starting at zero
(Qwen3-Next's and Gemma's parametrisation): the same function, stored as the
offset from one, so a low-precision weight keeps its small digits.

Keeps the logits q·k/√D bounded whatever the scale of the projections
(Dehghani et al. 2023, "Scaling Vision Transformers to 22B parameters";
Henry et al. 2020, "Query-Key Normalization for Transformers").
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .._checks import positive_int

__all__ = ["HeadRMSNorm", "QKNorm"]


def check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0.0 <= float(eps) < math.inf):
        raise ValueError(f"eps must be a finite float >= 0, got eps={eps!r}")
    return float(eps)


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last (head) dimension.

    y = x / sqrt(mean(x², last dim) + eps) · weight, or · (1 + weight) with
    ``unit_offset``. Half-precision inputs (float16, bfloat16) are
    normalised and scaled in float32 (the gain too) and the result is cast
    back; float32 and float64 inputs stay in their dtype.

    Args:
        head_dim: D.
        eps: added to the mean square.
        elementwise_affine: learn ``weight`` [D] (initialised to ones, or to
            zeros with ``unit_offset``); without it there is no parameter.
        unit_offset: the gain is 1 + weight.
        device, dtype: of the weight.

    Raises:
        TypeError / ValueError: head_dim not a positive int, eps negative
            or not finite, unit_offset not a bool.
    """

    def __init__(
        self,
        head_dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        *,
        unit_offset: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = positive_int("head_dim", head_dim)
        self.eps = check_eps(eps)
        if not isinstance(unit_offset, bool):
            raise TypeError(f"unit_offset must be a bool, got unit_offset={unit_offset!r}")
        self.unit_offset = unit_offset
        if elementwise_affine:
            init = torch.zeros if unit_offset else torch.ones
            self.weight = nn.Parameter(init(head_dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise [..., D] over D; returns the same shape and dtype."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"last dimension must be head_dim={self.head_dim}, got shape {tuple(x.shape)}")
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        y = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight is not None:
            gain = self.weight.to(work.dtype)
            y = y * (1.0 + gain if self.unit_offset else gain)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        offset = ", unit_offset=True" if self.unit_offset else ""
        return f"{self.head_dim}, eps={self.eps}, elementwise_affine={self.weight is not None}{offset}"


class QKNorm(nn.Module):
    """RMSNorm of queries and keys per head, with separate gains.

    Args:
        head_dim: D.
        eps: added to the mean square.
        elementwise_affine: learn ``q_norm.weight`` and ``k_norm.weight``,
            each [D] and initialised to ones (zeros with ``unit_offset``).
        unit_offset: the gains are 1 + weight (``HeadRMSNorm``).
        device, dtype: of the weights.

    Example:
        >>> import torch
        >>> norm = QKNorm(8)
        >>> q, k = norm(torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8))
        >>> sorted(norm.state_dict())
        ['k_norm.weight', 'q_norm.weight']
    """

    def __init__(self, head_dim: int, eps: float = 1e-6, elementwise_affine: bool = True, **options) -> None:
        super().__init__()  # options: unit_offset, device, dtype (HeadRMSNorm's)
        self.q_norm = HeadRMSNorm(head_dim, eps, elementwise_affine, **options)
        self.k_norm = HeadRMSNorm(head_dim, eps, elementwise_affine, **options)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q [B, H, T, D] and k [B, G, S, D]; returns (q, k), same shapes and dtypes.

        Raises:
            ValueError: a last dimension other than head_dim.
        """
        return self.q_norm(q), self.k_norm(k)
