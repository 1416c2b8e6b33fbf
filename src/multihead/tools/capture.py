"""Capture per-layer, per-head attention weights from any multihead model.

    with capture(model) as record:
        model(input_ids)
    record.layers[0].weights        # [B, H, T, S]
    record.head(layer=2, head=5)    # [T, S] for batch item 0
    one = record.item(1)            # batch item 1 alone: its tokens, padding left out

A padded batch of different texts (a Hugging Face tokenizer's output) needs
one token list per item and the tokenizer's ``attention_mask``::

    record.query_tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in batch["input_ids"]]
    record.attention_mask = batch["attention_mask"]     # [B, S], 1 = token, 0 = padding

``capture`` and ``multihead.hf.capture`` fill ``attention_mask`` themselves
from the first call's bool mask (``padding_of``: the keys no query may see,
such as a ``key_mask``'s padding); the views and ``tools.roles`` read one
item through ``item``.

``capture`` registers an observer (``modules.observe``) on every attention
module inside ``model`` for the duration of the ``with`` block, so nothing is
recorded, and nothing costs anything, outside it. Layers are numbered in the
order the modules appear in ``model.named_modules()``; each forward call of
a module adds one ``LayerAttention`` (a generation loop records every step).

What is recorded is the event's ``weights``: the weights that mix the values
(the post-softmax probabilities for MHA/GQA/MQA; variants document theirs).
With ``scores=True`` the pre-softmax scores are rebuilt from the projected
queries and keys: q kᵀ · scale plus any float mask, -inf where a key is
hidden.

Some heads, some query rows, some layers: memory then grows with what is
asked for, not with L·H·T·S::

    with capture(model, layers=[3], heads=[0, 5], rows=slice(-1, None)) as record:
        model(input_ids)
    record.layers[0].weights        # [B, 2, 1, S]: heads 0 and 5, the last query
    record.layers[0].heads          # (0, 5); .rows: (T - 1,)
    record.head(layer=0, head=5)    # [1, S]

The weights come from the modules' observers (``modules.observe``): for
MHA/GQA/MQA the fused kernel computes the output and the weights asked for
are rebuilt from its log-sum-exp; kinds with a core of their own compute
every weight and the record keeps the part asked for. The views
(``tools.visualize``, ``tools.roles``) need every head and query row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .._checks import non_negative_int
from ..functional.alibi import alibi_bias
from ..functional.masks import causal_mask
from ..functional.weights import WeightSelection, pick
from ..modules.base import AttentionLayer
from ..modules.observe import AttentionEvent

__all__ = ["LayerAttention", "AttentionRecord", "capture", "attention_modules", "padding_of"]


@dataclass
class LayerAttention:
    """One attention call.

    Attributes:
        layer: index of the module among the model's attention modules.
        name: the module's path inside the model (``named_modules``).
        kind: attention kind ("mha", "gqa", ...).
        weights: [B, h, r, S] float32 on CPU: [B, H, T, S] unless some
            heads or rows were asked for.
        scores: [B, h, r, S] float32 pre-softmax scores, or None.
        heads: the query heads ``weights`` holds (ascending), None: all H.
        rows: the query rows ``weights`` holds (ascending), None: all T.
    """

    layer: int
    name: str
    kind: str
    weights: torch.Tensor
    scores: torch.Tensor | None = None
    heads: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]


@dataclass
class AttentionRecord:
    """Attention of every observed call, with the tokens it was computed on.

    Attributes:
        layers: one entry per attention call, in call order.
        query_tokens: token strings along T, if known: one list shared by
            every batch item, or one list per item (a batch of different texts).
        key_tokens: token strings along S, likewise; defaults to ``query_tokens``.
        source: a free-form description of the model.
        attention_mask: [B, S] (bool or 0/1), True/1 = a real token, False/0 =
            padding; ``item`` leaves padded keys out, and padded queries too
            where T == S (self-attention). None: no padding.
    """

    layers: list[LayerAttention] = field(default_factory=list)
    query_tokens: list[str] | list[list[str]] | None = None
    key_tokens: list[str] | list[list[str]] | None = None
    source: str = ""
    attention_mask: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def head(self, layer: int, head: int, batch: int = 0) -> torch.Tensor:
        """Weights [T, S] (or [r, S] of the rows captured) of query head ``head`` of entry ``layer``.

        Raises:
            IndexError: layer, head or batch out of range (with the valid range),
                or a head that was not captured (naming those that were).
        """
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        entry = self.layers[layer]
        w = entry.weights
        if entry.heads is not None:
            if head not in entry.heads:
                raise IndexError(f"head {head} was not captured in layer {layer}: it holds heads {list(entry.heads)}")
            head = entry.heads.index(head)
        elif not 0 <= head < w.shape[1]:
            raise IndexError(f"head {head} out of range [0, {w.shape[1]}) in layer {layer}")
        if not 0 <= batch < w.shape[0]:
            raise IndexError(f"batch {batch} out of range [0, {w.shape[0]})")
        return w[batch, head]

    def require_whole(self, reader: str) -> None:
        """Refuse a record whose entries hold only some heads or rows, for ``reader``
        (the views and roles), which need every head and query row.

        Raises:
            ValueError: naming the first such entry and what it holds.
        """
        for entry in self.layers:
            if entry.heads is not None or entry.rows is not None:
                held = ", ".join(f"{n} {list(v)}" for n, v in (("heads", entry.heads), ("rows", entry.rows)) if v is not None)
                raise ValueError(
                    f"layer {entry.layer} ({entry.name}) holds {held} only; {reader} need every head and "
                    "query row: capture without heads= / rows="
                )

    def item(self, batch: int = 0) -> AttentionRecord:
        """Batch item ``batch`` alone: weights [1, H, T', S'] without its padding, its own tokens.

        Raises:
            ValueError: weights that are not [B, H, T, S], ``batch`` out of
                range, an ``attention_mask`` that is not [B, S], per-item token
                lists of the wrong count or length, or one token list for items
                whose padding differs.
            TypeError: ``batch`` not an int.
        """
        batch = non_negative_int("batch", batch)
        for entry in self.layers:
            if entry.weights.dim() != 4:
                raise ValueError(
                    f"layer {entry.layer} ({entry.name}): weights must be [B, H, T, S], got {tuple(entry.weights.shape)}"
                )
            if batch >= entry.weights.shape[0]:
                raise ValueError(f"batch={batch} out of range for layer {entry.layer} with B={entry.weights.shape[0]}")
        keep = self._kept(batch)  # (S,) bool or None
        layers = []
        for entry in self.layers:
            T, S = entry.weights.shape[-2:]
            k = keep if keep is not None else torch.ones(S, dtype=torch.bool)
            # Padded queries leave with their keys in self-attention; captured rows stay as they are.
            q = k if T == S and entry.rows is None else torch.ones(T, dtype=torch.bool)
            weights = entry.weights[batch : batch + 1][:, :, q][:, :, :, k]  # (1, H, T', S')
            scores = None if entry.scores is None else entry.scores[batch : batch + 1][:, :, q][:, :, :, k]
            layers.append(LayerAttention(entry.layer, entry.name, entry.kind, weights, scores, entry.heads, entry.rows))
        square = all(e.weights.shape[-2] == e.weights.shape[-1] for e in self.layers)
        queries = self._tokens("query_tokens", self.query_tokens, batch, keep if square else None)
        keys = None if self.key_tokens is None else self._tokens("key_tokens", self.key_tokens, batch, keep)
        return AttentionRecord(layers, queries, keys, self.source)

    def _kept(self, batch: int) -> torch.Tensor | None:
        """(S,) bool: the real tokens of item ``batch`` by ``attention_mask``; None without one."""
        mask = self.attention_mask
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"attention_mask must be a [B, S] tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
        B, S = (self.layers[0].weights.shape[0], self.layers[0].weights.shape[-1]) if self.layers else mask.shape
        if tuple(mask.shape) != (B, S) or any(e.weights.shape[-1] != S for e in self.layers):
            raise ValueError(
                f"attention_mask is {list(mask.shape)} but the weights have B={B} and key lengths "
                f"{sorted({e.weights.shape[-1] for e in self.layers})}: it must be [B, S]"
            )
        keep = mask[batch].detach().cpu() != 0
        if not bool(keep.any()):
            raise ValueError(f"attention_mask hides every token of batch item {batch}")
        flat = self.query_tokens is not None and not _nested(self.query_tokens)
        if flat and B > 1 and not bool((mask.detach().cpu() != 0).eq(keep).all()):
            raise ValueError(
                f"query_tokens is one token list for {B} batch items whose padding differs (attention_mask): "
                "give one list per item, record.query_tokens = [tokens of item 0, tokens of item 1, ...]"
            )
        return keep

    def _tokens(self, name: str, tokens: list, batch: int, keep: torch.Tensor | None) -> list | None:
        """The token strings of item ``batch``, padding left out (``keep``) when they include it."""
        if tokens is None:
            return None
        if _nested(tokens):
            B = self.layers[0].weights.shape[0] if self.layers else len(tokens)
            if len(tokens) != B:
                raise ValueError(f"{name} has {len(tokens)} token lists but the weights have B={B} batch items")
            tokens = tokens[batch]
        if keep is not None and len(tokens) == len(keep) and not bool(keep.all()):
            tokens = [t for t, k in zip(tokens, keep.tolist()) if k]
        return list(tokens)

    def to_dict(self, batch: int = 0, digits: int = 6) -> dict:
        """A JSON-ready dict of batch item ``batch`` (``item``: its tokens, no padding; weights rounded)."""
        one = self.item(batch)
        keys = one.key_tokens if one.key_tokens is not None else one.query_tokens
        return {
            "source": one.source,
            "query_tokens": one.query_tokens,
            "key_tokens": keys,
            "layers": [
                {
                    "layer": entry.layer,
                    "name": entry.name,
                    "kind": entry.kind,
                    "weights": _rounded(entry.weights[0], digits),
                    **({"scores": _rounded(entry.scores[0], digits)} if entry.scores is not None else {}),
                    **({"heads": list(entry.heads)} if entry.heads is not None else {}),
                    **({"rows": list(entry.rows)} if entry.rows is not None else {}),
                }
                for entry in one.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> AttentionRecord:
        """Inverse of ``to_dict`` (batch of one)."""
        if not isinstance(data, dict) or "layers" not in data:
            raise ValueError("not an attention record: expected a dict with a 'layers' list")
        layers = []
        for entry in data["layers"]:
            weights = torch.tensor(entry["weights"], dtype=torch.float32).unsqueeze(0)
            if weights.dim() != 4:
                raise ValueError(f"layer {entry.get('layer')}: weights must be [H, T, S], got {list(weights.shape[1:])}")
            scores = entry.get("scores")
            layers.append(
                LayerAttention(
                    layer=int(entry["layer"]),
                    name=str(entry["name"]),
                    kind=str(entry["kind"]),
                    weights=weights,
                    scores=None if scores is None else _from_json_floats(scores).unsqueeze(0),
                    heads=None if entry.get("heads") is None else tuple(int(h) for h in entry["heads"]),
                    rows=None if entry.get("rows") is None else tuple(int(r) for r in entry["rows"]),
                )
            )
        return cls(layers, data.get("query_tokens"), data.get("key_tokens"), data.get("source", ""))

    def save_json(self, path: str | os.PathLike, batch: int = 0) -> Path:
        """Write ``to_dict(batch)`` as JSON with ``multihead.io.write_text_atomic``:
        the file is replaced as a whole (a crash never leaves a half-written
        record) and gets the usual permissions."""
        from ..io import write_text_atomic

        payload = json.dumps(self.to_dict(batch), allow_nan=False)
        return write_text_atomic(path, payload)


def _nested(tokens) -> bool:
    """True for one token list per batch item (a non-empty list of lists)."""
    return isinstance(tokens, (list, tuple)) and bool(tokens) and all(isinstance(t, (list, tuple)) for t in tokens)


def _rounded(t: torch.Tensor, digits: int) -> list:
    """Nested lists with -inf written as None (JSON has no infinities)."""
    t = t.double()
    finite = torch.isfinite(t)
    values = torch.where(finite, t, torch.zeros_like(t)).round(decimals=digits).tolist()
    if bool(finite.all()):
        return values
    return _none_where(values, finite.tolist())


def _none_where(values, keep):
    if isinstance(values, list):
        return [_none_where(v, k) for v, k in zip(values, keep)]
    return values if keep else None


def _from_json_floats(data) -> torch.Tensor:
    def fill(x):
        return [fill(v) for v in x] if isinstance(x, list) else (float("-inf") if x is None else x)

    return torch.tensor(fill(data), dtype=torch.float32)


def padding_of(mask: torch.Tensor | None, B: int) -> torch.Tensor | None:
    """[B, S] bool, False on the keys no query of an item may see (padding), from a bool
    [B or 1, H or 1, T, S] mask; None without such a mask or without padding."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return None
    keys = mask.any(dim=-2).any(dim=1)  # (B or 1, S): seen by some query of some head
    return None if bool(keys.all()) else keys.expand(B, -1).cpu().clone()


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every observable attention module, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AttentionLayer)]


def _scores(event: AttentionEvent, module: nn.Module) -> torch.Tensor:
    """Pre-softmax scores [B, h, r, S] of the event's heads and rows, rebuilt from its q and k
    (with the layer's soft-capping and ALiBi, ``modules.score_options``).

    A kind whose q has more heads than its weights (differential attention's
    2H sub-heads) gets the scores of every q head, for the event's rows.
    """
    q, k = event.q.float(), event.k.float()
    H, G, T = q.shape[1], k.shape[1], q.shape[2]
    heads = list(event.heads) if H == module.num_heads else list(range(H))
    rows = list(event.rows)
    q = q[:, heads][:, :, rows]  # (B, H, T, D) -> (B, h, r, D)
    k = k[:, [h // (H // G) for h in heads]]  # (B, G, S, D) -> (B, h, S, D), small tensors only
    scores = q @ k.transpose(-1, -2) * event.scale  # (B, h, r, S)
    softcap, slopes = getattr(module, "softcap", None), getattr(module, "alibi_slopes", None)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if slopes is not None:  # (H, T, S) -> (h, r, S)
        scores = scores + alibi_bias(slopes.float(), T, k.shape[2], alignment=event.causal_alignment)[heads][:, rows]
    mask = event.attn_mask
    if mask is not None:
        mask = mask[None, None] if mask.dim() == 2 else mask  # (T, S) -> (1, 1, T, S)
        mask = pick(mask, tuple(heads), tuple(rows))  # (B|1, h|1, r|1, S)
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.float()
    hidden = torch.zeros_like(scores, dtype=torch.bool)
    if mask is not None and mask.dtype == torch.bool:
        hidden = hidden | ~mask
    if event.is_causal:
        S = scores.shape[-1]
        hidden = hidden | ~causal_mask(T, S, alignment=event.causal_alignment, device=scores.device)[rows]
    return scores.masked_fill(hidden, float("-inf"))


@contextmanager
def capture(
    model: nn.Module,
    *,
    scores: bool = False,
    heads: list[int] | None = None,
    rows: slice | list[int] | None = None,
    layers: list[int] | None = None,
) -> Iterator[AttentionRecord]:
    """Record the attention calls inside ``model`` during the block.

    Args:
        model: any module containing multihead attention modules (or one).
        scores: also rebuild the pre-softmax scores.
        heads: ascending query heads to record in every observed layer (None: all).
        rows: query rows to record: a slice, resolved against each call's T
            (``slice(-1, None)``: the last query, in a generation loop too),
            or ascending ints (negative ones count from the end); None: all.
        layers: ascending indices of the attention modules to observe, in
            ``attention_modules`` order (None: all).

    Yields:
        an ``AttentionRecord`` filled as the model runs; each entry's
        ``heads`` and ``rows`` say what its weights hold (None: all).

    Raises:
        ValueError: the model contains no observable attention module; layers
            out of range or not ascending; heads or rows that are not ascending
            (a head or row beyond a call's H or T: at that call).
        TypeError: heads, rows or layers of the wrong type.
    """
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} contains no multihead attention module to capture")
    chosen = _chosen_layers(layers, len(modules))
    WeightSelection(heads=heads, rows=rows)  # checked before anything is registered
    record = AttentionRecord(source=type(model).__name__)
    index = {id(m): i for i, (_, m) in enumerate(modules)}
    names = {id(m): name or type(m).__name__ for name, m in modules}

    def observe(module: nn.Module, event: AttentionEvent) -> None:
        if not record.layers and record.attention_mask is None:
            record.attention_mask = padding_of(event.attn_mask, event.weights.shape[0])
        H, T = module.num_heads, event.q.shape[2]  # the heads of its weights (a kind's q may have more)
        record.layers.append(
            LayerAttention(
                layer=index[id(module)],
                name=names[id(module)],
                kind=event.kind,
                weights=event.weights.detach().float().cpu(),
                scores=_scores(event, module).cpu() if scores else None,
                heads=None if event.heads == tuple(range(H)) else event.heads,
                rows=None if event.rows == tuple(range(T)) else event.rows,
            )
        )

    handles = [modules[i][1].register_attention_observer(observe, heads=heads, rows=rows) for i in chosen]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def _chosen_layers(layers: object, count: int) -> list[int]:
    """The indices of the attention modules to observe (all when ``layers`` is None)."""
    if layers is None:
        return list(range(count))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, range)):
        raise TypeError(f"layers must be a list of ints, got layers={layers!r} ({type(layers).__name__})")
    chosen = [non_negative_int("layers", x) for x in layers]
    if not chosen or any(a >= b for a, b in zip(chosen, chosen[1:])):
        raise ValueError(f"layers must be ascending layer indices, each once (at least one); got layers={chosen}")
    if chosen[-1] >= count:
        raise ValueError(f"layers={list(chosen)} asks for layer {chosen[-1]}, but the model has {count} attention modules")
    return list(chosen)
