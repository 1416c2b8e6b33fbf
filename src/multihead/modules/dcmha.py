"""Old import path: these names live in ``multihead.modules.kinds.dcmha``."""

from .kinds.dcmha import AUTO_CHUNK, DCMHA, DynamicKVCache, TalkingHeadsAttention

__all__ = ["DCMHA", "TalkingHeadsAttention", "DynamicKVCache", "AUTO_CHUNK"]
