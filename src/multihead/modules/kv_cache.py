"""Static key/value cache for decoding, sized by key/value heads.

Keys and values live in preallocated buffers of shape (B, G, S_max, D) —
G key/value heads, not H query heads, so GQA/MQA shrink the cache by H / G.
``DynamicKVCache`` adds DCMHA's per-key weights; ``LatentKVCache`` holds
multi-head latent attention's one row [latent | rope key] per token.
The buffers are non-persistent: they never enter a state_dict.

    cache = attn.make_kv_cache(batch_size=2, max_len=64)
    y = attn(prompt, is_causal=True, kv_cache=cache)     # prefill: T tokens
    y = attn(next_tok, is_causal=True, kv_cache=cache)   # then 1+ per step

Under ``torch.compile`` the cached length is a Python int, never a tensor,
so nothing reads a device value to know where to write, and a decoding step
traces with ``fullgraph=True`` (no graph break). Dynamo treats int
attributes of an ``nn.Module`` as constants and would recompile at every new
length (and fail once ``torch._dynamo.config.recompile_limit`` is reached
under ``fullgraph=True``); ``length`` is therefore read inside the graph as an
unspecialised int (``torch._dynamo.patch_dynamo_config(
allow_unspec_int_on_nn_module=True)`` around the read, applied when the
first cache is built). The first new length
recompiles once; automatic dynamic shapes then make it symbolic, so one graph
serves every later step (two compiles in all; one more for a call that fills
the cache to ``max_len`` exactly, where the view of the whole buffer is
contiguous). Dynamo replays the ``length``
update after the graph; the slices ``[:length]`` have the symbolic length.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import non_negative_int, positive_int

__all__ = ["KVCache", "DynamicKVCache", "LatentKVCache"]


class KVCache(nn.Module):
    """Preallocated keys and values for one attention layer.

    Args:
        batch_size: B.
        num_kv_heads: G.
        max_len: S_max, the capacity in tokens.
        head_dim: D of the keys.
        value_dim: D of the values (defaults to ``head_dim``).
        value_heads: heads of the values (defaults to ``num_kv_heads``; a kind
            with one shared key head and H value heads sets it).
        dtype, device: of the buffers.

    The cache is an inference device: writes are detached, so no gradient
    flows through cached keys and values.

    Attributes:
        k: [B, G, S_max, D] key buffer; v: [B, Gv, S_max, Dv] value buffer.
        length: number of positions written so far (a Python int; see
            the module docstring for how ``torch.compile`` treats it).
        batch_size: B.
        cross_source: the key tensor a cross-attention call filled the cache
            from (None for a self-attention cache; set in eager mode).
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        value_heads: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _patch_traced_length()
        B = positive_int("batch_size", batch_size)
        G = positive_int("num_kv_heads", num_kv_heads)
        S = positive_int("max_len", max_len)
        D = positive_int("head_dim", head_dim)
        Dv = D if value_dim is None else positive_int("value_dim", value_dim)
        Gv = G if value_heads is None else positive_int("value_heads", value_heads)
        self.max_len = S
        self.length = 0
        self.cross_source: torch.Tensor | None = None
        self.register_buffer("k", torch.zeros(B, G, S, D, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(B, Gv, S, Dv, dtype=dtype, device=device), persistent=False)

    @property
    def length(self) -> int:
        """Number of positions written so far (a Python int)."""
        if torch.compiler.is_compiling():
            return self._traced_length()
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if torch.compiler.is_compiling():
            self._length = value
        else:
            self.__dict__["_length"] = value  # a plain int: skip nn.Module.__setattr__'s lookups

    @property
    def batch_size(self) -> int:
        """B, the batch size the buffers hold."""
        return self.k.shape[0]

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused)."""
        self.length = 0
        self.cross_source = None

    def save_state(self) -> int:
        """What ``restore_state`` needs to undo the calls after it: the length
        (later writes land past it, so nothing else changes)."""
        return self.length

    def restore_state(self, state: int) -> None:
        """Return to a ``save_state`` taken before a call that failed."""
        self.length = state

    def check_append(self, batch_size: int, T: int) -> None:
        """Raise unless ``T`` positions of a batch of ``batch_size`` can be appended.

        Models with one cache per layer call this for every cache before
        the first write, so a call that fails writes nothing anywhere.

        Raises:
            ValueError: a batch size other than the cache's, or a write past
                capacity (naming the numbers).
        """
        self._check_room(batch_size, T, self.length)

    def _check_room(self, batch_size: int, T: int, length: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache holds batch_size={self.batch_size}, got a batch of {batch_size}")
        if length + T > self.max_len:
            raise ValueError(
                f"KV cache overflow: {length} cached + {T} new = {length + T} > max_len {self.max_len}"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T new positions and return everything cached so far.

        Args:
            k: [B, G, T, D] new keys.
            v: [B, Gv, T, Dv] new values.

        Returns:
            (keys [B, G, length, D], values [B, Gv, length, Dv]) after the write,
            views into the buffers.

        Raises:
            ValueError: shapes that do not match the buffers, or a write past
                capacity (raised before anything is written).
        """
        B, G, _, D = self.k.shape
        Gv, Dv = self.v.shape[1], self.v.shape[-1]
        if k.dim() != 4 or v.dim() != 4 or k.shape[2] != v.shape[2]:
            raise ValueError(
                f"k and v must be (B, G, T, D) with equal T; got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        T = k.shape[2]
        if (k.shape[0], k.shape[1], k.shape[3]) != (B, G, D) or (v.shape[0], v.shape[1], v.shape[3]) != (B, Gv, Dv):
            raise ValueError(
                f"cache holds k (B={B}, G={G}, D={D}) and v (G={Gv}, D={Dv}); "
                f"got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        start = self.length
        self._check_room(B, T, start)
        end = start + T
        self.k[:, :, start:end] = k.detach()
        self.v[:, :, start:end] = v.detach()
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def extra_repr(self) -> str:
        B, G, S, D = self.k.shape
        return f"batch_size={B}, num_kv_heads={G}, max_len={S}, head_dim={D}, length={self.length}"


class DynamicKVCache(KVCache):
    """KV cache that also keeps each key token's key-side composition weights.

    Attributes:
        kw: [B, S_max, 2, 2R + 1, H]: per cached token, for pre (0) and post
            (1) composition, rows [w1 (R) | w2 (R) | dd (1)] over heads.
    """

    def __init__(self, batch_size: int, num_heads: int, max_len: int, head_dim: int, rank: int, **kw) -> None:
        super().__init__(batch_size, num_heads, max_len, head_dim, **kw)
        B, H, S = self.k.shape[0], self.k.shape[1], self.max_len
        self.register_buffer(
            "kw", torch.zeros(B, S, 2, 2 * rank + 1, H, dtype=self.k.dtype, device=self.k.device), persistent=False
        )

    def update(self, k: torch.Tensor, v: torch.Tensor, kw: torch.Tensor | None = None):
        """Append keys, values and key-side weights; return all three cached so far.

        Raises:
            ValueError: shapes that do not match, or a write past capacity
                (raised before anything is written).
        """
        if kw is None:
            raise ValueError("DynamicKVCache.update needs the key-side weights kw")
        want = (self.kw.shape[0], k.shape[2], *self.kw.shape[2:])
        if tuple(kw.shape) != want:
            raise ValueError(f"kw must be {want}, got {tuple(kw.shape)}")
        start = self.length
        k_all, v_all = super().update(k, v)
        self.kw[:, start : self.length] = kw.detach()
        return k_all, v_all, self.kw[:, : self.length]


class LatentKVCache(KVCache):
    """The cache of absorbed decoding: per token the normalised latent c and the
    rotated rope key, one row [c | k_R] of L + R channels shared by every head.

    Args:
        batch_size: B; max_len: S_max; latent_dim: L (kv_lora_rank);
        rope_dim: R (qk_rope_head_dim, 0: none); dtype, device: of the buffer.

    Attributes:
        k: [B, 1, S_max, L + R]; the values are its first L channels (no
            second buffer). ``length``, ``reset``, ``check_append`` and
            ``cross_source`` as :class:`KVCache`.
    """

    def __init__(self, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, dtype=None, device=None):
        torch.nn.Module.__init__(self)
        _patch_traced_length()
        B, S = positive_int("batch_size", batch_size), positive_int("max_len", max_len)
        self.latent_dim = positive_int("latent_dim", latent_dim)
        self.max_len = S
        self.length = 0
        self.cross_source = None
        shape = (B, 1, S, self.latent_dim + non_negative_int("rope_dim", rope_dim))
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [B, 1, T, L + R]; return (keys [B, 1, length, L + R],
        values [B, 1, length, L], a view of the keys' first L channels).

        Raises:
            ValueError: a shape other than the buffer's, or a write past capacity.
        """
        if k.dim() != 4 or k.shape[0] != self.k.shape[0] or k.shape[1] != 1 or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"latent cache holds rows (B, 1, T, {self.k.shape[3]}), got {tuple(k.shape)}")
        start = self.length
        self._check_room(k.shape[0], k.shape[2], start)
        end = start + k.shape[2]
        self.k[:, :, start:end] = k.detach()
        self.length = end
        keys = self.k[:, :, :end]
        return keys, keys[..., : self.latent_dim]

    def extra_repr(self) -> str:
        B, _, S, W = self.k.shape
        return f"batch_size={B}, max_len={S}, latent_dim={self.latent_dim}, rope_dim={W - self.latent_dim}, " \
            f"length={self.length}"


def _length_plus_zero(cache: KVCache) -> int:
    # `+ 0` makes dynamo wrap the attribute here, under the patched config.
    return cache._length + 0


def _patch_traced_length() -> None:
    """Give ``KVCache._traced_length`` dynamo's traceable config patch (recent torch;
    without it the length is a constant to dynamo and every new length recompiles).

    Done when the first cache is built, not at import: importing torch._dynamo
    takes about a second, which ``import multihead`` should not pay.
    """
    if "_traced_length" in KVCache.__dict__:
        return
    import torch._dynamo

    patch = getattr(torch._dynamo, "patch_dynamo_config", None)
    KVCache._traced_length = _length_plus_zero if patch is None else patch(allow_unspec_int_on_nn_module=True)(
        _length_plus_zero
    )
