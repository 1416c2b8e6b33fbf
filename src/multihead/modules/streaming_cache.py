"""A streaming key/value cache (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453).

Keeps the first ``sink_tokens`` positions (the "attention sinks" the paper
found every head leans on) and the last ``window`` positions, so decoding
runs on for any number of tokens in bounded memory::

    cache = streaming_cache(layer, batch_size=2, sink_tokens=4, window=60, max_step=16)
    for x_t in stream:                       # [B, 1, C] (or up to max_step at a time)
        y_t = layer(x_t, is_causal=True, kv_cache=cache)

Query at position p sees key j when j <= p and (j < sink_tokens or
j > p - window): the same keys as full attention with that mask, which is
what the outputs equal (tests/modules/test_streaming_cache.py).

Positions (``positions=``):

* "original" (the default): cached keys keep their original positions. Rope
  is applied before the write (``AttentionLayer.position_qk``), so a cached
  key stays rotated at the position it was written at and a query at its own
  position (``length``, the number of tokens seen, offsets the queries); a
  model whose rope was trained on short contexts then sees relative distances
  up to the stream's length between a query and the sink tokens.
* "cache": the paper's rule, positions are slots in the cache. The layer
  stores its keys before qk_norm and rope, and after each write places the m
  kept keys at positions 0 .. m - 1 and its T queries at m - T .. m - 1
  (the slots of their own keys), so no distance exceeds the cache's size
  however long the stream runs::

      kept   0 1 2 3 | 96 97 ... 127 128      (4 sinks, window 33, token 128 the query)
      slot   0 1 2 3 |  4  5 ...  35  36      rope positions; the query at 36

ALiBi's distances are always those of the slots (its bias counts key
indices, ``functional.alibi``), in both modes. The visible-keys mask below
reads original positions in both.

Buffers: (B, G, sink_tokens + window - 1 + max_step, D); a call of T <= max_step
new positions first drops the positions no later query may see, then appends.
``length`` counts every position seen; ``key_positions()`` says which are kept.
"""

from __future__ import annotations

import torch

from .._checks import non_negative_int, positive_int
from .kv_cache import KVCache

__all__ = ["StreamingKVCache", "streaming_cache", "POSITIONS"]

POSITIONS = ("original", "cache")  # where rope places the kept keys (module docstring)


class StreamingKVCache(KVCache):
    """The first ``sink_tokens`` and the last ``window`` positions of a stream.

    Args:
        batch_size, num_kv_heads, head_dim, value_dim, value_heads, dtype,
            device: as ``KVCache``.
        sink_tokens: k, the first positions kept for good (>= 0).
        window: w, each query sees the w - 1 positions before it and itself (>= 1).
        max_step: the most positions one call appends (a prompt longer than
            that is fed in pieces).
        positions: "original" or "cache": where the layer places the kept
            keys and the queries for rope (module docstring).

    Raises:
        TypeError / ValueError: sizes that are not ints of the right range.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *, sink_tokens: int, window: int,
                 max_step: int, positions: str = "original", **options) -> None:  # fmt: skip
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {list(POSITIONS)}, got positions={positions!r}")
        self.positions = positions
        self.sink_tokens = non_negative_int("sink_tokens", sink_tokens)
        self.window = positive_int("window", window)
        self.max_step = positive_int("max_step", max_step)
        super().__init__(batch_size, num_kv_heads, sink_tokens + window - 1 + max_step, head_dim, **options)
        self._start = 0  # first kept position after the sink tokens (those before it were dropped)

    def reset(self) -> None:
        """Forget every position (the buffers are reused)."""
        super().reset()
        self._start = 0

    def _layout(self, n: int) -> tuple[int, int, int]:
        """(s0, lo, m) for n positions seen: buffer [0, s0) holds positions 0 .. s0 - 1,
        [s0, m) positions lo .. n - 1."""
        s0 = min(self.sink_tokens, n)
        lo = max(s0, self._start)
        return s0, lo, s0 + n - lo

    def key_positions(self) -> torch.Tensor:
        """The positions of the kept keys, [m] long, ascending."""
        s0, lo, _ = self._layout(self.length)
        return torch.cat([torch.arange(s0), torch.arange(lo, self.length)])

    def visible_keys(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """bool [T, m]: query at q_pos [T] sees key at k_pos [m] (module docstring)."""
        j, p = k_pos[None, :], q_pos[:, None]
        return (j <= p) & ((j < self.sink_tokens) | (j > p - self.window))

    def check_append(self, batch_size: int, T: int) -> None:
        """Raise unless a call of ``T`` positions of a batch of ``batch_size`` fits.

        Raises:
            ValueError: another batch size, or T > max_step.
        """
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache holds batch_size={self.batch_size}, got a batch of {batch_size}")
        if T > self.max_step:
            raise ValueError(f"streaming cache takes at most max_step={self.max_step} new positions per call, "
                             f"got {T}: feed them in pieces")  # fmt: skip

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the positions no query from now on sees, append T new ones, and
        return the kept keys [B, G, m, D] and values (positions ``key_positions()``).

        Raises:
            ValueError: shapes that do not match the buffers, another batch
                size or T > max_step (before anything is written or dropped).
        """
        B, G, _, D = self.k.shape
        Gv, Dv = self.v.shape[1], self.v.shape[-1]
        if k.dim() != 4 or v.dim() != 4 or k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must be (B, G, T, D) with equal T; got k={tuple(k.shape)}, v={tuple(v.shape)}")
        if (k.shape[1], k.shape[3]) != (G, D) or (v.shape[1], v.shape[3]) != (Gv, Dv):
            raise ValueError(f"cache holds k (G={G}, D={D}) and v (G={Gv}, D={Dv}); "
                             f"got k={tuple(k.shape)}, v={tuple(v.shape)}")  # fmt: skip
        T = k.shape[2]
        self.check_append(k.shape[0], T)
        n = self.length
        s0, lo, m = self._layout(n)
        keep = max(lo, n - self.window + 1)  # queries from n on see no position before this one (but the sinks)
        if keep > lo:
            count = n - keep
            for buf in (self.k, self.v):
                buf[:, :, s0 : s0 + count] = buf[:, :, m - count : m].clone()
            self._start, m = keep, s0 + count
        self.k[:, :, m : m + T] = k.detach()
        self.v[:, :, m : m + T] = v.detach()
        self.length = n + T
        return self.k[:, :, : m + T], self.v[:, :, : m + T]

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, sink_tokens={self.sink_tokens}, window={self.window}, "
                f"max_step={self.max_step}, positions={self.positions!r}, length={self.length}")  # fmt: skip


def streaming_cache(layer, batch_size: int, *, sink_tokens: int, window: int, max_step: int,
                    positions: str = "original") -> StreamingKVCache:  # fmt: skip
    """A ``StreamingKVCache`` shaped like ``layer.make_kv_cache``'s, on its device and dtype.

    Raises:
        ValueError: a kind whose cache holds more than keys and values (its
            own cache class), or invalid sizes.
    """
    plain = layer.make_kv_cache(batch_size, 1)
    if type(plain) is not KVCache:
        raise ValueError(f"{getattr(layer, 'kind', type(layer).__name__)!r} attention keeps a cache of its own "
                         f"({type(plain).__name__}); a streaming cache holds keys and values only")  # fmt: skip
    return StreamingKVCache(
        batch_size, plain.k.shape[1], plain.k.shape[3], sink_tokens=sink_tokens, window=window, max_step=max_step,
        positions=positions, value_dim=plain.v.shape[3], value_heads=plain.v.shape[1], dtype=plain.k.dtype, device=plain.k.device,
    )  # fmt: skip
