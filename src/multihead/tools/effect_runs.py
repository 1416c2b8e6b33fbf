"""The forwards of ``head_effects``: a model's attention layers, each run with some heads replaced.

    runs = effect_runs(model)                         # multihead layers or a transformers model
    output, z = runs.forward(clean, record=[0, 2])    # z[i]: layer i's head outputs [B, H, T, Dv]
    output, _ = runs.forward(clean, hooks={1: fn})    # layer 1's out [B, H, T, Dv] -> fn(out) (None: kept)

Two kinds of model run the same way:

* a module holding multihead attention layers: head outputs are seen and
  replaced through ``AttentionLayer.register_head_hook``; layers are
  numbered as ``tools.heads.attention_layers`` numbers them, each with its
  own head count;
* a transformers model running ``attn_implementation="multihead"``: through
  ``multihead.hf.head_hook``; layers are numbered in the order the
  attention modules are first called in a forward (as ``multihead.hf.capture``
  and ``run_with_cache`` number them), L and H come from the config, and
  ``use_cache=False`` goes to a forward that takes it (an output holding a
  key/value cache could not be split per intervention).

What a forward records is what ``run_with_cache(model, ..., names=["z"],
layers=record)`` records: the one recording path of head outputs. Every
forward also counts each layer's calls, since an intervention applies to
one call per layer: a layer that did not run exactly once is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .capture import attention_modules
from .heads import check_head_table
from .run_with_cache import run_with_cache

__all__ = ["EffectRuns", "effect_runs"]


@dataclass
class EffectRuns:
    """One model as ``head_effects`` runs it.

    Attributes:
        model: the model, called as ``model(*inputs, **kwargs)``.
        num_heads: each layer's query head count (L entries).
        names: each layer's module name; for a transformers model filled in
            by its first forward ("" before).
        layers: multihead's attention layers, or None for a transformers model.
        kwargs: keywords every forward passes (``use_cache=False`` for a
            transformers model whose forward takes it).
    """

    model: nn.Module
    num_heads: list[int]
    names: list[str]
    layers: list | None
    kwargs: dict = field(default_factory=dict)
    module_names: dict[int, str] = field(default_factory=dict)

    def head_table(self, heads: Mapping | None) -> dict[int, list[int]]:
        """``heads`` ({layer: [head, ...]}, None: every head) checked against the layers (``check_head_table``)."""
        listed = self.layers or [SimpleNamespace(num_heads=n) for n in self.num_heads]
        if heads is None:
            heads = {i: range(n) for i, n in enumerate(self.num_heads)}
        return check_head_table(heads, listed)

    def forward(self, inputs: tuple, hooks: Mapping[int, Callable] | None = None, record=()) -> tuple[object, dict]:
        """(the output of ``model(*inputs)``, {i: layer i's head outputs [B, H, T, Dv] for i in ``record``}).

        Layer i's head outputs out [B, H, T, Dv] become ``hooks[i](out)``
        (None keeps them) before the output projection.

        Raises:
            ValueError: a layer that ran other than once; for a transformers
                model, more attention modules called than the config's layers,
                or a call with another head count than the config's.
        """
        hooks = hooks or {}
        L = len(self.num_heads)
        calls = [0] * L

        def seen(i: int, out: torch.Tensor):
            calls[i] += 1
            return hooks[i](out) if i in hooks else None

        with ExitStack() as stack:
            if self.layers is not None:
                for i, layer in enumerate(self.layers):
                    stack.callback(layer.register_head_hook(lambda _, out, i=i: seen(i, out)).remove)
            else:
                from ..hf.scopes import head_hook

                stack.enter_context(head_hook(self.model, self._called(seen)))
            if record:
                output, acts = run_with_cache(self.model, *inputs, names=["z"], layers=list(record), **self.kwargs)
                kept = {i: acts[f"layers.{i}.z"] for i in record}
            else:
                output, kept = self.model(*inputs, **self.kwargs), {}
        for i, count in enumerate(calls):
            if count != 1:
                raise ValueError(f"attention layer {i} ran {count} times in one forward; head_effects needs each "
                                 "layer to run exactly once")  # fmt: skip
        return output, kept

    def _called(self, seen: Callable) -> Callable:
        """The ``multihead.hf.head_hook`` function of a transformers model: checks each call, names its layer."""
        L, H = len(self.num_heads), self.num_heads[0]

        def on_call(module: nn.Module, i: int, out: torch.Tensor):
            where = self.module_names.get(id(module), type(module).__name__)
            if i >= L:
                raise ValueError(f"{type(self.model).__name__} called attention module {where} as its attention "
                                 f"module {i + 1} in one forward, but its config has {L} layers; head_effects "
                                 "needs one attention module per layer (not an encoder-decoder)")  # fmt: skip
            if out.shape[1] != H:
                raise ValueError(f"{where} has {out.shape[1]} heads, but the config of {type(self.model).__name__} "
                                 f"says {H}")  # fmt: skip
            self.names[i] = where
            return seen(i, out)

        return on_call


def effect_runs(model: nn.Module) -> EffectRuns:
    """The ``EffectRuns`` of a module holding multihead attention layers, or of a
    transformers model running ``attn_implementation="multihead"``.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: neither kind (or a transformers model on another attention
            implementation, or whose config gives no layer or head count).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = attention_modules(model)
    if modules:
        layers = [m for _, m in modules]
        return EffectRuns(model, [m.num_heads for m in layers], [n for n, _ in modules], layers)
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise ValueError(f"{type(model).__name__} contains no multihead attention layer (nor is it a transformers "
                         "model running attn_implementation='multihead')")  # fmt: skip
    from ..hf.scopes import _check_model, _count

    module_names = _check_model(model)
    L = _count(model.config, "num_hidden_layers", "n_layer", "num_layers")
    H = _count(model.config, "num_attention_heads", "n_head", "num_heads")
    takes = "use_cache" in inspect.signature(model.forward).parameters
    return EffectRuns(model, [H] * L, [""] * L, None, {"use_cache": False} if takes else {}, module_names)
