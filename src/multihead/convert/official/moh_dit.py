"""MoH-DiT weights (SkyworkAI/MoH, ``MoH-DiT/models.py``, class ``MoHAttention``).

    module = multihead.convert.from_official(
        "moh_dit", state_dict, dim=384, num_heads=6, qkv_bias=True, shared_head=3, routed_head=2)
    y = module(x)                     # x [B, N, C] -> [B, N, C], as the official forward

Official name -> multihead name (``MoHAttention``)::

    qkv.weight / qkv.bias   (3·H·d, C)  ->  attention.qkv_proj   ([Q | K | V], head-major: same rows)
    proj.weight / proj.bias (C, H·d)    ->  attention.out_proj
    wg.weight   (E, C)                  ->  attention.routed_gate   (hr > 0)
    wg_0.weight (2, C)                  ->  attention.mix_gate      (hr > 0 and hs > 0)
    wg_1.weight (hs, C)                 ->  attention.shared_gate   (hs > 1)

The official layer appends its load-balance loss to a class-level list in
training mode; here the layer sets ``last_balance_loss`` instead (the same
value, except that the official selection frequencies are float32 whatever
the model dtype; here they use the model dtype), and ``aux_loss()`` returns
it times ``aux_loss_coeff``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...modules.kinds.moh import MoHAttention

__all__ = ["OfficialMoHDiT", "from_official", "to_official"]

_NAMES = {
    "qkv": "qkv_proj",
    "proj": "out_proj",
    "wg": "routed_gate",
    "wg_0": "mix_gate",
    "wg_1": "shared_gate",
}


class OfficialMoHDiT(nn.Module):
    """The official MoH-DiT attention's forward, computed by ``MoHAttention``.

    Attributes:
        attention: the ``MoHAttention`` (non-causal, unmasked self-attention).
        proj_drop: dropout after the output projection (training mode only).
    """

    def __init__(self, attention: MoHAttention, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.attention = attention
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The layer's load-balance loss l_aux of the last training-mode forward."""
        return self.attention.last_balance_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]."""
        return self.proj_drop(self.attention(x))


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    dim: int,
    num_heads: int = 8,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    attn_drop: float = 0.0,
    proj_drop: float = 0.0,
    norm_layer: Any = None,
    shared_head: int = 0,
    routed_head: int = 0,
    head_dim: int | None = None,
) -> OfficialMoHDiT:
    """Build the multihead equivalent of an official ``MoHAttention`` (MoH-DiT).

    Args:
        state_dict: the official module's parameters (names in the module
            docstring; an optional prefix such as ``blocks.0.attn.`` must be
            stripped first).
        dim, num_heads, qkv_bias, qk_norm, attn_drop, proj_drop, norm_layer,
            shared_head, routed_head, head_dim: the official constructor's
            arguments (``norm_layer`` is only used with ``qk_norm``).

    Returns:
        an :class:`OfficialMoHDiT` in eval mode with copies of the weights,
        in the dtype of ``qkv.weight``.

    Raises:
        ValueError: configurations the official class cannot run (shared_head
            = routed_head = 0; shared_head = 1 with routed_head > 0, which has
            no ``wg_1``; routed_head = 0 with shared_head != num_heads),
            ``qk_norm=True`` (not supported), or a state dict with missing,
            unexpected or wrongly shaped entries (each one named).
    """
    if shared_head == 0 and routed_head == 0:
        raise ValueError("shared_head=0 and routed_head=0: the official MoHAttention has no gates to run")
    if shared_head == 1 and routed_head > 0:
        raise ValueError(
            f"shared_head=1 with routed_head={routed_head}: the official MoH-DiT layer fails here (no wg_1)"
        )
    if qk_norm:
        raise ValueError("qk_norm=True is not supported (no MoH-DiT configuration uses it)")
    if "qkv.weight" not in state_dict:
        raise ValueError(f"state_dict has no 'qkv.weight'; keys: {sorted(state_dict)}")
    dtype = state_dict["qkv.weight"].dtype
    module = MoHAttention(
        dim,
        num_heads,
        shared_heads=shared_head,
        routed_heads=routed_head,
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        out_bias=True,
        dropout=attn_drop,
        dtype=dtype,
    )
    ours = module.state_dict()
    converted = {}
    for key, value in state_dict.items():
        layer, _, suffix = key.partition(".")
        name = f"{_NAMES.get(layer, layer)}.{suffix}"
        if name not in ours:
            raise ValueError(f"unexpected official key {key!r}; expected {sorted(_official_names(module))}")
        if tuple(value.shape) != tuple(ours[name].shape):
            raise ValueError(f"{key!r} has shape {tuple(value.shape)}, expected {tuple(ours[name].shape)}")
        converted[name] = value.detach().clone().to(dtype)
    missing = sorted(set(ours) - set(converted))
    if missing:
        back = {v: k for k, v in _NAMES.items()}
        raise ValueError(f"state_dict lacks {[back[m.split('.')[0]] + '.' + m.split('.')[1] for m in missing]}")
    module.load_state_dict(converted)
    return OfficialMoHDiT(module, proj_drop).eval()


def _official_names(module: MoHAttention) -> list[str]:
    back = {v: k for k, v in _NAMES.items()}
    return [f"{back[k.split('.')[0]]}.{k.split('.', 1)[1]}" for k in module.state_dict()]


def to_official(module: OfficialMoHDiT | MoHAttention) -> dict[str, torch.Tensor]:
    """The official state dict (copies) of a converted module, the inverse of :func:`from_official`."""
    attn = module.attention if isinstance(module, OfficialMoHDiT) else module
    names = _official_names(attn)
    return {n: t.detach().clone() for n, t in zip(names, attn.state_dict().values())}
