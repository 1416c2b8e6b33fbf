"""The attentions the notebook views and the rollout accept, checked and turned into one batch item.

    record = attention_record(outputs.attentions, tokens)     # a Hugging Face output_attentions tuple
    record = attention_record([w0, w1], tokens, key_tokens=source_tokens)   # cross attention
    record = attention_record(captured)                       # an AttentionRecord (from capture)

``attentions`` is a tuple or list of L tensors (or arrays) [B, H, T, S], one
per layer (a [H, T, S] tensor is one batch item), or an ``AttentionRecord``.
Layers may differ in H, never in B, T or S. The result is batch item
``batch`` alone (``AttentionRecord.item``: weights [1, H, T, S] float32 on
the CPU, its padding left out when ``attention_mask`` [B, S] is given), with
its token strings: ``tokens`` along T, ``key_tokens`` along S (default:
``tokens``; needed when S != T, as for ``outputs.cross_attentions``).

Every mistake is one TypeError/ValueError naming the value: ragged shapes,
a token count that is not T or S, non-finite weights (with the layer, head,
query and key of the first one).
"""

from __future__ import annotations

import numbers

import torch

from .._checks import non_negative_int
from .capture import AttentionRecord, LayerAttention
from .view_checks import strings

__all__ = ["attention_record", "layer_weights"]


def attention_record(
    attentions,
    tokens=None,
    *,
    key_tokens=None,
    batch: int = 0,
    layers=None,
    attention_mask=None,
) -> AttentionRecord:
    """Batch item ``batch`` of ``attentions`` as a checked AttentionRecord, see the module docstring.

    Args:
        attentions: L tensors [B, H, T, S] (tuple or list), or an AttentionRecord.
        tokens: T token strings (or one list per batch item); None keeps a
            record's own tokens (else 0..T-1).
        key_tokens: S token strings when the keys are another sequence.
        batch: the batch item to keep.
        layers: the positions in ``attentions`` to keep (ints, ascending); None: all.
        attention_mask: [B, S] 1 = token, 0 = padding, or None.

    Returns:
        An AttentionRecord with weights [1, H, T', S'] per layer and its tokens set.

    Raises:
        TypeError: attentions of another type, tokens not a list of str.
        ValueError: no layers, shapes that are not [B, H, T, S] or differ in B,
            T or S between layers, token counts other than T or S, non-finite
            weights, batch or layers out of range.
    """
    if isinstance(attentions, AttentionRecord):
        record = _copy(attentions)
    else:
        record = AttentionRecord(_entries(attentions))
    if not record.layers:
        raise ValueError("attentions has no layers: pass the model's output_attentions (one tensor per layer)")
    record.require_whole("the views")
    record.layers = _pick_layers(record.layers, layers)
    if tokens is not None:
        record.query_tokens = _token_lists("tokens", tokens)
    if key_tokens is not None:
        record.key_tokens = _token_lists("key_tokens", key_tokens)
    if attention_mask is not None:
        record.attention_mask = torch.as_tensor(attention_mask)
    B = record.layers[0].weights.shape[0]
    batch = non_negative_int("batch", batch)
    if batch >= B:
        raise ValueError(f"batch={batch} but the attentions hold B={B} batch item(s)")
    _check_tokens(record, "tokens", record.query_tokens, -2)
    _check_tokens(record, "key_tokens", record.key_tokens, -1)
    one = record.item(batch)
    _check_finite(one)
    T, S = one.layers[0].weights.shape[-2:]
    if S != T and one.key_tokens is None and one.query_tokens is not None:
        raise ValueError(f"the attentions have T={T} queries but S={S} keys: pass key_tokens= (the {S} key tokens)")
    return one


def layer_weights(record: AttentionRecord) -> list[torch.Tensor]:
    """Each layer's weights [H, T, S] float64 of a record from ``attention_record`` (batch of one)."""
    return [entry.weights[0].double() for entry in record.layers]


def _entries(attentions) -> list[LayerAttention]:
    if attentions is None:
        raise TypeError("attentions is None: call the model with output_attentions=True")
    if isinstance(attentions, (tuple, list)) and not attentions:
        raise ValueError(
            "attentions is empty: the model returned no attention weights; load it with "
            "attn_implementation='eager' (or 'multihead', see multihead.hf) and call it with output_attentions=True"
        )
    if isinstance(attentions, torch.Tensor) or not isinstance(attentions, (tuple, list)):
        raise TypeError(
            "attentions must be a tuple or list of per-layer tensors [B, H, T, S] (a model's output_attentions) "
            f"or an AttentionRecord, got {type(attentions).__name__}"
        )
    out, first = [], None
    for i, item in enumerate(attentions):
        if not isinstance(item, torch.Tensor):
            if not hasattr(item, "__array__"):
                raise TypeError(f"attentions[{i}] must be a tensor [B, H, T, S], got {type(item).__name__}")
            item = torch.as_tensor(item)
        if item.dim() == 3:
            item = item.unsqueeze(0)
        if item.dim() != 4:
            raise ValueError(f"attentions[{i}] must be [B, H, T, S] (or [H, T, S]), got shape {list(item.shape)}")
        if not item.is_floating_point():
            raise TypeError(f"attentions[{i}] must hold floats, got {item.dtype}")
        if min(item.shape) == 0:
            raise ValueError(f"attentions[{i}] has an empty dimension: shape {list(item.shape)}")
        B, _, T, S = item.shape
        if first is None:
            first = (B, T, S)
        elif (B, T, S) != first:
            raise ValueError(
                f"attentions[{i}] is {list(item.shape)} but attentions[0] has B={first[0]}, T={first[1]}, "
                f"S={first[2]}: every layer needs the same batch and tokens"
            )
        weights = item.detach().to("cpu", torch.float32)
        out.append(LayerAttention(i, f"attentions[{i}]", "self" if T == S else "cross", weights))
    return out


def _copy(record: AttentionRecord) -> AttentionRecord:
    return AttentionRecord(list(record.layers), record.query_tokens, record.key_tokens, record.source, record.attention_mask)


def _pick_layers(entries: list[LayerAttention], layers) -> list[LayerAttention]:
    if layers is None:
        return entries
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of ints, got {type(layers).__name__}")
    picked = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"layers must be a list of ints, got {i!r} in it")
        if not 0 <= i < len(entries):
            raise ValueError(f"layers has {i}, but the attentions have {len(entries)} layers (0..{len(entries) - 1})")
        picked.append(entries[int(i)])
    if not picked:
        raise ValueError("layers is empty: name at least one layer")
    return picked


def _token_lists(name: str, tokens) -> list[str] | list[list[str]]:
    """One list of str, or one per batch item (a padded batch of different texts)."""
    if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple)):
        return [strings(f"{name}[{i}]", item) for i, item in enumerate(tokens)]
    return strings(name, tokens)


def _check_tokens(record: AttentionRecord, name: str, tokens, dim: int) -> None:
    """A flat token list has one string per query (dim -2) or key (dim -1) of every layer."""
    if tokens is None or (tokens and isinstance(tokens[0], (list, tuple))):
        return  # per-item lists: AttentionRecord.item checks them
    sizes = {entry.weights.shape[dim] for entry in record.layers}
    n = sizes.pop()
    if len(tokens) != n:
        what = "T" if dim == -2 else "S"
        side = "queries" if dim == -2 else "keys"
        hint = "" if dim == -1 or record.key_tokens is not None else " (for cross attention pass the keys as key_tokens=)"
        raise ValueError(f"{name} has {len(tokens)} strings but the attentions have {what}={n} {side}{hint}")


def _check_finite(record: AttentionRecord) -> None:
    for entry in record.layers:
        bad = ~torch.isfinite(entry.weights[0])
        if bool(bad.any()):
            h, q, k = (int(v) for v in bad.nonzero()[0])
            value = float(entry.weights[0, h, q, k])
            raise ValueError(
                f"{entry.name} has a non-finite weight ({value}) at head {h}, query {q}, key {k}: "
                "the views need finite attention weights"
            )
