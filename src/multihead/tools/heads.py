"""Per-head surgery on any multihead model through the layers' head hooks.

    layers = attention_layers(model)            # [AttentionLayer, ...], model order
    with mask_heads(model, {0: [1, 3], 2: [0]}):
        loss = loss_fn(model, batch)            # heads 1, 3 of layer 0 and 0 of layer 2 off

A masked head's context (its attention weights times its values, out
[B, H, T, Dv] before ``merge_heads``) is replaced by zeros, which is what
the official head-masking code does by multiplying that head's attention
probabilities by xi_h = 0 (Michel et al., 2019): the head then contributes
nothing to ``out_proj``, exactly as if its input columns of ``out_proj``
were zero (the bias stays). Zeros are written with ``masked_fill``, so a
masked head is zero even where its values hold NaN or inf.

Layers are numbered in ``model.named_modules()`` order, the forward order of
every model in multihead (GPT blocks, BERT layers), and the order
``tools.capture`` uses. For GQA/MQA the heads are the H query heads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..modules.base import AttentionLayer
from .capture import attention_modules

__all__ = ["attention_layers", "mask_heads", "check_head_table", "check_index", "eval_mode"]


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every attention layer inside ``model`` (or ``model`` itself), in model order.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: it contains no attention layer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = [m for _, m in attention_modules(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} contains no multihead attention layer")
    return layers


def check_index(name: str, value: object, upper: int, where: str) -> int:
    """``value`` as an index in [0, upper); ``where`` ends the error message.

    Raises:
        TypeError: not an int (bools refused). ValueError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {name}={value!r}{where}")
    if not 0 <= value < upper:
        raise ValueError(f"{name}={value} out of range [0, {upper}){where}")
    return value


def check_head_table(heads: Mapping, layers: list[AttentionLayer]) -> dict[int, list[int]]:
    """Validate ``{layer_index: [head, ...]}`` against ``layers``; return it as
    a dict of sorted, de-duplicated head lists.

    Raises:
        TypeError: not a mapping, or a layer/head index that is not an int.
        ValueError: a layer or head index out of range (with the valid range).
    """
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads must be a mapping {{layer_index: [head, ...]}}, got {type(heads).__name__}")
    table: dict[int, list[int]] = {}
    for layer, chosen in heads.items():
        i = check_index("layer index", layer, len(layers), f" ({len(layers)} attention layers)")
        if isinstance(chosen, (str, bytes)) or not hasattr(chosen, "__iter__"):
            raise TypeError(f"heads[{layer}] must be a list of head indices, got {chosen!r}")
        H = layers[i].num_heads
        table[i] = sorted({check_index("head", h, H, f" in layer {i} with {H} heads") for h in chosen})
    return table


@contextmanager
def mask_heads(model: nn.Module, heads: Mapping) -> Iterator[list[AttentionLayer]]:
    """Zero the context of the given heads during the block.

    Args:
        model: a module containing multihead attention layers.
        heads: ``{layer_index: [head, ...]}`` (layer indices as in
            :func:`attention_layers`; an empty list masks nothing).

    Yields:
        the model's attention layers.

    Raises:
        TypeError / ValueError: see :func:`check_head_table`, and a model
            without attention layers.
    """
    layers = attention_layers(model)
    table = check_head_table(heads, layers)
    handles = []
    try:
        for i, chosen in table.items():
            if chosen:
                handles.append(layers[i].register_head_hook(_zero_heads(chosen, layers[i].num_heads)))
        yield layers
    finally:
        for handle in handles:
            handle.remove()


def _zero_heads(chosen: list[int], num_heads: int):
    masked = torch.zeros(num_heads, dtype=torch.bool)
    masked[chosen] = True

    def hook(layer: AttentionLayer, out: torch.Tensor) -> torch.Tensor:
        hide = masked.to(out.device)[None, :, None, None]  # (H,) -> (1, H, 1, 1)
        return out.masked_fill(hide, 0.0)

    return hook


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside (no dropout); every submodule's own training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
