"""Old import path: these names live in ``multihead.modules.kinds.mha``."""

from .kinds.mha import MultiHeadAttention, check_heads

__all__ = ["MultiHeadAttention", "check_heads"]
