"""Former home of the QK-norm and rope options: ``HeadRMSNorm`` and ``QKNorm``
live in ``multihead.modules.norms``, ``RotaryQK`` in ``multihead.modules.rotary_qk``."""

from .norms import HeadRMSNorm, QKNorm
from .rotary_qk import RotaryQK

__all__ = ["HeadRMSNorm", "QKNorm", "RotaryQK"]
