"""Old import path: ``HeadRMSNorm`` and ``QKNorm`` live in ``multihead.modules.norms``,
``Rotary`` (the rope submodule of every attention layer) in ``multihead.modules.rope``."""

from .norms import HeadRMSNorm, QKNorm
from .rope import Rotary

__all__ = ["HeadRMSNorm", "QKNorm", "Rotary"]
