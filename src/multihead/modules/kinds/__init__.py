"""One file per attention kind, each a subclass of ``base.AttentionLayer``
that supplies only its hooks; importing this package registers every kind.

    mha.py            MultiHeadAttention: "mha", "gqa", "mqa"
    moh.py            MoHAttention: "moh" (paths in moh_paths.py)
    dcmha.py          DCMHA, TalkingHeadsAttention: "dcmha", "talking_heads" (core in dcmha_core.py)
    collaborative.py  CollaborativeAttention: "collaborative" (conversion in collaborative_compress.py)
    overlapping.py    OverlappingHeadAttention: "overlapping"
    gated.py          GatedHeadAttention: "gated"
"""

from .collaborative import CollaborativeAttention
from .dcmha import DCMHA, TalkingHeadsAttention
from .gated import GatedHeadAttention
from .mha import MultiHeadAttention
from .moh import MoHAttention
from .overlapping import OverlappingHeadAttention

__all__ = [
    "MultiHeadAttention",
    "MoHAttention",
    "DCMHA",
    "TalkingHeadsAttention",
    "CollaborativeAttention",
    "OverlappingHeadAttention",
    "GatedHeadAttention",
]
