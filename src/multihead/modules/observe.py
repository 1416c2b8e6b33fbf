"""Observing attention: callbacks that receive the exact weights of a call.

Every attention kind (``base.AttentionLayer``) keeps a registry of
observers. Tools (the head explorer's capture, importance scores) register a
callback; while at least one is
registered the module computes its exact weights (the ``math`` backend) and
hands each callback an ``AttentionEvent``. With no callback registered the
module pays one dict-emptiness check per call and runs its fast path.

    handle = attn.register_attention_observer(lambda module, event: ...)
    ...
    handle.remove()

The weights an event carries are the ones that mix the values: for plain
MHA/GQA the post-softmax probabilities; a variant that changes how values
are mixed documents what its event's ``weights`` are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AttentionEvent", "Observer"]


@dataclass(frozen=True)
class AttentionEvent:
    """What one attention call computed.

    Attributes:
        weights: [B, H, T, S] weights that mix the values (detached).
        q: [B, H, T, D] queries after projection (detached).
        k: [B, G, S, D] keys after projection, including cached ones (detached).
        scale: the score multiplier used.
        attn_mask: the mask passed to the attention core (bool True = may
            attend, or float added), or None.
        is_causal: whether causality was applied.
        causal_alignment: "top_left" or "bottom_right".
        kind: the attention kind's registry name (e.g. "mha", "gqa").
    """

    weights: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    attn_mask: torch.Tensor | None
    is_causal: bool
    causal_alignment: str
    kind: str


Observer = Callable[[torch.nn.Module, AttentionEvent], None]
