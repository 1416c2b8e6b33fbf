"""Run a model once and keep its named activations: ``run_with_cache``.

    out, acts = run_with_cache(model, input_ids, names=("q", "k", "v", "z", "pattern"))
    acts["layers.3.q"]            # [B, H, T, D]
    acts.layer(3).pattern         # [B, H, T, S]
    out, acts = run_with_cache(model, ids, names=["z"], layers=[2], heads=[0, 5])
    acts["layers.2.z"]            # [B, 2, T, Dv]: heads 0 and 5 only

``model(*args, **kwargs)`` runs once; the result comes back untouched. The
names and shapes are listed in ``tools.activations``. What reads what:

* q, k, v and pattern come from an observer of each chosen attention module
  (``modules.observe``): the q and k the scores were computed from (after
  qk_norm and rope), the values, and the weights of the heads asked for.
  Without "pattern" the observer asks for one weight row of one head, the
  least a layer computes for an observer.
* q_pre and k_pre are what the layer's ``to_heads`` returns, read by
  wrapping that method on the module for the call (kinds whose ``to_heads``
  layout differs keep theirs: ``tools.activations``).
* z comes from a head hook (``AttentionLayer.register_head_hook``),
  registered after any hook already there, so it is what ``out_proj`` reads.
* attn_out is a forward hook on the attention module; resid_pre / resid_post
  are a forward pre-hook and a forward hook on the layer's block: the
  ``nn.ModuleList`` of the model whose i-th entry holds attention module i
  alone (GPT's ``blocks``, ``BertEncoder``'s ``layers``).

A Hugging Face transformers model running ``attn_implementation="multihead"``
goes through the bridge (``multihead.hf.activations``) and gets the same
names. Every hook is removed when the call returns, also when it fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..modules.base import AttentionLayer
from ..modules.observe import AttentionEvent
from .activation_store import Store, check_heads, input_of, output_of
from .activations import Activations, check_names
from .capture import _chosen_layers, attention_modules

__all__ = ["run_with_cache", "DEFAULT_NAMES"]

DEFAULT_NAMES = ("q", "k", "v", "pattern", "z", "attn_out")
_OBSERVED = ("q", "k", "v", "pattern")


def blocks_of(model: nn.Module, attention: list[nn.Module]) -> list[nn.Module]:
    """The blocks of ``model``: an ``nn.ModuleList`` whose i-th entry holds ``attention[i]``
    and no other attention module (and is not itself an attention module).

    Raises:
        ValueError: no such list, naming the model.
    """
    want = [id(m) for m in attention]
    for _, candidate in model.named_modules():
        if not isinstance(candidate, nn.ModuleList) or len(candidate) != len(want):
            continue
        held = [[id(m) for m in block.modules() if isinstance(m, AttentionLayer)] for block in candidate]
        if held == [[w] for w in want] and not any(isinstance(b, AttentionLayer) for b in candidate):
            return list(candidate)
    raise ValueError(
        f"resid_pre / resid_post need the model's blocks: {type(model).__name__} has no nn.ModuleList of "
        f"{len(want)} blocks holding one attention module each (as GPT's blocks)"
    )


def run_with_cache(
    model: nn.Module,
    *args,
    names: str | tuple[str, ...] | list[str] = DEFAULT_NAMES,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    **kwargs,
) -> tuple[object, Activations]:
    """Run ``model(*args, **kwargs)`` once and keep the named activations of its layers.

    Args:
        model: a module holding multihead attention modules (GPT, MiniLM, a
            bare layer, ...), or a transformers model running
            ``attn_implementation="multihead"``.
        names: which activations (``tools.activations.ACTIVATION_NAMES``);
            default q, k, v, pattern, z and attn_out.
        layers: ascending attention-module indices (``tools.attention_modules``
            order; for a transformers model the order of first call); None: all.
        heads: ascending query heads kept in q, pattern and z (k and v keep
            the key/value heads these read); None: all.

    The other arguments go to the model; a keyword of the model's own named
    ``names``, ``layers`` or ``heads`` cannot pass through.

    Returns:
        (the model's output, an ``Activations`` holding "layers.{i}.{name}"
        for every layer and name asked for, and nothing else).

    Raises:
        TypeError / ValueError: names, layers or heads that are not valid
            (the message lists the valid names or range), a model without
            attention modules, resid names on a model without blocks; all
            checked before the model runs.
    """
    names = check_names(names)
    heads = check_heads(heads)
    modules = attention_modules(model)
    if not modules:
        if hasattr(getattr(model, "config", None), "_attn_implementation"):
            from ..hf.activations import hf_run_with_cache

            return hf_run_with_cache(model, args, kwargs, names=names, layers=layers, heads=heads)
        raise ValueError(
            f"{type(model).__name__} contains no multihead attention module (nor is it a transformers model "
            "running attn_implementation='multihead')"
        )
    chosen = _chosen_layers(layers, len(modules))
    for i in chosen:
        where, m = modules[i][0] or type(modules[i][1]).__name__, modules[i][1]
        if heads is not None and heads[-1] >= m.num_heads:
            raise ValueError(f"heads={list(heads)} asks for head {heads[-1]}, but layer {i} ({where}) has {m.num_heads} heads")
    blocks = blocks_of(model, [m for _, m in modules]) if {"resid_pre", "resid_post"} & set(names) else None
    store = Store(names, heads)
    handles = []
    try:
        for i in chosen:
            handles += _hooks(store, i, *modules[i], None if blocks is None else blocks[i])
        out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, store.record(chosen, type(model).__name__)


def _hooks(store: Store, i: int, where: str, module: AttentionLayer, block: nn.Module | None) -> list:
    """Register what layer ``i`` needs for the names asked for; return the handles."""
    where = where or type(module).__name__
    names, handles = set(store.names), []
    if set(_OBSERVED) & names:

        def observe(layer: nn.Module, event: AttentionEvent) -> None:
            store.put_qkv(i, where, event.q, event.k, event.v, layer.num_heads)
            store.put(i, "pattern", event.weights, where)

        wanted = {"heads": store.heads} if "pattern" in names else {"heads": [(store.heads or (0,))[0]], "rows": [-1]}
        handles.append(module.register_attention_observer(observe, **wanted))
    if {"q_pre", "k_pre"} & names:
        handles.append(_PreRope(store, i, where, module))
    if "z" in names:
        handles.append(module.register_head_hook(_keep(store, i, "z", where)))
    if "attn_out" in names:
        handles.append(module.register_forward_hook(lambda m, a, out: store.put(i, "attn_out", output_of(out), where)))
    if "resid_pre" in names:

        def before(m: nn.Module, args: tuple, kwargs: dict) -> None:
            x = input_of(args, kwargs)
            if x is None:
                raise TypeError(f"block {i} of {where} takes no tensor as its first argument: no resid_pre")
            store.put(i, "resid_pre", x, where)

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
    if "resid_post" in names:
        handles.append(block.register_forward_hook(lambda m, a, out: store.put(i, "resid_post", output_of(out), where)))
    return handles


def _keep(store: Store, i: int, name: str, where: str) -> Callable:
    def hook(layer: nn.Module, out: torch.Tensor) -> None:
        store.put_heads(i, name, out, where)

    return hook


class _PreRope:
    """Wraps ``module.to_heads`` (an instance attribute over the class's method)
    to keep q_pre / k_pre; ``remove`` restores the method."""

    def __init__(self, store: Store, i: int, where: str, module: AttentionLayer) -> None:
        if "to_heads" in vars(module):
            raise ValueError(f"layer {i} ({where}) already has its to_heads wrapped: is a run_with_cache running on it?")
        inner = module.to_heads

        def to_heads(*args, **kwargs):
            q, k, v, extra = inner(*args, **kwargs)
            store.put_qkv(i, where, q, k, None, module.num_heads, pre=True)
            return q, k, v, extra

        self.module = module
        vars(module)["to_heads"] = to_heads

    def remove(self) -> None:
        vars(self.module).pop("to_heads", None)
