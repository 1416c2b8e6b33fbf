"""Context managers on one model: ``capture`` its weights, gate its heads, replace their outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..functional import WeightSelection
from ..tools.capture import AttentionRecord
from .bridge import _SCOPES, NAME, _Scope

__all__ = ["capture", "head_gates", "head_mask", "head_hook"]


def _check_model(model: nn.Module) -> dict[int, str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(
            f"{type(model).__name__} runs attn_implementation={impl!r}, not {NAME!r}: load it with "
            f"attn_implementation={NAME!r} or call model.set_attn_implementation({NAME!r})"
        )
    return {id(m): name or type(m).__name__ for name, m in model.named_modules()}


@contextmanager
def _scoped(scope: _Scope) -> Iterator[_Scope]:
    token = _SCOPES.set(_SCOPES.get() + (scope,))
    try:
        yield scope
    finally:
        _SCOPES.reset(token)


@contextmanager
def capture(model: nn.Module, *, heads=None, rows=None) -> Iterator[AttentionRecord]:
    """Record the attention weights of every attention call inside ``model``.

    Entries come in call order; ``layer`` numbers the attention modules in
    the order they were first called (the model's layer order for
    ordinary models), ``name`` is the module's path. The record is the one
    ``multihead.tools`` reads, so the head explorer runs on it. Its
    ``attention_mask`` [B, S] is the padding of a padded batch (the keys the
    first call's mask hides from every query; None without padding), so the
    views show each item without it once ``query_tokens`` holds one token
    list per item.

    Args:
        model: a transformers model running ``attn_implementation="multihead"``.
        heads, rows: record only these query heads and rows (as
            ``tools.capture``; None: all). Only they are formed, from the
            fused kernel's log-sum-exp, unless ``output_attentions`` asks
            for every weight anyway.

    Yields:
        an ``AttentionRecord`` whose entries hold weights [B, H, T, S], or
        [B, h, r, S] with their ``heads`` and ``rows`` (float32, CPU, detached).

    Raises:
        ValueError: the model does not run the ``multihead`` implementation;
            heads or rows that are not ascending (beyond a call's H or T: at that call).
        TypeError: ``model`` is not a module; heads or rows of the wrong type.
    """
    names = _check_model(model)
    selection = WeightSelection(heads=heads, rows=rows)
    record = AttentionRecord(source=type(model).__name__)
    with _scoped(_Scope(module_names=names, record=record, selection=selection)):
        yield record


@contextmanager
def head_gates(model: nn.Module, gates: torch.Tensor) -> Iterator[torch.Tensor]:
    """Multiply each head's context by a gate while the block runs.

    Head h of the attention module with ``layer_idx`` l has its output
    [B, T, D] (before the output projection) multiplied by ``gates[l, h]``;
    gradients flow into ``gates`` (gradient head importance). Modules that
    share a ``layer_idx`` (self- and cross-attention of one decoder layer)
    share its row.

    Args:
        model: a transformers model running ``attn_implementation="multihead"``.
        gates: floating [L, H], L >= the number of layers.

    Yields:
        ``gates``.

    Raises:
        TypeError: ``gates`` is not a floating tensor.
        ValueError: ``gates`` is not 2-D; at call time, a layer index or head
            count that does not fit ``gates`` (with both shapes).
    """
    names = _check_model(model)
    if not isinstance(gates, torch.Tensor) or not gates.dtype.is_floating_point:
        got = gates.dtype if isinstance(gates, torch.Tensor) else type(gates).__name__
        raise TypeError(f"gates must be a floating tensor [L, H], got {got}")
    if gates.dim() != 2:
        raise ValueError(f"gates must be [L, H], got shape {tuple(gates.shape)}")
    with _scoped(_Scope(module_names=names, gates=gates)):
        yield gates


@contextmanager
def head_hook(model: nn.Module, fn: Callable) -> Iterator[None]:
    """Let ``fn`` see, and replace, every attention call's head outputs while the block runs.

    ``fn(module, layer, out)`` is called with the attention module, its
    ``layer`` (the attention modules numbered in the order they are first
    called inside the block, as ``capture`` and ``run_with_cache`` number
    them) and out [B, H, T, Dv]: each query head's context (its weights
    times its values), before the output projection (``o_proj``, GPT-2's
    ``c_proj``) merges the heads, after the gates of a ``head_gates`` block
    entered before. It returns None (keep ``out``) or a tensor of out's
    shape that the output projection reads instead: the transformers
    counterpart of ``AttentionLayer.register_head_hook``.

    Args:
        model: a transformers model running ``attn_implementation="multihead"``.
        fn: ``fn(module, layer, out) -> None or tensor [B, H, T, Dv]``.

    Raises:
        ValueError: the model does not run the ``multihead`` implementation;
            at call time, a returned tensor of another shape.
        TypeError: ``model`` is not a module, ``fn`` is not callable; at call
            time, ``fn`` returned something other than None or a tensor.
    """
    names = _check_model(model)
    if not callable(fn):
        raise TypeError(f"head hook must be callable, got {type(fn).__name__}")
    with _scoped(_Scope(module_names=names, replace=fn)):
        yield


def _count(config: object, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"{type(config).__name__} has none of {names}; pass gates to head_gates instead")


@contextmanager
def head_mask(model: nn.Module, heads: Mapping[int, Sequence[int]]) -> Iterator[torch.Tensor]:
    """Zero the listed heads while the block runs (``head_gates`` with 0/1 gates).

    Args:
        model: a transformers model running ``attn_implementation="multihead"``.
        heads: {layer_idx: [head, ...]} to silence.

    Yields:
        the gates [L, H] in use.

    Raises:
        ValueError: a layer or head out of range (with the valid range).
    """
    _check_model(model)
    config = model.config
    L = _count(config, "num_hidden_layers", "n_layer", "num_layers")
    H = _count(config, "num_attention_heads", "n_head", "num_heads")
    gates = torch.ones(L, H)
    for layer, listed in heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
            raise ValueError(f"layer {layer!r} out of range [0, {L})")
        for head in listed:
            if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < H:
                raise ValueError(f"head {head!r} of layer {layer} out of range [0, {H})")
            gates[layer, head] = 0.0
    with head_gates(model, gates):
        yield gates

