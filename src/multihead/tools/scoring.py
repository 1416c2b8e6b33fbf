"""The checks every head-scoring method makes (``tools.importance``, ``tools.gate_importance``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..modules.base import AttentionLayer
from .heads import attention_layers

__all__ = ["scored_inputs", "score_table", "check_scalar_loss", "check_all_ran"]


def scored_inputs(model: nn.Module, batches: Iterable) -> tuple[list[AttentionLayer], list]:
    """The model's attention layers and the batches as a list.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: no attention layer; no batches.
    """
    layers = attention_layers(model)
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: scoring heads needs at least one batch")
    return layers, batches


def score_table(layers: list[AttentionLayer]) -> torch.Tensor:
    """[L, Hmax] float64: zeros where layer i has head h, NaN past its last head (pruned layers)."""
    counts = [layer.num_heads for layer in layers]
    table = torch.full((len(layers), max(counts)), float("nan"), dtype=torch.float64)
    for i, n in enumerate(counts):
        table[i, :n] = 0.0
    return table


def check_scalar_loss(loss) -> torch.Tensor:
    """``loss`` as a 0-d floating-point tensor, or a TypeError/ValueError saying what it is."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}")
    if not loss.dtype.is_floating_point:
        raise TypeError(f"loss_fn must return a floating-point loss, got dtype {loss.dtype}")
    return loss.reshape(())


def check_all_ran(layers: list[AttentionLayer], calls: list[int]) -> None:
    """A ValueError naming the layers that ran no forward (``calls[i]`` = 0)."""
    idle = [i for i, n in enumerate(calls) if n == 0]
    if idle:
        raise ValueError(
            f"attention layers {idle} never ran their forward during loss_fn (of {len(layers)} layers); "
            "their heads cannot be scored"
        )
