"""What tools attach to an attention layer: observers and head hooks.

``HookedLayer`` is the base of ``base.AttentionLayer``; it keeps the two
registries and their handles, and the layer's forward calls them::

    forward: ... core -> out [B, H, T, Dv], weights
             notify_observers(weights, ...)   every observer, while ``observed``
             out = run_head_hooks(out)        only while a head hook is registered
             merge_heads(out)

* Observers (``register_attention_observer``) receive the exact weights of
  each call as an ``observe.AttentionEvent``; the layer computes those
  weights only while one is registered (``observed``).
* Head hooks (``register_head_hook``): ``fn(layer, out)`` sees each head's
  context out [B, H, T, Dv] (the weights times the values, H query heads,
  before ``merge_heads``) on every forward and may return a replacement of
  the same shape, or None to keep it. Hooks run in registration order, each
  on the previous one's result; with none registered the forward is
  unchanged. ``tools.heads`` masks heads with them, ``tools.importance``
  scores heads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..functional import WeightSelection
from .observe import Observer

__all__ = ["HookedLayer"]


class HookedLayer(nn.Module):
    """A module with the observer and head-hook registries of an attention layer
    (``AttentionLayer`` subclasses it; see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._attention_observers: OrderedDict[int, Observer] = OrderedDict()
        self._head_hooks: OrderedDict[int, Callable] = OrderedDict()

    # ------------------------------------------------------------------ observers
    @property
    def observed(self) -> bool:
        """True while at least one observer is registered."""
        return bool(self._attention_observers)

    def register_attention_observer(self, observer: Observer, *, heads=None, rows=None) -> RemovableHandle:
        """Call ``observer(module, event)`` after every forward until removed.

        While one is registered the layer computes the exact weights (those that
        mix the values) of the ``heads`` and ``rows`` observers ask for (None: all;
        ``functional.WeightSelection``; ``modules.observe`` says where they come
        from). Returns a handle whose ``remove()`` unregisters it. Raises
        TypeError / ValueError: ``observer`` not callable, heads/rows not ascending ints.
        """
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        handle = RemovableHandle(self._attention_observers)
        self._attention_observers[handle.id] = (observer, WeightSelection(heads=heads, rows=rows))
        return handle

    # ------------------------------------------------------------------ head hooks
    def register_head_hook(self, fn: Callable) -> RemovableHandle:
        """Call ``fn(layer, out)`` on every forward's head outputs until removed.

        ``out`` is [B, H, T, Dv]: head h's context (its attention weights
        times its values), before the heads are merged by ``out_proj``.
        ``fn`` returns None (keep ``out``) or a tensor of the same shape that
        replaces it (e.g. zeros for a masked head).

        Returns:
            a handle whose ``remove()`` unregisters the hook.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"head hook must be callable, got {type(fn).__name__}")
        handle = RemovableHandle(self._head_hooks)
        self._head_hooks[handle.id] = fn
        return handle

    def run_head_hooks(self, out: torch.Tensor) -> torch.Tensor:
        """Pass out [B, H, T, Dv] through the head hooks in registration order.

        Raises:
            TypeError / ValueError: a hook returned something other than None
                or a tensor of out's shape.
        """
        for fn in list(self._head_hooks.values()):
            result = fn(self, out)
            if result is None:
                continue
            if not isinstance(result, torch.Tensor):
                raise TypeError(f"head hook {fn!r} returned {type(result).__name__}, expected a tensor or None")
            if result.shape != out.shape:
                raise ValueError(f"head hook {fn!r} returned shape {tuple(result.shape)}, expected {tuple(out.shape)}")
            out = result
        return out
