"""Observing attention: callbacks that receive the exact weights of a call.

Every attention kind (``base.AttentionLayer``) keeps a registry of
observers. Tools (the head explorer's capture, importance scores) register a
callback, optionally for some query heads and some query rows only; while at
least one is registered the module computes the exact weights they ask for
and hands each callback an ``AttentionEvent``. With no callback registered
the module pays one dict-emptiness check per call and runs its fast path.

    handle = attn.register_attention_observer(lambda module, event: ...)
    handle = attn.register_attention_observer(fn, heads=[0, 5], rows=slice(-1, None))
    ...
    handle.remove()

Where the weights come from: the layer asks its core for the union of what
its observers want. A kind whose core is ``functional.attention`` (MHA, GQA,
MQA, ...; ``AttentionLayer.selects_weights``) keeps the fused kernel for its
output and rebuilds just those weights from the kernel's log-sum-exp
(``functional.lse_backend``), so memory grows with the heads and rows asked
for, not with H·T·S; where the kernel cannot serve (dropout in training,
float64 on CUDA, ...) the ``math`` path forms them. A kind with a core of its
own computes every weight and the layer cuts out each observer's part.

The weights an event carries are the ones that mix the values: for plain
MHA/GQA the post-softmax probabilities; a variant that changes how values
are mixed documents what its event's ``weights`` are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..functional.weights import WeightSelection, resolve_selection

__all__ = ["AttentionEvent", "Observer", "observed_selection", "part_of", "notify"]


@dataclass(frozen=True)
class AttentionEvent:
    """What one attention call computed.

    Attributes:
        weights: [B, h, r, S] weights that mix the values (detached), of the
            query heads ``heads`` and query rows ``rows``.
        q: [B, H, T, D] queries after projection (detached).
        k: [B, G, S, D] keys after projection, including cached ones (detached).
        scale: the score multiplier used.
        attn_mask: the mask passed to the attention core (bool True = may
            attend, or float added), or None.
        is_causal: whether causality was applied.
        causal_alignment: "top_left" or "bottom_right".
        kind: the attention kind's registry name (e.g. "mha", "gqa").
        heads: the heads the weights hold (ascending indices into the
            layer's ``num_heads``), h of them.
        rows: the query rows the weights hold (ascending indices into the
            call's T queries), r of them.
        v: [B, G, S, Dv] values after projection, including cached ones
            (detached); None where the caller has none to give.
    """

    weights: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    attn_mask: torch.Tensor | None
    is_causal: bool
    causal_alignment: str
    kind: str
    heads: tuple[int, ...]
    rows: tuple[int, ...]
    v: torch.Tensor | None = None


Observer = Callable[[torch.nn.Module, AttentionEvent], None]

Indices = tuple[int, ...] | None  # ascending indices, None = all


def _union(parts: list[Indices]) -> Indices:
    return None if any(p is None for p in parts) else tuple(sorted(set().union(*parts)))


def observed_selection(
    entries: Iterable[tuple[Observer, WeightSelection]], H: int, T: int
) -> tuple[WeightSelection, list[tuple[Indices, Indices]]]:
    """What a call must compute for its observers: the union of their heads
    and rows, and each observer's own (heads, rows) resolved against H and T.

    Raises:
        ValueError: an observer's heads or rows outside the call's H or T.
    """
    own = [resolve_selection(selection, H, T) for _, selection in entries]
    heads, rows = _union([h for h, _ in own]), _union([r for _, r in own])
    return WeightSelection(heads=heads, rows=rows), own


def _positions(want: Indices, got: Indices) -> list[int] | None:
    """Where the indices ``want`` sit in a tensor holding ``got`` (None: all of them)."""
    if want == got:
        return None
    if got is None:
        return list(want)
    where = {x: i for i, x in enumerate(got)}
    return [where[x] for x in want]


def part_of(weights: torch.Tensor, want: tuple[Indices, Indices], got: tuple[Indices, Indices]) -> torch.Tensor:
    """The weights of heads/rows ``want`` from [B, h, r, S] weights of heads/rows ``got``."""
    heads, rows = _positions(want[0], got[0]), _positions(want[1], got[1])
    if heads is not None:
        weights = weights[:, heads]  # (B, h, r, S) -> (B, h', r, S)
    if rows is not None:
        weights = weights[:, :, rows]  # (B, h', r, S) -> (B, h', r', S)
    return weights


def notify(
    module: torch.nn.Module,
    entries: list[tuple[Observer, WeightSelection]],
    weights: torch.Tensor,
    got: tuple[Indices, Indices],
    H: int,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    **call,
) -> None:
    """Call each observer with an ``AttentionEvent`` holding its part of ``weights``.

    Args:
        weights: [B, h, r, S] of the heads and rows ``got`` (None: all H, T).
        H: the layer's heads (``num_heads``: the heads of its weights, which
            a kind's q may outnumber, as differential attention's 2H do).
        q: [B, H', T, D]; k: [B, G, S, D]; v: [B, G, S, Dv] or None.
        call: the event's scale, attn_mask, is_causal, causal_alignment, kind.
    """
    T = q.shape[2]
    _, own = observed_selection(entries, H, T)
    weights, q, k = weights.detach(), q.detach(), k.detach()
    v = None if v is None else v.detach()
    for (observer, _), (heads, rows) in zip(entries, own):
        event = AttentionEvent(
            weights=part_of(weights, (heads, rows), got), q=q, k=k, v=v, **call,
            heads=tuple(range(H)) if heads is None else heads, rows=tuple(range(T)) if rows is None else rows,
        )  # fmt: skip
        observer(module, event)
