"""Rotary position embeddings as a submodule of an attention layer.

``Rotary`` holds validated ``apply_rope`` options and rotates one tensor of
heads at given positions; it has no parameters or buffers, so it never
enters a state_dict. An attention layer has ``self.rope`` = a ``Rotary`` or
None, and ``self.qk_norm`` = a ``norms.QKNorm`` or None; its forward calls
them in the order project -> qk_norm -> rope -> attention
(``AttentionLayer.position_qk``).

    rope = Rotary.from_option(True, head_dim=64)      # or None when off
    q = rope(q, positions)                            # [B, H, T, D], positions [T] or [B, T]
    rope["base"], dict(rope)                          # read like the options dict
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..functional.rope import apply_rope, rope_options

__all__ = ["Rotary", "query_positions"]


class Rotary(nn.Module):
    """Rotate the first ``rotary_dim`` channels of heads by their positions.

    Args:
        options: validated ``apply_rope`` keywords ``base``, ``interleaved``,
            ``rotary_dim`` (from ``functional.rope.rope_options``).

    Attributes:
        options: those keywords (a dict); the module also reads like it
            (``rope["base"]``, ``dict(rope)``, ``**rope``).
    """

    def __init__(self, options: dict) -> None:
        super().__init__()
        self.options = dict(options)

    @classmethod
    def from_option(cls, rope: bool | dict | None, head_dim: int) -> Rotary | None:
        """A ``Rotary`` for a layer's ``rope=`` option (False/None: None).

        Raises:
            TypeError / ValueError: invalid options (``rope_options``).
        """
        options = rope_options(rope, head_dim)
        return None if options is None else cls(options)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x [..., L, D] rotated at ``positions`` ([L] or [B, L]; None: 0 .. L-1)."""
        return apply_rope(x, positions, **self.options)

    def __getitem__(self, name: str):
        return self.options[name]

    def keys(self) -> Iterator[str]:
        return iter(self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.items())


def query_positions(
    positions: torch.Tensor | None, *, rope: Rotary | None, B: int, T: int, offset: int, device: torch.device
) -> torch.Tensor | None:
    """Rope positions of the T queries of one call.

    ``positions`` as given, or offset .. offset + T - 1 (None when that is
    0 .. T-1, the rope default).

    Raises:
        ValueError: positions without rope, or of a shape other than [T] / [B, T].
        TypeError: positions that are not an integer or floating tensor.
    """
    if positions is None:
        if rope is None or offset == 0:
            return None
        return torch.arange(offset, offset + T, device=device)
    if rope is None:
        raise ValueError("positions are only used with rope; construct the module with rope=True")
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer or floating tensor, got dtype {positions.dtype}")
    if tuple(positions.shape) not in ((T,), (B, T), (1, T)):
        raise ValueError(f"positions must be [T] = [{T}] or [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
    return positions.to(device)
