"""Old import path: these names live in ``multihead.modules.compat.torch_nn``."""

from .compat.torch_nn import TorchMultiheadAttention

__all__ = ["TorchMultiheadAttention"]
