"""``tools.run_with_cache`` on a transformers model running ``attn_implementation="multihead"``.

The names and shapes are ``tools.activations``'s. Where each comes from:

* q, k, v, pattern and z: the bridge's attention function (``bridge.py``)
  hands each call's query [B, H, T, D], key [B, G, S, D] and value
  [B, G, S, Dv] as the model passes them (after its own rope; keys and
  values at G heads, cached ones included), the weights of the heads asked
  for, and the per-head outputs [B, H, T, Dv] (after the gates of any
  ``head_gates`` block entered before).
* q_pre / k_pre are refused: the model rotates q and k before the bridge sees them.
* attn_out: the first output of each module the model declares as its
  attention (``model.can_record_outputs["attentions"]``, as
  ``output_attentions`` hooks find them): after the output projection for
  GPT-2 and Llama; BERT's ``BertSelfAttention`` returns the merged heads
  before ``attention.output.dense``.
* resid_pre / resid_post: the input and the output of the modules the model
  declares for ``hidden_states`` (GPT2Block, LlamaDecoderLayer, BertLayer).

Layers are numbered as ``capture`` numbers them: in the order the attention
modules are first called (the layer order for ordinary models); ``layers``
and ``heads`` are checked against the config's layer and head counts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..functional import WeightSelection
from ..tools.activation_store import Store, input_of, output_of
from ..tools.capture import _chosen_layers
from .bridge import _Scope
from .scopes import _check_model, _count, _scoped

__all__ = ["hf_run_with_cache", "declared_modules"]


def declared_modules(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules ``model.can_record_outputs[key]`` declares, in model order.

    Raises:
        ValueError: the model declares none for ``key``.
    """
    declared = (getattr(model, "can_record_outputs", None) or {}).get(key)
    specs = declared if isinstance(declared, (list, tuple)) else [declared] if declared is not None else []

    def matches(name: str, module: nn.Module) -> bool:
        for spec in specs:
            target = getattr(spec, "target_class", spec)
            if isinstance(target, str):
                ok = type(module).__name__ == target
            elif isinstance(target, type):
                ok = isinstance(module, target)
            else:
                suffix = getattr(spec, "class_name", None)
                ok = suffix is not None and name.endswith(suffix)
            layer_name = getattr(spec, "layer_name", None)
            if ok and (layer_name is None or f".{layer_name.strip('.')}." in f".{name}."):
                return True
        return False

    found = [(name, m) for name, m in model.named_modules() if specs and matches(name, m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} declares no {key!r} modules (transformers' can_record_outputs), "
            f"which attn_out / resid_pre / resid_post are read from"
        )
    return found


def hf_run_with_cache(
    model: nn.Module, args: tuple, kwargs: dict, *, names: tuple[str, ...], layers, heads: tuple[int, ...] | None
) -> tuple[object, object]:
    """``tools.run_with_cache`` for a transformers model (names and heads already checked there).

    Raises:
        ValueError: the model does not run "multihead"; layers or heads
            beyond the config's counts; attn_out / resid names on a model
            that declares no such modules (all before the model runs).
    """
    module_names = _check_model(model)
    pre = [n for n in names if n in ("q_pre", "k_pre")]
    if pre:
        raise ValueError(
            f"names={list(names)}: {pre} are recorded in multihead's own layers only; a transformers model "
            "applies its rope before the attention function sees q and k"
        )
    config = model.config
    L = _count(config, "num_hidden_layers", "n_layer", "num_layers")
    H = _count(config, "num_attention_heads", "n_head", "num_heads")
    chosen = _chosen_layers(layers, L)
    if heads is not None and heads[-1] >= H:
        raise ValueError(f"heads={list(heads)} asks for head {heads[-1]}, but {type(model).__name__} has {H} heads")
    attention = declared_modules(model, "attentions") if "attn_out" in names else []
    blocks = declared_modules(model, "hidden_states") if {"resid_pre", "resid_post"} & set(names) else []
    if blocks and len(blocks) != L:
        raise ValueError(
            f"resid_pre / resid_post: {type(model).__name__} has {len(blocks)} blocks for its {L} layers "
            "(an encoder-decoder?): ask without them"
        )
    store, wanted = Store(names, heads), set(chosen)

    def on_call(module, position, q, k, v, weights, out) -> None:
        if position in wanted:
            where = module_names[id(module)]
            store.put_qkv(position, where, q, k, v, q.shape[1])
            if weights is not None:
                store.put(position, "pattern", weights, where)
            store.put_heads(position, "z", out, where)

    scope = _Scope(module_names=module_names, on_call=on_call, selection=WeightSelection(heads=heads),
                   on_call_weights=frozenset(chosen if "pattern" in names else ()))  # fmt: skip
    handles = []
    try:
        for where, m in attention:
            handles.append(m.register_forward_hook(_attn_out(store, scope, wanted, where)))
        for i, (where, block) in enumerate(blocks):
            if i in wanted:
                handles += _resid_hooks(store, i, where, block)
        with _scoped(scope):
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, store.record(chosen, type(model).__name__)


def _attn_out(store: Store, scope: _Scope, wanted: set[int], where: str):
    def hook(module: nn.Module, args, output) -> None:
        position = scope.order.get(id(module))
        if position in wanted:
            store.put(position, "attn_out", output_of(output), where)

    return hook


def _resid_hooks(store: Store, i: int, where: str, block: nn.Module) -> list:
    handles = []
    if "resid_pre" in store.names:

        def before(m: nn.Module, args: tuple, kwargs: dict) -> None:
            x = input_of(args, kwargs)
            if x is None:
                raise TypeError(f"block {where} was called without hidden states: no resid_pre")
            store.put(i, "resid_pre", x, where)

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
    if "resid_post" in store.names:

        def after(m: nn.Module, args: tuple, output) -> None:
            out = output_of(output)
            if isinstance(out, torch.Tensor):
                store.put(i, "resid_post", out, where)

        handles.append(block.register_forward_hook(after))
    return handles
