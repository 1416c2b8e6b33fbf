"""multihead: multi-head attention and the family that grew out of it.

The public API on one screen:

* ``multihead.reference``  NumPy float64 specification (readable, loops allowed)
* ``multihead.functional`` ``attention(q, k, v, ...)``, masks, backends
* ``multihead.textbook``   the tutorial classes with their exact signatures
* ``MultiHeadAttention``   the production module (MHA / GQA / MQA, cross, cache)
* ``KVCache``              static cache sized by key/value heads;
  ``StreamingKVCache`` / ``streaming_cache`` (sink tokens + the last positions);
  ``WindowKVCache`` / ``window_cache`` (a local layer's last window positions)
* ``TorchMultiheadAttention`` drop-in for ``torch.nn.MultiheadAttention``
* ``build_attention(name, ...)`` attention kinds by name: mha, gqa, mqa, moh,
  dcmha, talking_heads, overlapping, collaborative, gated, mla (docs/variants.md),
  and those of installed packages (entry points "multihead.attention_kinds");
  ``attention_class(name)`` answers what a kind can do, ``kind_options(name)``
  which options it takes
* ``multihead.convert.from_official`` weights from the variants' official code
* ``multihead.models``     GPT-2 family, encoder-decoder Transformer, BERT/MiniLM
* ``multihead.tools``      capture attention, head roles, views, head importance,
                           masking and pruning heads, MHA -> GQA conversion
* ``multihead.hf``         multihead as the attention of any Hugging Face
                           transformers model (imported on demand: docs/hf.md),
                           and ``export_hf``: a GPT or MiniLM as a transformers
                           folder (docs/export.md)
* ``UsageError``           a user's mistake (a ValueError), which the
                           ``multihead`` command prints as one line

Each name is imported on first use, so ``import multihead`` alone imports
neither torch nor anything else heavy; the kinds of installed packages
(entry points "multihead.attention_kinds") are loaded with
``multihead.modules``, which every model and ``build_attention`` import.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Every public name is imported on first use (PEP 562), so ``import multihead``
# and ``multihead --help`` do not pay for torch until a name needs it.
_SUBMODULES = ("convert", "functional", "models", "reference", "textbook", "tools")
_NAMES = {
    "attention": "functional",
    "UsageError": "errors",
    "AttentionLayer": "modules",
    "MultiHeadAttention": "modules",
    "MoHAttention": "modules",
    "DCMHA": "modules",
    "TalkingHeadsAttention": "modules",
    "OverlappingHeadAttention": "modules",
    "CollaborativeAttention": "modules",
    "GatedHeadAttention": "modules",
    "MultiHeadLatentAttention": "modules",
    "KVCache": "modules",
    "StreamingKVCache": "modules",
    "streaming_cache": "modules",
    "WindowKVCache": "modules",
    "window_cache": "modules",
    "TorchMultiheadAttention": "modules",
    "build_attention": "modules.registry",
    "list_attention_kinds": "modules.registry",
    "attention_class": "modules.registry",
    "register_attention": "modules.registry",
    "load_entry_point_kinds": "modules.registry",
    "kind_options": "modules.registry",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        if _NAMES[name].startswith("modules"):  # registers every kind, then those of entry points
            importlib.import_module(f"{__name__}.modules")
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_NAMES})


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
    "MultiHeadLatentAttention",
    "convert",
    "KVCache",
    "StreamingKVCache",
    "streaming_cache",
    "WindowKVCache",
    "window_cache",
    "TorchMultiheadAttention",
    "build_attention",
    "list_attention_kinds",
    "attention_class",
    "kind_options",
    "register_attention",
    "UsageError",
    "__version__",
]
