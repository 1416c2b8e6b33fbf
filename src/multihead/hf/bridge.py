"""The attention function transformers calls, and its registration.

``attention_forward`` has the signature of transformers' attention interface;
``register`` installs it (and SDPA's mask builder) under the name
``"multihead"``. ``capture`` / ``head_gates`` / ``head_hook`` blocks (``scopes.py``) and
``run_with_cache`` (``activations.py``) reach it through ``_SCOPES``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..functional import WeightSelection, attention
from ..modules.kinds.mha import MultiHeadAttention
from ..modules.observe import observed_selection, part_of
from ..tools.capture import AttentionRecord, LayerAttention, padding_of

__all__ = ["NAME", "register", "attention_forward", "load_hf"]

NAME = "multihead"

# kwargs that would change the result and that this bridge does not implement;
# they are refused when set instead of being silently dropped.
_REFUSED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks (s_aux)",
}


@dataclass
class _Scope:
    """One active ``capture``, ``head_gates``, ``head_hook`` or ``run_with_cache`` on one model.

    ``on_call(module, position, query, key, value, weights, out)`` sees each call's
    q [B, H, T, D], k [B, G, S, D], v [B, G, S, Dv], the weights of ``selection``
    (None unless the module's position, its order of first call, is in
    ``on_call_weights``) and out [B, H, T, Dv] after the gates and replacements
    of the scopes entered before it (and this scope's own). ``replace(module,
    position, out)`` returns None (keep out [B, H, T, Dv]) or a tensor of out's
    shape that the output projection reads instead.
    """

    module_names: dict[int, str]
    record: AttentionRecord | None = None
    gates: torch.Tensor | None = None
    order: dict[int, int] = field(default_factory=dict)
    selection: WeightSelection = field(default_factory=WeightSelection)  # the heads and rows a capture records
    on_call: Callable | None = None
    on_call_weights: frozenset[int] = frozenset()
    replace: Callable | None = None


_SCOPES: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar("multihead_hf_scopes", default=())


def register() -> None:
    """Register ``"multihead"`` with transformers (idempotent).

    Adds ``attention_forward`` to ``AttentionInterface`` and transformers'
    SDPA mask builder to the mask interface under the same name, so that
    models receive bool masks (True = may attend) or None with ``is_causal``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def _layer_index(module: nn.Module) -> int:
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(
            f"head gates need each attention module's integer layer_idx; "
            f"{type(module).__name__} has layer_idx={layer!r}"
        )
    return layer


def _weights_requested(kwargs: dict) -> bool:
    """Whether the model call asked for attention weights.

    Some models (GPT-2) drop ``output_attentions`` before it reaches the
    attention function and collect the weights with output hooks instead;
    transformers' active output collector says what those hooks want.
    """
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, LookupError):
        return False
    return isinstance(collected, dict) and any(key.endswith("attentions") for key in collected)


def _position(scope: _Scope, module: nn.Module) -> int:
    """The module's index among the scope's attention modules, in order of first call."""
    return scope.order.setdefault(id(module), len(scope.order))


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformers attention-interface function backed by multihead.

    Args:
        module: the calling attention layer (reads ``training``,
            ``is_causal`` and, for gates, ``layer_idx``).
        query: [B, H, T, D].
        key: [B, G, S, D], G dividing H (GQA without expanding to H heads).
        value: [B, G, S, Dv].
        attention_mask: None, bool (True = may attend) or float (added),
            4-D broadcastable to [B, H, T, S].
        dropout: dropout on the weights, applied when ``module.training``.
        scaling: score multiplier, default 1 / sqrt(D).
        is_causal: overrides ``module.is_causal``; as in transformers' SDPA
            path it applies (top-left aligned) only when there is no mask
            and T > 1, since a given mask already holds the causal pattern.
        position_bias: optional float [B or 1, H, T, S] added to the scores.
        **kwargs: ``output_attentions`` asks for the weights; ``softcap`` and
            ``s_aux`` are refused; a paged ``cache`` is refused; the rest
            (positions, cache bookkeeping, flash-only lengths) are ignored.

    Returns:
        (out [B, T, H, Dv], weights [B, H, T, S] or None). Weights are
        returned when ``output_attentions`` is set or a ``capture`` of the
        calling model is active.

    Raises:
        ValueError: a refused option, or anything ``functional.attention``
            refuses (shapes, masks, head counts), with the values.
        TypeError: a mask that is not a tensor (e.g. flex's BlockMask).
    """
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation={NAME!r} does not implement {what}: {name}={kwargs[name]!r}")
    if kwargs.get("cache") is not None:
        raise ValueError(
            f"attn_implementation={NAME!r} does not serve paged caches (continuous batching); "
            f"got cache={type(kwargs['cache']).__name__}"
        )
    T = query.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and attention_mask is None and T > 1
    mask = attention_mask
    if position_bias is not None:
        if mask is None:
            mask = position_bias
        elif mask.dtype == torch.bool:
            mask = position_bias.masked_fill(~mask, float("-inf"))  # hidden keys stay exactly hidden
        else:
            mask = position_bias + mask

    scopes = [s for s in _SCOPES.get() if id(module) in s.module_names]
    asked = _weights_requested(kwargs)
    takes = [s.record is not None or (s.on_call is not None and _position(s, module) in s.on_call_weights)
             for s in scopes]  # fmt: skip
    recording = [(None, s.selection) for s, took in zip(scopes, takes) if took]
    want_weights, got, own = asked, (None, None), []
    if recording:  # the union of the captures' heads and rows; every weight when output_attentions asks
        union, own = observed_selection(recording, query.shape[1], query.shape[2])
        want_weights, got = (True, got) if asked else (union, (union.heads, union.rows))
    result = attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=causal,
        causal_alignment="top_left",  # what SDPA's is_causal means
        scale=scaling,
        dropout_p=float(dropout),
        training=module.training,
        return_weights=want_weights,
    )
    out, weights = result if want_weights is not False else (result, None)
    own = iter(own)
    for scope, took in zip(scopes, takes):
        heads, rows = next(own) if took else (None, None)
        part = part_of(weights.detach(), (heads, rows), got) if took else None  # (B, h, r, S)
        if scope.gates is not None:
            layer = _layer_index(module)
            L, H = scope.gates.shape
            if not 0 <= layer < L or H != out.shape[1]:
                raise ValueError(
                    f"head gates have shape ({L}, {H}) but {scope.module_names[id(module)]} is "
                    f"layer {layer} with {out.shape[1]} heads"
                )
            gate = scope.gates[layer].to(out.dtype)
            out = out * gate[None, :, None, None]  # (H,) -> (1, H, 1, 1)
        if scope.replace is not None:
            out = _replaced(scope, module, out)
        if scope.record is not None:
            if not scope.record.layers and scope.record.attention_mask is None:
                scope.record.attention_mask = padding_of(attention_mask, query.shape[0])
            position = scope.order.setdefault(id(module), len(scope.order))
            scope.record.layers.append(
                LayerAttention(
                    layer=position,
                    name=scope.module_names[id(module)],
                    kind=MultiHeadAttention.kind_name(query.shape[1], key.shape[1]),  # (B, H, T, D), (B, G, S, D)
                    weights=part.float().cpu(),
                    heads=heads,
                    rows=rows,
                )
            )
        if scope.on_call is not None:
            scope.on_call(module, _position(scope, module), query, key, value, part, out)
    out = out.transpose(1, 2).contiguous()  # (B, H, T, Dv) -> (B, T, H, Dv)
    return out, weights if asked else None


def _replaced(scope: _Scope, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """What ``scope.replace`` makes of out [B, H, T, Dv]: out itself for None, else its tensor.

    Raises:
        TypeError / ValueError: anything else than None or a tensor of out's shape (naming the module).
    """
    new = scope.replace(module, _position(scope, module), out)
    if new is None:
        return out
    where = scope.module_names[id(module)]
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"a head hook returned a {type(new).__name__} for {where}; return None or a tensor [B, H, T, Dv]")
    if new.shape != out.shape:
        raise ValueError(f"a head hook returned shape {tuple(new.shape)} for {where}, whose head outputs are "
                         f"{tuple(out.shape)}")  # fmt: skip
    return new


def load_hf(path: str | Path, model_class: type | None = None, **kwargs) -> nn.Module:
    """Load a local transformers checkpoint with multihead attention, in eval mode.

    Args:
        path: a folder with ``config.json`` and weights (nothing is downloaded).
        model_class: default ``transformers.AutoModel``.
        **kwargs: passed to ``from_pretrained``.

    Raises:
        ValueError: ``path`` is not a folder with a ``config.json``.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a model folder: no config.json in it")
    if model_class is None:
        from transformers import AutoModel as model_class
    register()
    model = model_class.from_pretrained(folder, attn_implementation=NAME, local_files_only=True, **kwargs)
    return model.eval()

