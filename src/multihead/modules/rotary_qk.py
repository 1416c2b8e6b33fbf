"""The ``rope=`` and ``qk_norm=`` options shared by every attention kind.

Order inside a kind's forward: project -> qk_norm (``norms.QKNorm``) ->
rope (``functional.rope.apply_rope``) -> attention.
"""

from __future__ import annotations

import torch

from ..functional.rope import apply_rope, rope_options
from .norms import QKNorm

__all__ = ["RotaryQK"]


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
