"""nn.Modules: ``base.AttentionLayer`` (the forward every kind shares) and one
file per attention kind beside it (attention.py: mha/gqa/mqa, moh.py,
dcmha.py, collaborative.py, overlapping.py, gated.py). Importing this package
registers every kind."""

from .attention import MultiHeadAttention
from .base import AttentionLayer
from .collaborative import CollaborativeAttention
from .dcmha import DCMHA, TalkingHeadsAttention
from .gated import GatedHeadAttention
from .kv_cache import KVCache
from .moh import MoHAttention
from .norms import QKNorm
from .overlapping import OverlappingHeadAttention
from .rotary import Rotary
from .torch_compat import TorchMultiheadAttention

__all__ = [
    "AttentionLayer",
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
    "Rotary",
]
