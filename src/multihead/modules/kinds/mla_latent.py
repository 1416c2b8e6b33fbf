"""Pieces of Multi-head Latent Attention (``mla.py``): YaRN rope frequencies,
the rotation at given frequencies, and the latent cache of absorbed decoding.

YaRN (Peng et al. 2023, as DeepSeek-V3's ``precompute_freqs_cis``) stretches
the low frequencies of rope by ``factor`` and keeps the high ones, with a
linear ramp between two channel indices found from the rotation counts
``beta_fast`` and ``beta_slow`` over the original context::

    θ_i   = base^(-2i/r),  i = 0 .. r/2 - 1                 r rotated channels
    d(n)  = r · ln(L0 / (2π n)) / (2 ln base)               L0 original_seq_len
    low   = max(floor(d(beta_fast)), 0),  high = min(ceil(d(beta_slow)), r - 1)
    ramp_i = clamp((i - low) / (high - low), 0, 1)          (high += 0.001 when equal)
    θ'_i  = θ_i / factor · ramp_i + θ_i · (1 - ramp_i)
    softmax scale × m²,  m = 0.1 · mscale · ln(factor) + 1

The upper clamp is r - 1 (the official code's), although the ramp runs over
r/2 entries.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..kv_cache import KVCache, _patch_traced_length

__all__ = ["LatentKVCache", "yarn_options", "yarn_frequencies", "yarn_mscale", "rotate"]

_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}


def yarn_options(yarn: object) -> dict | None:
    """Validate the ``yarn`` option: None, or a dict with ``factor`` (> 1) and
    ``original_seq_len`` (> 0), and optionally ``beta_fast``, ``beta_slow``, ``mscale``.

    Raises:
        TypeError / ValueError: another kind of value, unknown or missing keys
            (naming them), or values out of range.
    """
    if yarn is None:
        return None
    if not isinstance(yarn, dict):
        raise TypeError(f"yarn must be None or a dict, got yarn={yarn!r}")
    known = {"factor", "original_seq_len", *_YARN_DEFAULTS}
    unknown, missing = sorted(set(yarn) - known), sorted({"factor", "original_seq_len"} - set(yarn))
    if unknown or missing:
        raise ValueError(f"yarn options: unknown {unknown}, missing {missing}; known: {sorted(known)}")
    out = {**_YARN_DEFAULTS, **yarn}
    for name, value in out.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"yarn {name} must be a positive finite number, got {name}={value!r}")
    if out["factor"] <= 1:
        raise ValueError(f"yarn factor must be > 1, got factor={out['factor']!r}")
    return {name: float(value) for name, value in out.items()}


def yarn_frequencies(rotary_dim: int, base: float, yarn: dict, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """θ'_i [r/2] of the module docstring (``yarn`` from :func:`yarn_options`)."""
    r = rotary_dim
    theta = 1.0 / base ** (torch.arange(0, r, 2, dtype=dtype, device=device) / r)  # (r/2,)

    def dim_of(rotations: float) -> float:
        return r * math.log(yarn["original_seq_len"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(yarn["beta_fast"])), 0), min(math.ceil(dim_of(yarn["beta_slow"])), r - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(r // 2, dtype=dtype, device=device) - low) / (high - low)).clamp(0, 1)
    return theta / yarn["factor"] * ramp + theta * (1 - ramp)


def yarn_mscale(yarn: dict) -> float:
    """m = 0.1 · mscale · ln(factor) + 1; the softmax scale is multiplied by m²."""
    return 0.1 * yarn["mscale"] * math.log(yarn["factor"]) + 1.0


def rotate(x: torch.Tensor, positions: torch.Tensor | None, freqs: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the first 2·len(freqs) channels of x [B, N, L, R] by position × freqs.

    positions: [L] or [B, L] (None: 0 .. L-1); pairs (2i, 2i+1) when
    ``interleaved``, else (i, i + r/2). Angles in float64 for float64 inputs,
    float32 otherwise; the result has x's dtype.
    """
    B, _, L, _ = x.shape
    r = 2 * freqs.shape[0]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    pos = torch.arange(L, device=x.device) if positions is None else positions.to(x.device)
    angles = pos.to(work)[..., None] * freqs.to(device=x.device, dtype=work)  # (.., L) -> (.., L, r/2)
    cos, sin = angles.cos(), angles.sin()
    if angles.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, L, r/2) -> (B, 1, L, r/2)
    rot = x[..., :r].to(work)
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., : r // 2], rot[..., r // 2 :])
    a2, b2 = a * cos - b * sin, b * cos + a * sin
    rot = torch.stack((a2, b2), dim=-1).flatten(-2) if interleaved else torch.cat((a2, b2), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


class LatentKVCache(KVCache):
    """The cache of absorbed decoding: per token the normalised latent c and the
    rotated rope key, one row [c | k_R] of L + R channels shared by every head.

    Args:
        batch_size: B; max_len: S_max; latent_dim: L (kv_lora_rank);
        rope_dim: R (qk_rope_head_dim); dtype, device: of the buffer.

    Attributes:
        k: [B, 1, S_max, L + R]; the values are its first L channels (no
            second buffer). ``length``, ``reset``, ``check_append`` and
            ``cross_source`` as :class:`KVCache`.
    """

    def __init__(self, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, dtype=None, device=None):
        torch.nn.Module.__init__(self)
        _patch_traced_length()
        self.latent_dim = latent_dim
        self.max_len = max_len
        self.length = 0
        self.cross_source = None
        shape = (batch_size, 1, max_len, latent_dim + rope_dim)
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
