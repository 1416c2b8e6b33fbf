"""multihead: multi-head attention and the family that grew out of it.

The public API on one screen:

* ``multihead.reference``  NumPy float64 specification (readable, loops allowed)
* ``multihead.functional`` ``attention(q, k, v, ...)``, masks, backends
* ``multihead.textbook``   the tutorial classes with their exact signatures
* ``MultiHeadAttention``   the production module (MHA / GQA / MQA, cross, cache)
* ``KVCache``              static cache sized by key/value heads
* ``TorchMultiheadAttention`` drop-in for ``torch.nn.MultiheadAttention``
* ``build_attention(name, ...)`` attention kinds by name: mha, gqa, mqa, moh,
  dcmha, talking_heads, overlapping, collaborative, gated (docs/variants.md),
  and those of installed packages (entry points "multihead.attention_kinds");
  ``attention_class(name)`` answers what a kind can do, ``kind_options(name)``
  which options it takes
* ``multihead.convert.from_official`` weights from the variants' official code
* ``multihead.models``     GPT-2 family, encoder-decoder Transformer, BERT/MiniLM
* ``multihead.tools``      capture attention, head roles, views, head importance,
                           masking and pruning heads, MHA -> GQA conversion
* ``multihead.hf``         multihead as the attention of any Hugging Face
                           transformers model (imported on demand: docs/hf.md)
* ``UsageError``           a user's mistake (a ValueError), which the
                           ``multihead`` command prints as one line
"""

from . import convert, functional, models, reference, textbook, tools
from .errors import UsageError
from .functional import attention
from .modules import (
    DCMHA,
    AttentionLayer,
    CollaborativeAttention,
    GatedHeadAttention,
    MoHAttention,
    MultiHeadAttention,
    OverlappingHeadAttention,
    TalkingHeadsAttention,
)
from .modules.compat.torch_nn import TorchMultiheadAttention
from .modules.kv_cache import KVCache
from .modules.registry import (
    attention_class,
    build_attention,
    kind_options,
    list_attention_kinds,
    load_entry_point_kinds,
    register_attention,
)

__version__ = "0.1.0"

load_entry_point_kinds()  # kinds of installed packages (entry-point group "multihead.attention_kinds")

__all__ = [
    "attention",
    "functional",
    "models",
    "tools",
    "reference",
    "textbook",
    "AttentionLayer",
    "MultiHeadAttention",
    "MoHAttention",
    "DCMHA",
    "TalkingHeadsAttention",
    "OverlappingHeadAttention",
    "CollaborativeAttention",
    "GatedHeadAttention",
    "convert",
    "KVCache",
    "TorchMultiheadAttention",
    "build_attention",
    "list_attention_kinds",
    "attention_class",
    "kind_options",
    "register_attention",
    "UsageError",
    "__version__",
]
