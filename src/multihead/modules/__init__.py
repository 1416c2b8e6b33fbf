"""nn.Modules of attention.

    base.py        AttentionLayer: the forward every kind shares
    hooked_layer.py  HookedLayer, AttentionLayer's base: observers and head hooks
    kinds/         one file per attention kind (importing it registers every kind)
    kv_cache.py    the cache classes; norms.py, rope.py: the qk_norm / rope submodules
    streaming_cache.py  StreamingKVCache: sink tokens + a window of the last positions
    graph_cache.py GraphKVCache: one-token steps of one fixed shape (CUDA graphs)
    window_cache.py  WindowKVCache (+ DCMHA's, MLA's latent): a local layer's last window positions (window_cache)
    local.py       the shared options sinks and window
    observe.py     observer events; cost.py: cost conventions; registry.py: kinds by name
    projections.py, calls.py: pieces the kinds share
    compat/        the torch.nn.MultiheadAttention drop-in
"""

from .base import AttentionLayer
from .compat import TorchMultiheadAttention
from .graph_cache import GraphKVCache, supports_graph_steps
from .kinds import (
    DCMHA,
    CollaborativeAttention,
    GatedHeadAttention,
    MoHAttention,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    OverlappingHeadAttention,
    TalkingHeadsAttention,
)
from .kv_cache import KVCache, LatentKVCache
from .norms import QKNorm
from .registry import load_entry_point_kinds
from .rope import Rotary
from .streaming_cache import StreamingKVCache, streaming_cache
from .window_cache import WindowDynamicKVCache, WindowKVCache, WindowLatentKVCache, window_cache

__all__ = [
    "AttentionLayer",
    "MultiHeadAttention",
    "KVCache",
    "StreamingKVCache",
    "streaming_cache",
    "GraphKVCache",
    "supports_graph_steps",
    "WindowKVCache",
    "WindowDynamicKVCache",
    "WindowLatentKVCache",
    "window_cache",
    "TorchMultiheadAttention",
    "MoHAttention",
    "DCMHA",
    "TalkingHeadsAttention",
    "OverlappingHeadAttention",
    "CollaborativeAttention",
    "GatedHeadAttention",
    "MultiHeadLatentAttention",
    "LatentKVCache",
    "QKNorm",
    "Rotary",
]

load_entry_point_kinds()  # kinds of installed packages (entry-point group "multihead.attention_kinds")
