"""A key/value cache whose one-token calls all have one shape, for CUDA graphs.

A ``KVCache`` call returns the keys cached so far, [B, G, length, D]: the
shape grows by one position every decoding step, and a CUDA graph replays one
fixed shape. ``GraphKVCache`` takes over a filled ``KVCache``'s buffers (the
prompt's prefill wrote them) and takes one token per call: it writes at
``position``, a device tensor [1] long shared by every block's cache, and
returns the whole buffers [B, G, S_max, D]. The slots after ``position``
hold nothing yet and the model hides them (``GPT.forward``: key mask
``arange(S_max) <= position``, the new token at ``position``)::

    slot      0 1 2 ... 15 | 16 | 17 ... S_max-1
    holds     prompt, steps | new | nothing yet       position = 16
    visible   yes ......... yes | no

Nothing a call does reads a value back to the host or depends on a Python
int that changes from step to step: ``length`` is the constant S_max, and
the caller moves ``position`` on by one after each call, on the device
(``generate`` does it inside the compiled step). So one compiled graph, and
one recorded CUDA graph, serve every step (``models.generation``).

A layer qualifies (``supports_graph_steps``) when where a key sits does not
enter its scores and its cache holds keys and values only: no rope, ALiBi or
window, the default core and cache write, a plain ``KVCache``.
"""

from __future__ import annotations

import torch
from torch import nn

from .kv_cache import KVCache

__all__ = ["GraphKVCache", "supports_graph_steps"]


def supports_graph_steps(layer: nn.Module) -> bool:
    """Whether ``layer`` (an ``AttentionLayer``) decodes over a ``GraphKVCache``:
    no rope, ALiBi or window, the default ``core`` and ``write_cache``, and a
    plain ``KVCache`` from ``make_kv_cache``."""
    from .base import AttentionLayer

    if not isinstance(layer, AttentionLayer):
        return False
    cls = type(layer)
    return (
        layer.rope is None
        and layer.alibi_slopes is None
        and layer.sliding_window is None
        and cls.core is AttentionLayer.core
        and cls.write_cache is AttentionLayer.write_cache
        and type(layer.make_kv_cache(1, 1)) is KVCache
    )


class GraphKVCache(KVCache):
    """One-token calls over a filled ``KVCache``'s buffers at a device-side position.

    Args:
        cache: a plain ``KVCache`` (its buffers are shared, not copied).
        position: [1] long on the cache's device: the slot the next token
            goes to (the cached length); shared by every block's cache and
            moved on by the caller.

    Attributes:
        k: [B, G, S_max, D], v: [B, Gv, S_max, Dv]: the shared buffers.
        position: the [1] long tensor.
        length: S_max, a constant (every call attends over every slot; the
            model masks the slots past ``position``).

    Raises:
        TypeError: ``cache`` not a plain ``KVCache``, ``position`` not a [1]
            long tensor on the buffers' device.
    """

    def __init__(self, cache: KVCache, position: torch.Tensor) -> None:
        nn.Module.__init__(self)
        if type(cache) is not KVCache:
            raise TypeError(f"a GraphKVCache takes over a plain KVCache, got {type(cache).__name__}")
        if (not isinstance(position, torch.Tensor) or position.dtype != torch.long or position.shape != (1,)
                or position.device != cache.k.device):  # fmt: skip
            raise TypeError(f"position must be a [1] torch.long tensor on {cache.k.device}, got {position!r}")
        self.max_len = cache.max_len
        self.cross_source = None
        self.register_buffer("k", cache.k, persistent=False)
        self.register_buffer("v", cache.v, persistent=False)
        self.register_buffer("position", position, persistent=False)

    @property
    def length(self) -> int:
        """S_max: every call attends over every slot (a constant for ``torch.compile``)."""
        return self.max_len

    @length.setter
    def length(self, value: int) -> None:
        raise AttributeError("a GraphKVCache's length is its capacity; its position is the device tensor `position`")

    def reset(self) -> None:
        """Refused: the position lives on the device; build a new cache."""
        raise ValueError("a GraphKVCache cannot be reset; prefill a KVCache again and take it over")

    def save_state(self) -> None:
        """Nothing to save: a failed call's write lands past ``position``, which only the caller moves."""
        return None

    def restore_state(self, state: None) -> None:
        """Nothing to restore (see ``save_state``)."""

    def check_append(self, batch_size: int, T: int) -> None:
        """Raise unless the call is one token of a batch of ``batch_size``.

        Raises:
            ValueError: another batch size, or T != 1.
        """
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache holds batch_size={self.batch_size}, got a batch of {batch_size}")
        if T != 1:
            raise ValueError(f"a GraphKVCache takes one token per call, got {T}")

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k [B, G, 1, D] and v [B, Gv, 1, Dv] at ``position``; return the
        whole buffers (keys [B, G, S_max, D], values [B, Gv, S_max, Dv]).

        Raises:
            ValueError: shapes other than the buffers' with one position.
        """
        B, G, _, D = self.k.shape
        Gv, Dv = self.v.shape[1], self.v.shape[-1]
        if tuple(k.shape) != (B, G, 1, D) or tuple(v.shape) != (B, Gv, 1, Dv):
            raise ValueError(f"a GraphKVCache takes k (B={B}, G={G}, 1, D={D}) and v (G={Gv}, 1, D={Dv}); "
                             f"got k={tuple(k.shape)}, v={tuple(v.shape)}")  # fmt: skip
        self.k.index_copy_(2, self.position, k.detach())
        self.v.index_copy_(2, self.position, v.detach())
        return self.k, self.v

    def visible_slots(self, batch_size: int) -> torch.Tensor:
        """bool [B, S_max]: the slots up to and including ``position``."""
        S = self.max_len
        return (torch.arange(S, device=self.position.device) <= self.position).expand(batch_size, S)  # (S,) -> (B, S)

    def extra_repr(self) -> str:
        B, G, S, D = self.k.shape
        return f"batch_size={B}, num_kv_heads={G}, max_len={S}, head_dim={D}, position on {self.position.device}"
