"""multihead as an attention implementation inside Hugging Face transformers.

    import multihead.hf                      # registers "multihead"
    model = AutoModel.from_pretrained(path, attn_implementation="multihead")
    with multihead.hf.capture(model) as record:
        model(**batch)
    record.layers[0].weights                 # [B, H, T, S]
    with multihead.hf.head_mask(model, {2: [0, 5]}):
        model(**batch)                       # heads 0 and 5 of layer 2 silenced
    with multihead.hf.head_hook(model, fn):  # fn(module, layer, out [B, H, T, Dv]) -> None or a replacement
        model(**batch)

Every attention layer of a model loaded with ``attn_implementation="multihead"``
calls ``attention_forward``, which hands the layer's projected queries, keys
and values to ``multihead.functional.attention``. Masks are built by
transformers' SDPA mask function (bool, True = may attend, or None with
``is_causal``), so they reach multihead unchanged and exactly; key/value heads
stay at G < H (no ``repeat_kv``). ``capture``, ``head_gates`` and ``head_hook`` act
only on the model they were given, and only while their ``with`` block runs.

Folders (``folders.py``): ``model_folder`` checks one, and
``load_sentence_encoder_folder`` / ``load_gpt2_folder`` read a BERT or GPT-2
folder into multihead's own models, without transformers (importing
``multihead.hf`` registers "multihead" only where transformers is
installed); ``load_transformers_folder`` is ``load_hf`` for a command.
``encoder_importance`` scores each head of a transformers model by ablation.
``multihead.tools.run_with_cache`` reaches a transformers model through
``activations.py`` (named q, k, v, pattern, z, attn_out and residuals).

Export (``export.py``): ``export_hf(model, folder)`` writes a multihead GPT
as a ``GPT2LMHeadModel`` folder and a BERT/MiniLM as a ``BertModel`` (and
sentence-transformers) folder; ``check_hf_export`` says why a model cannot
be written (docs/export.md).
"""

from importlib.util import find_spec

from .bridge import NAME, attention_forward, load_hf, register
from .export import check_hf_export, export_hf
from .folders import (
    load_gpt2_folder,
    load_sentence_encoder_folder,
    load_transformers_folder,
    model_folder,
    read_config,
    read_tokenizer,
)
from .importance import encoder_importance
from .scopes import capture, head_gates, head_hook, head_mask

__all__ = [
    "NAME", "register", "attention_forward", "capture", "head_gates", "head_mask", "head_hook", "load_hf", "model_folder",
    "read_config", "read_tokenizer", "load_sentence_encoder_folder", "load_gpt2_folder", "load_transformers_folder",
    "encoder_importance", "export_hf", "check_hf_export",
]  # fmt: skip

if find_spec("transformers") is not None:
    register()
