"""Old import path: these names live in ``multihead.modules.kinds.moh``."""

from .kinds.moh import MoHAttention, load_balancing_loss

__all__ = ["MoHAttention", "load_balancing_loss"]
