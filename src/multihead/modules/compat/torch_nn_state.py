"""How ``TorchMultiheadAttention`` shares its parameters with multihead's module.

The drop-in exposes torch's parameter names, and each of them *is* (the same
``nn.Parameter`` object as) a parameter of the inner ``MultiHeadAttention``:

    torch name (drop-in)          inner MultiHeadAttention (``.attention``)
    in_proj_weight [3C, C]   is   qkv_proj.weight           rows [q; k; v]
    in_proj_bias   [3C]      is   qkv_proj.bias             (kdim = vdim = C)
    q_proj_weight  [C, C]    is   q_proj.weight   \\
    k_proj_weight  [C, kdim] is   k_proj.weight    > kdim or vdim != C
    v_proj_weight  [C, vdim] is   v_proj.weight   /
    in_proj_bias   [3C]      is   {q,k,v}_proj.in_proj_bias, each projection
                                  reading its C rows of it (``InProjRows``)
    out_proj (a Linear)      is   out_proj

So in-place edits, optimizers, ``requires_grad_`` and assignments
(``drop_in.in_proj_weight = nn.Parameter(...)``) act on the weights the
computation uses, ``parameters()`` lists each tensor once under torch's
name, and ``state_dict()`` has exactly torch's keys.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["InProjRows", "alias_targets", "tie", "untie", "register_state_hooks", "TORCH_PARAMETERS",
           "check_dropout", "copy_parameter", "init_like_torch"]

# Every parameter attribute of torch.nn.MultiheadAttention (None where unused).
TORCH_PARAMETERS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                    "bias_k", "bias_v")


def check_dropout(value: object) -> float:
    """torch's range for the dropout probability, [0, 1] (p = 1 drops every weight).

    Raises:
        ValueError: a bool, a non-number, NaN, or outside [0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(float(value)):
        raise ValueError(f"dropout must be a float in [0, 1], got dropout={value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"dropout must be a float in [0, 1], got dropout={value!r}")
    return float(value)


def copy_parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    """A new Parameter with t's values, dtype, device and requires_grad."""
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)


def init_like_torch(drop_in: nn.Module) -> None:
    """torch's initialisation, drawing the same random numbers: Xavier-uniform
    input projections (the whole [3C, C] matrix, or each of q/k/v), zero
    biases (out_proj's too when there is an input bias), Xavier-normal
    ``bias_k`` / ``bias_v``."""
    if drop_in._qkv_same_embed_dim:
        nn.init.xavier_uniform_(drop_in.in_proj_weight)
    else:
        for w in (drop_in.q_proj_weight, drop_in.k_proj_weight, drop_in.v_proj_weight):
            nn.init.xavier_uniform_(w)
    if drop_in.in_proj_bias is not None:
        nn.init.zeros_(drop_in.in_proj_bias)
        if drop_in.out_proj.bias is not None:
            nn.init.zeros_(drop_in.out_proj.bias)
    for b in (drop_in.bias_k, drop_in.bias_v):
        if b is not None:
            nn.init.xavier_normal_(b)


class InProjRows(nn.Module):
    """One projection of the split layout: its own ``weight`` [C, in_features]
    and rows ``rows`` of the shared ``in_proj_bias`` [3C] as its bias.

    Args:
        rows: which rows of ``in_proj_bias`` are this projection's bias.
        in_features, out_features: as ``nn.Linear``.
    """

    def __init__(self, rows: slice, in_features: int, out_features: int) -> None:
        super().__init__()
        self.rows, self.in_features, self.out_features = rows, in_features, out_features
        self.register_parameter("weight", None)
        self.register_parameter("in_proj_bias", None)

    @property
    def bias(self) -> torch.Tensor | None:
        """[out_features] view of the shared bias (gradients reach it), or None."""
        return None if self.in_proj_bias is None else self.in_proj_bias[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias rows {self.rows}"


def alias_targets(drop_in: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """torch name on the drop-in -> the (module, attribute) pairs of the inner
    module that must hold the same object."""
    inner = drop_in.attention
    if inner.fused:
        return {
            "in_proj_weight": [(inner.qkv_proj, "weight")],
            "in_proj_bias": [(inner.qkv_proj, "bias")],
            "out_proj": [(inner, "out_proj")],
        }
    split = (inner.q_proj, inner.k_proj, inner.v_proj)
    targets = {f"{n}_proj_weight": [(proj, "weight")] for n, proj in zip("qkv", split)}
    targets["in_proj_bias"] = [(proj, "in_proj_bias") for proj in split]
    targets["out_proj"] = [(inner, "out_proj")]
    return targets


def tie(drop_in: nn.Module) -> None:
    """Make every inner alias hold the drop-in's current object."""
    for name, targets in alias_targets(drop_in).items():
        value = getattr(drop_in, name)
        for module, attr in targets:
            setattr(module, attr, value)


def untie(drop_in: nn.Module) -> None:
    """Set every inner alias to None (so a conversion visits each tensor once)."""
    for targets in alias_targets(drop_in).values():
        for module, attr in targets:
            setattr(module, attr, None)


def _alias_keys(drop_in: nn.Module, prefix: str) -> set[str]:
    """Full state-dict keys of inner parameters that are one of the drop-in's."""
    own = {id(p) for p in drop_in._parameters.values() if p is not None}
    own |= {id(p) for p in drop_in.out_proj.parameters()}
    return {
        f"{prefix}attention.{name}"
        for name, p in drop_in.attention.named_parameters(remove_duplicate=False)
        if id(p) in own
    }


def _drop_alias_entries(drop_in: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: keep torch's keys only (the aliases are the same tensors)."""
    for key in _alias_keys(drop_in, prefix):
        state_dict.pop(key, None)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        inner = f"{prefix}attention"
        for key in [k for k in metadata if k == inner or k.startswith(inner + ".")]:
            del metadata[key]


def _remember_prefix(drop_in: nn.Module, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: note where in the loaded model this module sits."""
    drop_in.__dict__.setdefault("_loading_prefixes", []).append(prefix)


def _forgive_alias_keys(drop_in: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: the inner aliases were loaded through their
    torch names, so they are not missing; every other missing or unexpected
    key is still reported. Re-ties the aliases (``assign=True`` replaces
    parameter objects)."""
    prefix = drop_in.__dict__["_loading_prefixes"].pop()
    aliases = _alias_keys(drop_in, prefix)
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in aliases]
    tie(drop_in)


def register_state_hooks(drop_in: nn.Module) -> None:
    """Install the two hooks that put torch's key names at the drop-in's boundary."""
    drop_in.register_state_dict_post_hook(_drop_alias_entries)
    drop_in.register_load_state_dict_pre_hook(_remember_prefix)
    drop_in.register_load_state_dict_post_hook(_forgive_alias_keys)
