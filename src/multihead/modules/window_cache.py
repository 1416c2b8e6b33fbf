"""The decoding cache of a local (sliding-window) layer: its last ``window`` positions.

A layer with ``window=w`` lets query i see keys i - w + 1 .. i, so once a
query has come, no later one reads a key more than w - 1 positions behind
it. ``window_cache(layer, B, max_len)`` gives such a layer a
``WindowKVCache`` that keeps the last w positions instead of all ``max_len``
(``GPT.make_kv_caches`` builds one for every block whose layer has a window)::

    positions written   0 1 2 ... 9 | 10          (w = 4, a one-token call at position 10)
    cache holds                 6 7 8 9           the last w
    the call attends over         7 8 9 10        the last w - 1 and its own
    cache holds after             7 8 9 10

A call of T new positions attends over the last w - 1 kept keys and its T
new ones, in position order (so causality, the window, ALiBi's distances and
``key_mask`` columns are those of the full cache, shifted), then keeps the
last w of them. The layer's window mask hides every key the cache dropped,
so the outputs are the full cache's (tests/modules/test_window_cache.py).
``length`` counts every position written and ``max_len`` bounds it as it
does a ``KVCache``; ``key_mask`` and ``attn_mask`` may span every position
written (their last columns are the kept keys', ``local.kept_key_columns``);
weights a call returns or observers see span the keys it attends over.

The keys and values are new tensors after each call (a one-token step
concatenates w - 1 kept positions and its own: one copy of the window, no
more), so a failed call restores the previous ones by reference
(``save_state`` / ``restore_state``, what ``calls.rollback_on_error`` uses).

Only a cache of keys and values is bounded: a kind whose cache holds more
(DCMHA's key-side weights, MLA's latent rows) keeps its own full cache.
"""

from __future__ import annotations

import torch

from .._checks import positive_int
from .kv_cache import KVCache

__all__ = ["WindowKVCache", "window_cache", "cached_positions"]


class WindowKVCache(KVCache):
    """The last ``window`` positions of a local layer's keys and values.

    Args:
        batch_size, num_kv_heads, max_len, head_dim, value_dim, value_heads,
            dtype, device: as ``KVCache`` (``max_len`` bounds ``length``, not
            the storage).
        window: w, the layer's window (>= 1).

    Attributes:
        k: [B, G, m, D] the kept keys, m = min(length, w); v: [B, Gv, m, Dv].
        window: w. ``length``, ``max_len``, ``batch_size``, ``reset``,
            ``check_append`` as ``KVCache``.

    Raises:
        TypeError / ValueError: sizes that are not positive ints.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *, window: int,
                 value_dim: int | None = None, value_heads: int | None = None, dtype=None, device=None) -> None:  # fmt: skip
        super().__init__(batch_size, num_kv_heads, 1, head_dim, value_dim=value_dim, value_heads=value_heads,
                         dtype=dtype, device=device)  # fmt: skip
        self.max_len = positive_int("max_len", max_len)
        self.window = positive_int("window", window)
        self.reset()

    def reset(self) -> None:
        """Forget every position (the kept keys and values are freed)."""
        super().reset()
        self.k, self.v = self.k[:, :, :0].clone(), self.v[:, :, :0].clone()  # (B, G, 0, D): nothing kept

    def save_state(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(length, keys, values): what ``restore_state`` puts back (no copy)."""
        return self.length, self.k, self.v

    def restore_state(self, state: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        """Return to a ``save_state`` taken before a call that failed."""
        self.length, self.k, self.v = state

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T new positions; return the keys [B, G, r + T, D] and values
        the call attends over: the last r = min(m, w - 1) kept positions and
        the T new ones, in order.

        Raises:
            ValueError: shapes that do not match the cache's, or a write past
                ``max_len`` (raised before anything is written).
        """
        B, G, _, D = self.k.shape
        Gv, Dv = self.v.shape[1], self.v.shape[-1]
        if k.dim() != 4 or v.dim() != 4 or k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must be (B, G, T, D) with equal T; got k={tuple(k.shape)}, v={tuple(v.shape)}")
        if (k.shape[0], k.shape[1], k.shape[3]) != (B, G, D) or (v.shape[0], v.shape[1], v.shape[3]) != (B, Gv, Dv):
            raise ValueError(f"cache holds k (B={B}, G={G}, D={D}) and v (G={Gv}, D={Dv}); "
                             f"got k={tuple(k.shape)}, v={tuple(v.shape)}")  # fmt: skip
        T = k.shape[2]
        self._check_room(B, T, self.length)
        m = self.k.shape[2]
        first = m - min(m, self.window - 1)  # kept keys no new query sees are left out
        keys = torch.cat([self.k[:, :, first:], k.detach()], dim=2)  # (B, G, r + T, D)
        values = torch.cat([self.v[:, :, first:], v.detach()], dim=2)
        n = keys.shape[2]
        if n <= self.window:  # a one-token step: the call's keys are the cache
            self.k, self.v = keys, values
        else:  # a longer call: copy its last w out, so the rest is freed
            self.k, self.v = keys[:, :, n - self.window :].clone(), values[:, :, n - self.window :].clone()
        self.length = self.length + T
        return keys, values

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, num_kv_heads={self.k.shape[1]}, window={self.window}, "
                f"max_len={self.max_len}, head_dim={self.k.shape[3]}, length={self.length}")  # fmt: skip


def window_cache(layer, batch_size: int, max_len: int) -> KVCache:
    """The decoding cache of ``layer`` for up to ``max_len`` positions: a
    ``WindowKVCache`` of its window when it has one (``layer.sliding_window``)
    and its cache holds keys and values only, else ``layer.make_kv_cache``'s.

    Raises:
        TypeError / ValueError: as ``make_kv_cache`` (sizes).
    """
    window = getattr(layer, "sliding_window", None)
    if window is None:
        return layer.make_kv_cache(batch_size, max_len)
    probe = layer.make_kv_cache(batch_size, 1)  # its shapes, dtype and device
    if type(probe) is not KVCache:
        return layer.make_kv_cache(batch_size, max_len)
    return WindowKVCache(batch_size, probe.k.shape[1], max_len, probe.k.shape[3], window=window,
                         value_dim=probe.v.shape[3], value_heads=probe.v.shape[1], dtype=probe.k.dtype,
                         device=probe.k.device)  # fmt: skip


def cached_positions(layer, n: int) -> int:
    """Positions of one sequence ``window_cache(layer, B, n)`` holds once n are written:
    min(n, window) for a layer it bounds, n (all it allocates) otherwise."""
    window = getattr(layer, "sliding_window", None)
    if window is None:
        return n
    return min(n, window) if type(layer.make_kv_cache(1, 1)) is KVCache else n
