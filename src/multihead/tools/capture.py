"""Capture per-layer, per-head attention weights from any multihead model.

    with capture(model) as record:
        model(input_ids)
    record.layers[0].weights        # [B, H, T, S]
    record.head(layer=2, head=5)    # [T, S] for batch item 0

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

from ..functional.masks import causal_mask
from ..modules.base import AttentionLayer
from ..modules.observe import AttentionEvent

__all__ = ["LayerAttention", "AttentionRecord", "capture", "attention_modules"]


@dataclass
class LayerAttention:
    """One attention call.

    Attributes:
        layer: index of the module among the model's attention modules.
        name: the module's path inside the model (``named_modules``).
        kind: attention kind ("mha", "gqa", ...).
        weights: [B, H, T, S] float32 on CPU.
        scores: [B, H, T, S] float32 pre-softmax scores, or None.
    """

    layer: int
    name: str
    kind: str
    weights: torch.Tensor
    scores: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]


@dataclass
class AttentionRecord:
    """Attention of every observed call, with the tokens it was computed on.

    Attributes:
        layers: one entry per attention call, in call order.
        query_tokens: token strings along T (batch item 0), if known.
        key_tokens: token strings along S; defaults to ``query_tokens``.
        source: a free-form description of the model.
    """

    layers: list[LayerAttention] = field(default_factory=list)
    query_tokens: list[str] | None = None
    key_tokens: list[str] | None = None
    source: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def head(self, layer: int, head: int, batch: int = 0) -> torch.Tensor:
        """Weights [T, S] of one head.

        Raises:
            IndexError: layer, head or batch out of range (with the valid range).
        """
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        w = self.layers[layer].weights
        if not 0 <= head < w.shape[1]:
            raise IndexError(f"head {head} out of range [0, {w.shape[1]}) in layer {layer}")
        if not 0 <= batch < w.shape[0]:
            raise IndexError(f"batch {batch} out of range [0, {w.shape[0]})")
        return w[batch, head]

    def to_dict(self, batch: int = 0, digits: int = 6) -> dict:
        """A JSON-ready dict of batch item ``batch`` (weights rounded)."""
        keys = self.key_tokens if self.key_tokens is not None else self.query_tokens
        return {
            "source": self.source,
            "query_tokens": self.query_tokens,
            "key_tokens": keys,
            "layers": [
                {
                    "layer": entry.layer,
                    "name": entry.name,
                    "kind": entry.kind,
                    "weights": _rounded(entry.weights[batch], digits),
                    **({"scores": _rounded(entry.scores[batch], digits)} if entry.scores is not None else {}),
                }
                for entry in self.layers
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


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every observable attention module, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AttentionLayer)]


def _scores(event: AttentionEvent) -> torch.Tensor:
    """Pre-softmax scores [B, H, T, S] rebuilt from the event."""
    q, k = event.q.float(), event.k.float()
    H, G = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // G, dim=1)  # (B, G, S, D) -> (B, H, S, D), small tensors only
    scores = q @ k.transpose(-1, -2) * event.scale  # (B, H, T, S)
    mask = event.attn_mask
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.float()
    hidden = torch.zeros_like(scores, dtype=torch.bool)
    if mask is not None and mask.dtype == torch.bool:
        hidden = hidden | ~mask
    if event.is_causal:
        T, S = scores.shape[-2:]
        hidden = hidden | ~causal_mask(T, S, alignment=event.causal_alignment, device=scores.device)
    return scores.masked_fill(hidden, float("-inf"))


@contextmanager
def capture(model: nn.Module, *, scores: bool = False) -> Iterator[AttentionRecord]:
    """Record every attention call inside ``model`` during the block.

    Args:
        model: any module containing multihead attention modules (or one).
        scores: also rebuild the pre-softmax scores.

    Yields:
        an ``AttentionRecord`` filled as the model runs.

    Raises:
        ValueError: the model contains no observable attention module.
    """
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} contains no multihead attention module to capture")
    record = AttentionRecord(source=type(model).__name__)
    index = {id(m): i for i, (_, m) in enumerate(modules)}
    names = {id(m): name or type(m).__name__ for name, m in modules}

    def observe(module: nn.Module, event: AttentionEvent) -> None:
        record.layers.append(
            LayerAttention(
                layer=index[id(module)],
                name=names[id(module)],
                kind=event.kind,
                weights=event.weights.detach().float().cpu(),
                scores=_scores(event).cpu() if scores else None,
            )
        )

    handles = [m.register_attention_observer(observe) for _, m in modules]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()
