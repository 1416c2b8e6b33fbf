"""Old import path: these names live in ``multihead.modules.kinds.overlapping``."""

from .kinds.overlapping import OverlappingHeadAttention, overlapped_heads

__all__ = ["OverlappingHeadAttention", "overlapped_heads"]
