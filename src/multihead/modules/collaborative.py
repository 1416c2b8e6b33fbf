"""Old import path: these names live in ``multihead.modules.kinds.collaborative``."""

from .kinds.collaborative import CollaborativeAttention, Compression, concatenate_mixing

__all__ = ["CollaborativeAttention", "Compression", "concatenate_mixing"]
