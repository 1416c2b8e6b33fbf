"""MOHSA (``ZTX-100/MOHSA``, ``models/vit.py``) ViT attention into multihead.

    layer = from_official(state_dict, dim=192, heads=12, dim_head=16, depths=3)
    y = layer(x)                      # x [B, N, dim] -> [B, N, dim], as Attention.forward

The official ``Attention(dim, heads, dim_head, dropout, depths, total_depths)``
holds ``to_qkv.weight`` (3·H·dh, dim) without bias and ``to_out.0.weight``
(dim, H·(dh + 2·ov)), ``to_out.0.bias`` (dim); ``to_out`` is an identity when
H = 1 and dh = dim. The overlap follows the active schedule of the official
code, ov = ``depths`` (the 0-based block index); ``total_depths`` only enters
the commented-out schedules and is accepted for signature compatibility.
With ``depths=None`` the overlap is read off the ``to_out`` width, which
differs for every layer.

In a full ViT checkpoint a layer's keys are
``transformer.layers.{i}.0.fn.to_qkv.weight`` and so on:
:func:`vit_layer_state_dict` extracts them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..._checks import dropout_probability, non_negative_int, positive_int
from ...modules.kinds.overlapping import OverlappingHeadAttention

__all__ = ["MOHSAViTAttention", "from_official", "to_official", "vit_layer_state_dict"]

_QKV, _OUT_W, _OUT_B = "to_qkv.weight", "to_out.0.weight", "to_out.0.bias"


class MOHSAViTAttention(nn.Module):
    """The official ViT ``Attention`` computed by :class:`OverlappingHeadAttention`.

    Attributes:
        attention: the multihead module (its attention dropout is the
            official ``attend`` dropout).
        out_dropout: the official ``to_out.1`` dropout.
        project_out: False when the official ``to_out`` is an identity
            (H = 1, dh = dim); ``attention.out_proj`` is then a fixed identity
            matrix without bias.
    """

    def __init__(self, attention: OverlappingHeadAttention, dropout: float, project_out: bool) -> None:
        super().__init__()
        self.attention = attention
        self.out_dropout = nn.Dropout(dropout)
        self.project_out = project_out
        if not project_out:
            self.attention.out_proj.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] -> [B, N, dim] (no mask, like the official forward)."""
        return self.out_dropout(self.attention(x))


def _overlap_from_width(width: int, heads: int, dim_head: int) -> int:
    extra = width - heads * dim_head
    if extra < 0 or extra % (2 * heads) != 0:
        raise ValueError(
            f"{_OUT_W} has in_features={width}, which is not heads*(dim_head + 2*ov) for any ov >= 0 "
            f"(heads={heads}, dim_head={dim_head})"
        )
    return extra // (2 * heads)


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    dim: int,
    heads: int,
    dim_head: int,
    dropout: float = 0.0,
    depths: int | None = None,
    total_depths: int | None = None,
) -> MOHSAViTAttention:
    """Build the multihead equivalent of one official MOHSA ViT ``Attention``.

    Args:
        state_dict: the official layer's parameters (``to_qkv.weight``, and
            ``to_out.0.weight``/``to_out.0.bias`` unless ``to_out`` is an
            identity).
        dim, heads, dim_head, dropout: the official constructor's arguments.
        depths: the 0-based block index; ov = depths (the official schedule).
            None: infer ov from ``to_out.0.weight``.
        total_depths: accepted and ignored (only the commented-out schedules
            use it).

    Returns:
        a :class:`MOHSAViTAttention` in the dtype/device of the weights.

    Raises:
        ValueError: missing or unexpected keys, shapes that do not match the
            config (the message names them), or an identity ``to_out`` with
            ov > 0 (the official output would be dim + 2·ov wide).
    """
    C, H, dh = positive_int("dim", dim), positive_int("heads", heads), positive_int("dim_head", dim_head)
    dropout = dropout_probability(dropout)
    if total_depths is not None:
        positive_int("total_depths", total_depths)
    project_out = not (H == 1 and dh == C)
    expected = {_QKV, _OUT_W, _OUT_B} if project_out else {_QKV}
    if set(state_dict) != expected:
        raise ValueError(
            f"MOHSA ViT Attention state dict must have keys {sorted(expected)}; "
            f"missing {sorted(expected - set(state_dict))}, unexpected {sorted(set(state_dict) - expected)}"
        )
    W_qkv = state_dict[_QKV]
    if tuple(W_qkv.shape) != (3 * H * dh, C):
        raise ValueError(f"{_QKV} must be (3*heads*dim_head, dim) = {(3 * H * dh, C)}, got {tuple(W_qkv.shape)}")
    if project_out:
        width = state_dict[_OUT_W].shape[-1]
        ov = _overlap_from_width(width, H, dh) if depths is None else non_negative_int("depths", depths)
        want = {_OUT_W: (C, H * (dh + 2 * ov)), _OUT_B: (C,)}
        for name, shape in want.items():
            if tuple(state_dict[name].shape) != shape:
                raise ValueError(
                    f"{name} must be {shape} for dim={C}, heads={H}, dim_head={dh}, overlap={ov}; "
                    f"got {tuple(state_dict[name].shape)}"
                )
    else:
        ov = 0 if depths is None else non_negative_int("depths", depths)
        if ov:
            raise ValueError(
                f"heads=1 and dim_head=dim={C} make the official to_out an identity, so with overlap={ov} "
                f"its output would be {C + 2 * ov} wide instead of dim={C}; this layer cannot be converted"
            )
    factory = {"dtype": W_qkv.dtype, "device": W_qkv.device}
    attn = OverlappingHeadAttention(
        C, H, overlap=ov, head_dim=dh, qkv_bias=False, out_bias=project_out, dropout=dropout, **factory
    )
    with torch.no_grad():
        attn.qkv_proj.weight.copy_(W_qkv)
        if project_out:
            attn.out_proj.weight.copy_(state_dict[_OUT_W])
            attn.out_proj.bias.copy_(state_dict[_OUT_B])
        else:
            attn.out_proj.weight.copy_(torch.eye(C, **factory))
    return MOHSAViTAttention(attn, dropout, project_out)


def to_official(module: MOHSAViTAttention) -> dict[str, torch.Tensor]:
    """The official state dict of a converted layer (copies), inverse of :func:`from_official`."""
    if not isinstance(module, MOHSAViTAttention):
        raise TypeError(f"module must be a MOHSAViTAttention, got {type(module).__name__}")
    attn = module.attention
    out = {_QKV: attn.qkv_proj.weight.detach().clone()}
    if module.project_out:
        out[_OUT_W] = attn.out_proj.weight.detach().clone()
        out[_OUT_B] = attn.out_proj.bias.detach().clone()
    return out


def vit_layer_state_dict(state_dict: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The attention parameters of block ``layer`` of an official MOHSA ``ViT`` checkpoint.

    Raises:
        ValueError: no ``transformer.layers.{layer}.0.fn.`` keys.
    """
    prefix = f"transformer.layers.{non_negative_int('layer', layer)}.0.fn."
    found = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not found:
        raise ValueError(f"no keys starting with {prefix!r} in the state dict")
    return found
