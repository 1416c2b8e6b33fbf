"""nn.Modules, one file per attention kind."""

from .attention import MultiHeadAttention
from .collaborative import CollaborativeAttention
from .dcmha import DCMHA, TalkingHeadsAttention
from .gated import GatedHeadAttention
from .kv_cache import KVCache
from .moh import MoHAttention
from .norms import QKNorm
from .overlapping import OverlappingHeadAttention
from .torch_compat import TorchMultiheadAttention

__all__ = [
    "MultiHeadAttention",
    "KVCache",
    "TorchMultiheadAttention",
    "MoHAttention",
    "DCMHA",
    "TalkingHeadsAttention",
    "OverlappingHeadAttention",
    "CollaborativeAttention",
    "GatedHeadAttention",
    "QKNorm",
]
