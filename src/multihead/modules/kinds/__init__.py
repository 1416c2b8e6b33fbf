"""One file per attention kind, each a subclass of ``base.AttentionLayer``
that supplies only its hooks; importing this package imports every module
in it, and so registers every kind (a new kind's file needs no line here).

    mha.py            MultiHeadAttention: "mha", "gqa", "mqa"
    moh.py            MoHAttention: "moh" (paths in moh_paths.py)
    dcmha.py          DCMHA, TalkingHeadsAttention: "dcmha", "talking_heads" (core in dcmha_core.py)
    collaborative.py  CollaborativeAttention: "collaborative" (conversion in collaborative_compress.py)
    overlapping.py    OverlappingHeadAttention: "overlapping"
    gated.py          GatedHeadAttention: "gated"
    mla.py            MultiHeadLatentAttention: "mla" (YaRN in mla_latent.py)
"""

import importlib
import pkgutil

from .collaborative import CollaborativeAttention
from .dcmha import DCMHA, TalkingHeadsAttention
from .gated import GatedHeadAttention
from .mha import MultiHeadAttention
from .mla import MultiHeadLatentAttention
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
    "MultiHeadLatentAttention",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # registers the kinds of files not named above
