"""Per-layer attention options of a model: local and global layers in one stack.

``GPTConfig(layer_attention_options=[...])`` gives block l the options
``{**attention_options, **layer_attention_options[l % n]}``: a list of one
dict per block, or a shorter pattern repeated over the stack, e.g. gpt-oss's
alternating sliding / full layers::

    GPTConfig(..., attention="gqa", num_kv_heads=2, attention_options={"sinks": True},
              layer_attention_options=[{"window": 128}, {}])

The options are JSON values, so the list is saved and loaded with the config.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_layer_options", "layer_options"]


def check_layer_options(value: object, num_layers: int) -> list[dict[str, Any]] | None:
    """None, or a list of 1 .. num_layers dicts of option name -> value.

    Raises:
        TypeError / ValueError: another type, dicts with non-str keys, an
            empty list or one longer than the stack.
    """
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, dict) and all(isinstance(k, str) for k in d) for d in value):
        raise TypeError(f"layer_attention_options must be a list of dicts of option name -> value, got {value!r}")
    if not 1 <= len(value) <= num_layers:
        raise ValueError(f"layer_attention_options holds {len(value)} dicts; give 1 .. num_layers={num_layers} "
                         "(a shorter list repeats over the layers)")  # fmt: skip
    return [dict(d) for d in value]


def layer_options(base: dict[str, Any], per_layer: list[dict[str, Any]] | None, layer: int) -> dict[str, Any]:
    """The options of block ``layer``: ``base`` with that layer's entry over it."""
    return dict(base) if not per_layer else {**base, **per_layer[layer % len(per_layer)]}
