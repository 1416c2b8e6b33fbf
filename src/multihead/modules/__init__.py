"""nn.Modules, one file per attention kind."""

from .attention import MultiHeadAttention
from .kv_cache import KVCache
from .torch_compat import TorchMultiheadAttention

__all__ = ["MultiHeadAttention", "KVCache", "TorchMultiheadAttention"]
