"""Per-layer head counts of a model config (the layout left by head pruning).

A config that says ``num_heads=H`` (and ``num_kv_heads=G``) builds every
layer with H query heads and G key/value heads of width D = C // H. After
``tools.prune.prune_heads`` the layers differ; the config then also lists
each layer's counts, and D stays that of the unpruned H::

    num_heads = 4 (D = C // 4)     layer_heads    = [4, 3, 1]
    num_kv_heads = 2               layer_kv_heads = [2, 2, 1]     (GQA only)

``layer_heads=None`` (the default) is the uniform layout; such configs
serialise exactly as before the fields existed. Only kinds whose heads are
independent of each other (``independent_heads`` on the kind's class) take
per-layer counts.
"""

from __future__ import annotations

from typing import Any

from .._checks import positive_int
from ..modules.registry import attention_class

__all__ = ["check_layer_heads", "layer_head_options", "plain_multi_head"]


def _counts(name: str, values: object, num_layers: int) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of {num_layers} ints (one per layer) or None, got {name}={values!r}")
    if len(values) != num_layers:
        raise ValueError(f"{name} must list one count per layer ({num_layers}), got {len(values)}: {list(values)}")
    return [positive_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def check_layer_heads(
    *,
    attention: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    layer_heads: object,
    layer_kv_heads: object,
) -> tuple[list[int] | None, list[int] | None]:
    """Validate per-layer head counts; return them as lists (or None).

    Rules: ``layer_heads[i]`` in [1, num_heads]; ``layer_kv_heads`` only
    together with ``layer_heads`` and ``num_kv_heads``, each in
    [1, num_kv_heads]; a layer's key/value count (its own, else
    ``num_kv_heads``) divides its query count; only kinds with ``independent_heads``.

    Raises:
        TypeError: not a list of ints.
        ValueError: a wrong length, a count out of range, a key/value count
            that does not divide the query count, or another attention kind
            (each message names the values).
    """
    if layer_heads is None:
        if layer_kv_heads is not None:
            raise ValueError(f"layer_kv_heads={layer_kv_heads!r} needs layer_heads (got None)")
        return None, None
    cls = attention_class(attention)
    if not cls.independent_heads:
        raise ValueError(
            f"per-layer head counts (layer_heads) need an attention kind with independent heads; "
            f"attention={attention!r} has none: {cls.head_independence}"
        )
    heads = _counts("layer_heads", layer_heads, num_layers)
    too_many = {i: h for i, h in enumerate(heads) if h > num_heads}
    if too_many:
        raise ValueError(f"layer_heads may not exceed num_heads={num_heads}; layers {too_many} do")
    kv = None
    if layer_kv_heads is not None:
        if num_kv_heads is None:
            raise ValueError(f"layer_kv_heads={layer_kv_heads!r} needs num_kv_heads (got None)")
        kv = _counts("layer_kv_heads", layer_kv_heads, num_layers)
        too_many = {i: g for i, g in enumerate(kv) if g > num_kv_heads}
        if too_many:
            raise ValueError(f"layer_kv_heads may not exceed num_kv_heads={num_kv_heads}; layers {too_many} do")
    if num_kv_heads is not None:
        groups = kv or [num_kv_heads] * num_layers
        bad = {i: (h, g) for i, (h, g) in enumerate(zip(heads, groups)) if h % g}
        if bad:
            raise ValueError(
                "each layer's key/value head count must divide its query head count; "
                f"(layer_heads, key/value heads) of layers {bad} do not"
            )
    return heads, kv


def layer_head_options(config: Any, layer: int) -> dict[str, int]:
    """Head options of layer ``layer``'s attention for ``build_attention``.

    ``config`` has ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``layer_heads`` and ``layer_kv_heads`` (``GPTConfig``, ``BertConfig``).
    Returns ``num_heads`` and, where set, ``num_kv_heads``; with per-layer
    counts also ``head_dim`` (that of the unpruned ``num_heads``).
    """
    options = {"num_heads": config.num_heads}
    if config.num_kv_heads is not None:
        options["num_kv_heads"] = config.num_kv_heads
    if config.layer_heads is not None:
        options["num_heads"] = config.layer_heads[layer]
        options["head_dim"] = config.head_dim
        if config.layer_kv_heads is not None:
            options["num_kv_heads"] = config.layer_kv_heads[layer]
    return options


def plain_multi_head(config: Any) -> bool:
    """Whether ``config``'s layers are "mha" with one key/value head per query head:
    the only layout Hugging Face's GPT-2 and BERT weights hold (their fused or
    separate q, k, v projections are H heads each, and no other kind's weights)."""
    return config.attention == "mha" and config.num_kv_heads in (None, config.num_heads)
