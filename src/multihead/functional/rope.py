"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv:2104.09864).

Channel pair (a, b) of a head vector at position m is rotated by the angle
m·θ_i, θ_i = base^(-2i/r), i = 0 .. r/2 - 1, r = rotary_dim:

    a' = a·cos(m·θ_i) - b·sin(m·θ_i)
    b' = b·cos(m·θ_i) + a·sin(m·θ_i)

so q·k after the rotation depends on the positions only through their
difference. Two pairings are in use:

    rotate-half (LLaMA, GPT-NeoX, HF ``apply_rotary_pos_emb``): pairs (i, i + r/2)
        channels  [ a0 a1 a2 | b0 b1 b2 | pass-through ]
    interleaved (RoFormer, GPT-J):                          pairs (2i, 2i + 1)
        channels  [ a0 b0 a1 b1 a2 b2 | pass-through ]

With ``rotary_dim`` r < D only the first r channels rotate (GPT-NeoX's
``rotary_pct``, GPT-J's ``rotary_dim``); the rest pass through unchanged.
Angles are computed in float32 (float64 for float64 inputs) and the result
is cast back to the input dtype.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["rope_frequencies", "apply_rope", "rope_options"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not float(base) > 1.0:
        raise ValueError(f"base must be a real number > 1, got base={base!r}")
    return float(base)


def _check_rotary_dim(rotary_dim: object, head_dim: int) -> int:
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(f"rotary_dim must be an int or None, got rotary_dim={rotary_dim!r}")
    r = int(rotary_dim)
    if r <= 0 or r % 2 != 0 or r > head_dim:
        raise ValueError(
            f"rotary_dim must be a positive even int <= head_dim={head_dim}, got rotary_dim={r}"
            + (" (an odd head_dim needs an explicit even rotary_dim)" if rotary_dim == head_dim else "")
        )
    return r


def _check_positions(positions: object) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be an int or a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer or floating tensor, got dtype {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"positions must be [T] or [B, T], got shape {tuple(positions.shape)}")
    return positions


def rope_options(options: bool | dict, head_dim: int) -> dict | None:
    """Validate a module's ``rope`` option; return apply_rope keywords or None.

    Args:
        options: False (no rope), True (defaults) or a dict with any of
            ``base``, ``interleaved``, ``rotary_dim``.
        head_dim: D of the heads the rotation applies to.

    Raises:
        TypeError / ValueError: another kind of value, unknown keys (listing
            the known ones), or invalid values.
    """
    if options is False or options is None:
        return None
    if options is True:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"rope must be a bool or a dict of apply_rope options, got {options!r}")
    known = {"base", "interleaved", "rotary_dim"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown rope options {unknown}; known: {sorted(known)}")
    out = {
        "base": _check_base(options.get("base", 10000.0)),
        "interleaved": options.get("interleaved", False),
        "rotary_dim": _check_rotary_dim(options.get("rotary_dim"), head_dim),
    }
    if not isinstance(out["interleaved"], bool):
        raise TypeError(f"rope interleaved must be a bool, got {out['interleaved']!r}")
    return out


def rope_frequencies(
    head_dim: int,
    positions: int | torch.Tensor,
    *,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of the rotation angles m·θ_i.

    Args:
        head_dim: r, the number of rotated channels (even).
        positions: an int ``max_len`` (positions 0 .. max_len - 1), or a
            tensor of positions [T] or [B, T] (integer or floating).
        base: the RoPE base (10000 in RoFormer and LLaMA).
        device: of the tables (default: that of ``positions``, else CPU).
        dtype: of the tables, float32 (default) or float64; the angles are
            computed in this dtype.

    Returns:
        (cos, sin), each [T, r/2] or [B, T, r/2]; column i belongs to
        θ_i = base^(-2i/r).

    Raises:
        TypeError / ValueError: odd or non-positive head_dim, base <= 1,
            positions of the wrong kind or shape.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
        raise TypeError(f"head_dim must be an int, got head_dim={head_dim!r}")
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even int, got head_dim={head_dim}")
    base = _check_base(base)
    dtype = torch.float32 if dtype is None else dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"max_len must be >= 0, got {positions}")
        positions = torch.arange(int(positions), device=device)
    positions = _check_positions(positions)
    device = positions.device if device is None else device
    # θ_i = 1 / base^(2i / r), computed as Hugging Face's LlamaRotaryEmbedding does
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
    inv_freq = 1.0 / (base**exponents)  # [r/2]
    angles = positions.to(device=device, dtype=dtype)[..., None] * inv_freq  # [..., T] -> [..., T, r/2]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate the channel pairs of ``x`` by their positions' angles.

    Args:
        x: [B, H, T, D] queries or keys.
        positions: [T] (shared by the batch) or [B, T] (e.g. left-padded
            batches); None means 0 .. T-1.
        base: the RoPE base.
        interleaved: pair channels (2i, 2i+1) as RoFormer / GPT-J instead
            of (i, i + r/2) as LLaMA / GPT-NeoX.
        rotary_dim: r, rotate only the first r channels (even, <= D;
            default D).

    Returns:
        [B, H, T, D], same dtype as ``x``.

    Raises:
        TypeError / ValueError: x not 4-D, positions not [T] / [B, T]
            matching x, odd or too large rotary_dim, base <= 1.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating [B, H, T, D] tensor, got {tuple(x.shape)} {x.dtype}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got interleaved={interleaved!r}")
    B, _, T, D = x.shape
    r = _check_rotary_dim(rotary_dim, D)
    if positions is None:
        positions = torch.arange(T, device=x.device)
    positions = _check_positions(positions)
    if positions.shape[-1] != T or (positions.dim() == 2 and positions.shape[0] not in (1, B)):
        raise ValueError(
            f"positions must be [T] = [{T}] or [B, T] = [{B}, {T}] for x of shape {tuple(x.shape)}, "
            f"got {tuple(positions.shape)}"
        )
    cos, sin = rope_frequencies(r, positions, base=base, device=x.device, dtype=_compute_dtype(x.dtype))
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]  # (B, T, r/2) -> (B, 1, T, r/2)
    rot = x[..., :r].to(cos.dtype)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]  # (B, H, T, r) -> 2 x (B, H, T, r/2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
    a2, b2 = a * cos - b * sin, b * cos + a * sin
    if interleaved:
        rot = torch.stack((a2, b2), dim=-1).flatten(-2)  # 2 x (B, H, T, r/2) -> (B, H, T, r)
    else:
        rot = torch.cat((a2, b2), dim=-1)
    rot = rot.to(x.dtype)
    return rot if r == D else torch.cat((rot, x[..., r:]), dim=-1)
