"""multihead as an attention implementation inside Hugging Face transformers.

    import multihead.hf                      # registers "multihead"
    model = AutoModel.from_pretrained(path, attn_implementation="multihead")
    with multihead.hf.capture(model) as record:
        model(**batch)
    record.layers[0].weights                 # [B, H, T, S]
    with multihead.hf.head_mask(model, {2: [0, 5]}):
        model(**batch)                       # heads 0 and 5 of layer 2 silenced

Every attention layer of a model loaded with ``attn_implementation="multihead"``
calls ``attention_forward``, which hands the layer's projected queries, keys
and values to ``multihead.functional.attention``. Masks are built by
transformers' SDPA mask function (bool, True = may attend, or None with
``is_causal``), so they reach multihead unchanged and exactly; key/value heads
stay at G < H (no ``repeat_kv``). ``capture`` and ``head_gates`` act only on
the model they were given, and only while their ``with`` block runs.
"""

from .bridge import NAME, attention_forward, load_hf, register
from .scopes import capture, head_gates, head_mask

__all__ = ["NAME", "register", "attention_forward", "capture", "head_gates", "head_mask", "load_hf"]

register()
