"""Per-head RMS normalisation of queries and keys (QK-norm).

Each head vector of the queries and of the keys is RMS-normalised over its
D channels before the scores are formed, with one learned gain per channel
shared by all heads (one vector for q, one for k), as in OLMo-2, Gemma-3
and Qwen3:

    q [B, H, T, D] --q_norm--> q / sqrt(mean_D(q²) + eps) · q_norm.weight
    k [B, G, S, D] --k_norm--> k / sqrt(mean_D(k²) + eps) · k_norm.weight

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
from ..functional.rope import apply_rope, rope_options

__all__ = ["HeadRMSNorm", "QKNorm", "RotaryQK"]


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0.0 <= float(eps) < math.inf):
        raise ValueError(f"eps must be a finite float >= 0, got eps={eps!r}")
    return float(eps)


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last (head) dimension.

    y = x / sqrt(mean(x², last dim) + eps) · weight. Half-precision inputs
    (float16, bfloat16) are normalised and scaled in float32 and the result
    is cast back; float32 and float64 inputs stay in their dtype.

    Args:
        head_dim: D.
        eps: added to the mean square.
        elementwise_affine: learn ``weight`` [D] (initialised to ones);
            without it there is no parameter.
        device, dtype: of the weight.

    Raises:
        TypeError / ValueError: head_dim not a positive int, eps negative
            or not finite.
    """

    def __init__(
        self,
        head_dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = positive_int("head_dim", head_dim)
        self.eps = _check_eps(eps)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise [..., D] over D; returns the same shape and dtype."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"last dimension must be head_dim={self.head_dim}, got shape {tuple(x.shape)}")
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        y = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(work.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.head_dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"


class QKNorm(nn.Module):
    """RMSNorm of queries and keys per head, with separate gains.

    Args:
        head_dim: D.
        eps: added to the mean square.
        elementwise_affine: learn ``q_norm.weight`` and ``k_norm.weight``,
            each [D] and initialised to ones.
        device, dtype: of the weights.

    Example:
        >>> import torch
        >>> norm = QKNorm(8)
        >>> q, k = norm(torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8))
        >>> sorted(norm.state_dict())
        ['k_norm.weight', 'q_norm.weight']
    """

    def __init__(
        self,
        head_dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.q_norm = HeadRMSNorm(head_dim, eps, elementwise_affine, **factory)
        self.k_norm = HeadRMSNorm(head_dim, eps, elementwise_affine, **factory)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q [B, H, T, D] and k [B, G, S, D]; returns (q, k), same shapes and dtypes.

        Raises:
            ValueError: a last dimension other than head_dim.
        """
        return self.q_norm(q), self.k_norm(k)


class RotaryQK:
    """Mixin giving an attention kind the ``rope=`` and ``qk_norm=`` options.

    Call ``init_rotary_qk(rope, qk_norm, head_dim)`` in ``__init__`` (after
    ``nn.Module.__init__``); in ``forward``, after projecting, call
    ``normalize_and_rotate(q, k, positions=..., key_positions=...)`` with
    positions from ``_positions`` (offset by the cache length when
    decoding). Order: project -> qk_norm -> rope -> attention.
    """

    def init_rotary_qk(
        self, rope: bool | dict, qk_norm: bool, head_dim: int, *, device=None, dtype=None
    ) -> None:
        """Validate the options and create ``self.rope`` / ``self.qk_norm``.

        Raises:
            TypeError / ValueError: a non-bool ``qk_norm`` or invalid rope options.
        """
        self.rope = rope_options(rope, head_dim)
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm must be a bool, got qk_norm={qk_norm!r}")
        self.qk_norm = QKNorm(head_dim, device=device, dtype=dtype) if qk_norm else None

    def normalize_and_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply ``qk_norm`` and then ``rope`` (each only if enabled).

        Args:
            q: [B, H, T, D] projected queries.
            k: [B, G, S, D] projected keys.
            positions: of the queries, [T] or [B, T] (default 0 .. T-1).
            key_positions: of the keys, [S] or [B, S] (default 0 .. S-1).

        Returns:
            (q, k), same shapes; the inputs themselves when both are off.
        """
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if self.rope is not None:
            q = apply_rope(q, positions, **self.rope)
            k = apply_rope(k, key_positions, **self.rope)
        return q, k

    def _positions(
        self, positions: torch.Tensor | None, B: int, T: int, offset: int, device: torch.device
    ) -> torch.Tensor | None:
        """Query positions of this call: ``positions`` or offset .. offset + T - 1."""
        if positions is None:
            if self.rope is None or offset == 0:
                return None
            return torch.arange(offset, offset + T, device=device)
        if self.rope is None:
            raise ValueError("positions are only used with rope; construct the module with rope=True")
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dtype == torch.bool or positions.is_complex():
            raise TypeError(f"positions must be an integer or floating tensor, got dtype {positions.dtype}")
        if tuple(positions.shape) not in ((T,), (B, T), (1, T)):
            raise ValueError(f"positions must be [T] = [{T}] or [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
        return positions.to(device)

    def call_positions(
        self, positions: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor | None, kv_cache
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(query positions, key positions) of one call.

        Queries: ``positions``, or offset .. offset + T - 1 with offset the
        cache length before this call's write. Keys: the query positions in
        self-attention (``key`` is None), None (0 .. S-1) in cross-attention.
        """
        offset = 0 if kv_cache is None else kv_cache.length
        q_pos = self._positions(positions, query.shape[0], query.shape[1], offset, query.device)
        return q_pos, (q_pos if key is None else None)

    def rotate_call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        query: torch.Tensor,
        key: torch.Tensor | None,
        kv_cache,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``normalize_and_rotate`` with this call's positions; (q, k) unchanged
        when both options are off and no positions are given."""
        if self.rope is None and self.qk_norm is None and positions is None:
            return q, k
        q_pos, k_pos = self.call_positions(positions, query, key, kv_cache)
        return self.normalize_and_rotate(q, k, positions=q_pos, key_positions=k_pos)
