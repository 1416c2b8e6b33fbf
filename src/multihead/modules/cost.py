"""Cost accounting shared by every attention kind.

Conventions (the same for every kind, so kinds compare):

* FLOPs count matrix products only, 2 per multiply-add; softmax, masks,
  biases, norms and gates' elementwise work are not counted (each kind's
  ``cost`` docstring says what else it adds, e.g. routers or composition).
* Attention-core FLOPs count only (query, key) pairs that are actually
  visible: with ``causal=True`` the hidden pairs are not computed by the
  fused kernels, so they are not counted. A layer's ``window`` counts as
  a windowed kernel computes it: only the pairs inside the window (torch's
  SDPA takes the window as a mask and computes every pair of the causal
  triangle). A windowed call with fewer queries than keys runs over a
  cache (a window refuses cross-attention), where the queries are the last
  T positions: its pairs count bottom-right, so a decode step's query sees
  min(S, window) keys. ``kv_cache_bytes_per_token`` stays per token: the
  cache a layer makes holds every position, window or not; a windowed layer
  reads at most its last ``window - 1`` of them.
* ``parameters`` equals ``sum(p.numel() for p in module.parameters())``.
* ``kv_cache_bytes_per_token``: bytes one layer caches per token of one
  sequence at ``bytes_per_element`` (2 for fp16/bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionCost", "visible_pairs"]


@dataclass(frozen=True)
class AttentionCost:
    """Work and memory of one attention layer for one call.

    Attributes:
        core_flops: scores and value mixing (plus any per-kind core work).
        projection_flops: input and output projections (plus routers etc.).
        parameters: trainable parameters of the layer.
        kv_cache_bytes_per_token: cache bytes per token per sequence.
    """

    core_flops: int
    projection_flops: int
    parameters: int
    kv_cache_bytes_per_token: int

    @property
    def total_flops(self) -> int:
        return self.core_flops + self.projection_flops


def visible_pairs(T: int, S: int, *, causal: bool, alignment: str | None = None, window: int | None = None) -> int:
    """Number of (query, key) pairs a query may attend to, T queries x S keys.

    Causal top-left: query i sees keys 0..min(i, S-1); bottom-right: keys
    0..min(i + S - T, S - 1) (none when that is negative). A ``window`` w
    (which implies causality) keeps keys j > i + offset - w of those.
    ``alignment`` None: top-left, but bottom-right with a window (the
    layer's own alignment for a windowed call over a cache; the two agree
    when T = S).
    """
    if not causal and window is None:
        return T * S
    if alignment is None:
        alignment = "top_left" if window is None else "bottom_right"
    offset = 0 if alignment == "top_left" else S - T
    first = (lambda p: 0) if window is None else (lambda p: max(0, p - window + 1))
    return sum(max(0, min(i + offset, S - 1) + 1 - first(i + offset)) for i in range(T))
