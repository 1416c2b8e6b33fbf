"""Pieces of Multi-head Latent Attention (``mla.py``): YaRN rope frequencies
and the rotation at given frequencies (its cache, ``LatentKVCache``, is in
``modules/kv_cache.py``).

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

__all__ = ["yarn_options", "yarn_frequencies", "yarn_mscale", "rotate"]

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
