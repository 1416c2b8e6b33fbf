"""Observing attention: callbacks that receive the exact weights of a call.

Every attention kind mixes in ``Observable``. Tools (the head explorer's
capture, importance scores) register a callback; while at least one is
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

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["AttentionEvent", "Observable", "Observer"]


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


class Observable:
    """Mixin for attention modules: a registry of observers.

    The module calls ``self._notify(event)`` after computing; ``observed``
    tells it whether to compute exact weights at all.
    """

    def _observers_dict(self) -> OrderedDict[int, Observer]:
        observers = self.__dict__.get("_attention_observers")
        if observers is None:
            observers = OrderedDict()  # RemovableHandle needs a weak reference
            self.__dict__["_attention_observers"] = observers
        return observers

    @property
    def observed(self) -> bool:
        """True while at least one observer is registered."""
        return bool(self.__dict__.get("_attention_observers"))

    def register_attention_observer(self, observer: Observer) -> RemovableHandle:
        """Call ``observer(module, event)`` after every forward until removed.

        Returns:
            a handle whose ``remove()`` unregisters the observer.
        """
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        observers = self._observers_dict()
        handle = RemovableHandle(observers)
        observers[handle.id] = observer
        return handle

    def _notify(self, event: AttentionEvent) -> None:
        for observer in list(self._observers_dict().values()):
            observer(self, event)
