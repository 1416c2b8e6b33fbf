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

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .functional import attention
from .tools.capture import AttentionRecord, LayerAttention

__all__ = ["NAME", "register", "attention_forward", "capture", "head_gates", "head_mask", "load_hf"]

NAME = "multihead"

# kwargs that would change the result and that this bridge does not implement;
# they are refused when set instead of being silently dropped.
_REFUSED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks (s_aux)",
}


@dataclass
class _Scope:
    """One active ``capture`` or ``head_gates`` block on one model."""

    module_names: dict[int, str]
    record: AttentionRecord | None = None
    gates: torch.Tensor | None = None
    order: dict[int, int] = field(default_factory=dict)


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


def _kind(H: int, G: int) -> str:
    return "mha" if G == H else ("mqa" if G == 1 else "gqa")


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
    want_weights = asked or any(s.record is not None for s in scopes)
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
    out, weights = result if want_weights else (result, None)
    for scope in scopes:
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
        if scope.record is not None:
            position = scope.order.setdefault(id(module), len(scope.order))
            scope.record.layers.append(
                LayerAttention(
                    layer=position,
                    name=scope.module_names[id(module)],
                    kind=_kind(query.shape[1], key.shape[1]),
                    weights=weights.detach().float().cpu(),
                )
            )
    out = out.transpose(1, 2).contiguous()  # (B, H, T, Dv) -> (B, T, H, Dv)
    return out, weights if asked else None


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
def capture(model: nn.Module) -> Iterator[AttentionRecord]:
    """Record the attention weights of every attention call inside ``model``.

    Entries come in call order; ``layer`` numbers the attention modules in
    the order they were first called (the model's layer order for
    ordinary models), ``name`` is the module's path. The record is the one
    ``multihead.tools`` reads, so the head explorer runs on it.

    Args:
        model: a transformers model running ``attn_implementation="multihead"``.

    Yields:
        an ``AttentionRecord`` whose entries hold weights [B, H, T, S]
        (float32, CPU, detached).

    Raises:
        ValueError: the model does not run the ``multihead`` implementation.
        TypeError: ``model`` is not a module.
    """
    names = _check_model(model)
    record = AttentionRecord(source=type(model).__name__)
    with _scoped(_Scope(module_names=names, record=record)):
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


register()
