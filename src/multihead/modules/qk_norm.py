"""Old import path: ``HeadRMSNorm`` and ``QKNorm`` live in ``multihead.modules.norms``,
``Rotary`` (the rope submodule of every attention layer) in ``multihead.modules.rotary``."""

from .norms import HeadRMSNorm, QKNorm
from .rotary import Rotary

__all__ = ["HeadRMSNorm", "QKNorm", "Rotary"]
