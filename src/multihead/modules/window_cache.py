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

A kind whose cache holds more per position gets the same window over all of
it, since what it holds for a key is read only by queries that see that key:
``WindowDynamicKVCache`` keeps DCMHA's key-side composition weights of the
kept keys (the composition mixes heads within each query-key pair, so a
hidden key adds nothing before or after the softmax), and
``WindowLatentKVCache`` keeps the last w latent rows [c | k_R] of MLA's
absorbed path. ``window_cache`` picks the windowed class of the layer's own
cache (``KVCache``, ``DynamicKVCache``, ``LatentKVCache``); any other cache
(a kind's own class) is built full.
"""

from __future__ import annotations

import torch

from .._checks import non_negative_int, positive_int
from .kv_cache import DynamicKVCache, KVCache, LatentKVCache

__all__ = ["WindowKVCache", "WindowDynamicKVCache", "WindowLatentKVCache", "window_cache", "cached_positions"]


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

    # the tensors kept per position, and the dimension their positions run along
    _kept_dims = {"k": 2, "v": 2}

    def reset(self) -> None:
        """Forget every position (the kept tensors are freed)."""
        super().reset()
        for name, dim in self._kept_dims.items():  # (B, G, 0, D): nothing kept
            kept = getattr(self, name, None)  # None: a subclass's own, registered after this init
            if kept is not None:
                setattr(self, name, kept.narrow(dim, 0, 0).clone())

    def save_state(self) -> tuple:
        """(length, the kept tensors): what ``restore_state`` puts back (no copy)."""
        return self.length, tuple(getattr(self, name) for name in self._kept_dims)

    def restore_state(self, state: tuple) -> None:
        """Return to a ``save_state`` taken before a call that failed."""
        self.length, kept = state
        for name, tensor in zip(self._kept_dims, kept):
            setattr(self, name, tensor)

    def _slide(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Replace the kept tensor ``name`` by the last w of its last min(m, w - 1)
        positions and ``new``'s; return those positions (what the call attends over)."""
        dim, kept = self._kept_dims[name], getattr(self, name)
        m = kept.shape[dim]
        r = min(m, self.window - 1)  # kept positions no new query sees are left out
        seen = torch.cat([kept.narrow(dim, m - r, r), new.detach()], dim=dim)  # (.., r + T, ..)
        n = seen.shape[dim]
        # a one-token step: the call's positions are the cache; a longer call: copy its last w
        # out, so the rest is freed
        setattr(self, name, seen if n <= self.window else seen.narrow(dim, n - self.window, self.window).clone())
        return seen

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
        keys, values = self._slide("k", k), self._slide("v", v)
        self.length = self.length + T
        return keys, values

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, num_kv_heads={self.k.shape[1]}, window={self.window}, "
                f"max_len={self.max_len}, head_dim={self.k.shape[3]}, length={self.length}")  # fmt: skip


class WindowDynamicKVCache(WindowKVCache):
    """The last ``window`` positions of a local DCMHA layer: keys, values and
    each kept key's key-side composition weights (``DynamicKVCache``'s ``kw``).

    Args:
        batch_size, num_heads, max_len, head_dim, window, dtype, device: as
            ``WindowKVCache`` (H key/value heads). rank: R of the dynamic
            composition.

    Attributes:
        k, v: [B, H, m, D], m = min(length, w); kw: [B, m, 2, 2R + 1, H].
    """

    _kept_dims = {"k": 2, "v": 2, "kw": 1}

    def __init__(self, batch_size: int, num_heads: int, max_len: int, head_dim: int, rank: int, *, window: int,
                 dtype=None, device=None) -> None:  # fmt: skip
        super().__init__(batch_size, num_heads, max_len, head_dim, window=window, dtype=dtype, device=device)
        B, H, R = self.batch_size, self.k.shape[1], positive_int("rank", rank)
        self.register_buffer("kw", self.k.new_zeros(B, 0, 2, 2 * R + 1, H), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, kw: torch.Tensor | None = None):
        """Append keys, values and key-side weights kw [B, T, 2, 2R + 1, H]; return
        the three over the positions the call attends over (as ``WindowKVCache``).

        Raises:
            ValueError: shapes that do not match, or a write past ``max_len``
                (raised before anything is written).
        """
        if kw is None:
            raise ValueError("WindowDynamicKVCache.update needs the key-side weights kw")
        want = (self.kw.shape[0], k.shape[2] if k.dim() == 4 else None, *self.kw.shape[2:])
        if tuple(kw.shape) != want:
            raise ValueError(f"kw must be {want}, got {tuple(kw.shape)}")
        keys, values = super().update(k, v)
        return keys, values, self._slide("kw", kw)


class WindowLatentKVCache(WindowKVCache):
    """The last ``window`` latent rows [c | k_R] of a local MLA layer on the
    absorbed path (``LatentKVCache``'s layout: the values are the rows' first
    L channels, no second tensor).

    Args:
        batch_size, max_len, latent_dim, rope_dim, dtype, device: as
            ``LatentKVCache``. window: w (>= 1).

    Attributes:
        k: [B, 1, m, L + R], m = min(length, w). latent_dim: L.
    """

    _kept_dims = {"k": 2}

    def __init__(self, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, window: int, dtype=None,
                 device=None) -> None:  # fmt: skip
        self.latent_dim = positive_int("latent_dim", latent_dim)
        width = self.latent_dim + non_negative_int("rope_dim", rope_dim)
        super().__init__(batch_size, 1, max_len, width, window=window, value_dim=1, dtype=dtype, device=device)
        del self.v  # the values are the keys' first L channels

    def update(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows k [B, 1, T, L + R]; return (keys [B, 1, r + T, L + R],
        values: their first L channels) over the positions the call attends over.

        Raises:
            ValueError: a shape other than the cache's, or a write past ``max_len``.
        """
        if k.dim() != 4 or k.shape[0] != self.k.shape[0] or k.shape[1] != 1 or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"latent cache holds rows (B, 1, T, {self.k.shape[3]}), got {tuple(k.shape)}")
        self._check_room(k.shape[0], k.shape[2], self.length)
        keys = self._slide("k", k)
        self.length = self.length + k.shape[2]
        return keys, keys[..., : self.latent_dim]

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, window={self.window}, max_len={self.max_len}, "
                f"latent_dim={self.latent_dim}, rope_dim={self.k.shape[3] - self.latent_dim}, length={self.length}")  # fmt: skip


def _window_of_kv(probe: KVCache, max_len: int, window: int) -> WindowKVCache:
    return WindowKVCache(probe.batch_size, probe.k.shape[1], max_len, probe.k.shape[3], window=window,
                         value_dim=probe.v.shape[3], value_heads=probe.v.shape[1], dtype=probe.k.dtype,
                         device=probe.k.device)  # fmt: skip


def _window_of_dynamic(probe: DynamicKVCache, max_len: int, window: int) -> WindowDynamicKVCache:
    return WindowDynamicKVCache(probe.batch_size, probe.k.shape[1], max_len, probe.k.shape[3],
                                (probe.kw.shape[3] - 1) // 2, window=window, dtype=probe.k.dtype,
                                device=probe.k.device)  # fmt: skip


def _window_of_latent(probe: LatentKVCache, max_len: int, window: int) -> WindowLatentKVCache:
    return WindowLatentKVCache(probe.batch_size, max_len, probe.latent_dim, probe.k.shape[3] - probe.latent_dim,
                               window=window, dtype=probe.k.dtype, device=probe.k.device)  # fmt: skip


# a layer's own cache class -> its windowed cache, built from a one-position cache of the layer
_WINDOWED = {KVCache: _window_of_kv, DynamicKVCache: _window_of_dynamic, LatentKVCache: _window_of_latent}


def window_cache(layer, batch_size: int, max_len: int, **options) -> KVCache:
    """The decoding cache of ``layer`` for up to ``max_len`` positions: when it
    has a window (``layer.sliding_window``) and its own cache is a ``KVCache``,
    ``DynamicKVCache`` or ``LatentKVCache``, the windowed class of that cache
    (``WindowKVCache``, ``WindowDynamicKVCache``, ``WindowLatentKVCache``);
    else ``layer.make_kv_cache``'s. ``options`` (dtype, device) go to
    ``layer.make_kv_cache``.

    Raises:
        TypeError / ValueError: as ``make_kv_cache`` (sizes).
    """
    window = getattr(layer, "sliding_window", None)
    if window is None:
        return layer.make_kv_cache(batch_size, max_len, **options)
    probe = layer.make_kv_cache(batch_size, 1, **options)  # its layout, shapes, dtype and device
    build = _WINDOWED.get(type(probe))
    if build is None:
        return layer.make_kv_cache(batch_size, max_len, **options)
    return build(probe, positive_int("max_len", max_len), window)


def cached_positions(layer, n: int) -> int:
    """Positions of one sequence ``window_cache(layer, B, n)`` holds once n are written:
    min(n, window) for a layer it bounds, n (all it allocates) otherwise."""
    window = getattr(layer, "sliding_window", None)
    if window is None:
        return n
    return min(n, window) if type(layer.make_kv_cache(1, 1)) in _WINDOWED else n
