"""Masks and extra keys at the boundary of ``TorchMultiheadAttention``.

torch's masks mean bool True = *may not* attend (multihead's: True = may
attend); a 3-D torch ``attn_mask`` is (B * H, T, S). ``add_bias_kv`` and
``add_zero_attn`` append key/value rows after the projection, and every
query may attend to them.
"""

from __future__ import annotations

import torch

__all__ = ["torch_padding_mask", "torch_attn_mask", "extra_keys"]


def _torch_mask_to_ours(mask: torch.Tensor | None) -> torch.Tensor | None:
    """torch polarity (bool True = hidden) -> multihead polarity (True = visible)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return ~mask


def _visible_columns(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Append n key columns that every query may attend to."""
    if mask is None:
        return None
    value = True if mask.dtype == torch.bool else 0.0
    extra = torch.full((*mask.shape[:-1], n), value, dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, extra], dim=-1)


def _check_mask_dtype(name: str, mask: object) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"{name} must be bool or floating, got dtype {mask.dtype}")
    return mask


def torch_padding_mask(mask, B: int, S: int, unbatched: bool) -> torch.Tensor | None:
    """torch's key_padding_mask -> [B, S] in multihead polarity."""
    if mask is None:
        return None
    mask = _check_mask_dtype("key_padding_mask", mask)
    want = (S,) if unbatched else (B, S)
    if tuple(mask.shape) != want:
        kind = "(S,) for unbatched" if unbatched else "(B, S) for batched"
        raise ValueError(f"key_padding_mask must be {kind} input = {want}, got {tuple(mask.shape)}")
    if unbatched:
        mask = mask.unsqueeze(0)  # (S,) -> (1, S)
    return _torch_mask_to_ours(mask)

def torch_attn_mask(mask, B: int, H: int, T: int, S: int, unbatched: bool) -> torch.Tensor | None:
    """torch's attn_mask -> (T, S) or (B, H, T, S) in multihead polarity."""
    if mask is None:
        return None
    mask = _check_mask_dtype("attn_mask", mask)
    if mask.dim() == 2:
        if tuple(mask.shape) != (T, S):
            raise ValueError(f"2-D attn_mask must be (T, S) = ({T}, {S}), got {tuple(mask.shape)}")
    elif mask.dim() == 3:
        lead, name = (H, "H") if unbatched else (B * H, "B*H")
        if tuple(mask.shape) != (lead, T, S):
            raise ValueError(f"3-D attn_mask must be ({name}, T, S) = ({lead}, {T}, {S}), got {tuple(mask.shape)}")
        mask = mask.view(B, H, T, S)  # (B*H, T, S) -> (B, H, T, S)
    else:
        raise ValueError(f"attn_mask must be 2-D (T, S) or 3-D (B*H, T, S), got shape {tuple(mask.shape)}")
    return _torch_mask_to_ours(mask)


def extra_keys(k, v, mask, pad, *, bias_k, bias_v, zero: bool):
    """Append torch's bias_k/bias_v row ([1, 1, C] each, or None) and, with ``zero``,
    a zero row to keys and values [B, G, S, D], and a visible column to the masks."""
    B, G, _, D = k.shape
    extra_k, extra_v = [], []
    if bias_k is not None:
        extra_k.append(bias_k.view(1, G, 1, D).expand(B, G, 1, D))  # (1, 1, C) -> (B, G, 1, D)
        extra_v.append(bias_v.view(1, G, 1, D).expand(B, G, 1, D))
    if zero:
        extra_k.append(k.new_zeros(B, G, 1, D))
        extra_v.append(v.new_zeros(B, G, 1, D))
    if not extra_k:
        return k, v, mask, pad
    n = len(extra_k)
    k, v = torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2)
    return k, v, _visible_columns(mask, n), _visible_columns(pad, n)
