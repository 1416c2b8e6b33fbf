"""Old import path: these names live in ``multihead.modules.kinds.gated``."""

from .kinds.gated import GatedHeadAttention, concrete_penalty

__all__ = ["GatedHeadAttention", "concrete_penalty"]
