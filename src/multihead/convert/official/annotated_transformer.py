"""The Annotated Transformer's ``MultiHeadedAttention`` on multihead's module.

    module = multihead.convert.from_official(
        "annotated_transformer", state_dict, h=8, d_model=512, dropout=0.1)
    y = module(query, key, value, mask)        # the official call and result

Official layout (``harvardnlp/annotated-transformer`` @ debc9fd7; see
``docs/variants/annotated-transformer.md``): ``linears.{0,1,2,3}.{weight,
bias}``, four ``nn.Linear(d_model, d_model)`` for the query, key, value and
output projections; head j uses rows j·d_k .. j·d_k + d_k - 1. They map onto
``MultiHeadAttention(d_model, h)``'s fused ``qkv_proj`` (``linears.0``,
``.1``, ``.2`` stacked along the output axis) and ``out_proj``
(``linears.3``).

Mask translation, at this boundary only. The official code keeps positions
where ``mask != 0``, gives the mask a head axis (``mask.unsqueeze(1)``) and
REPLACES masked scores by -1e9. multihead's masks hide keys exactly (-inf),
which gives the same weights wherever a query row keeps at least one key
(exp(-1e9 - max) underflows to 0 in every float dtype). Only a row with no
kept key differs: officially every score there is -1e9, so its weights are
uniform, 1/Tk over all keys, and its output is the mean of the values; in
multihead such a row is zero. The wrapper reproduces the official result by
detecting fully masked (head, row) pairs and adding, after the module ran,
the head's mean value pushed through the output projection:

    out[b, t] += sum over dead heads j of  mean_s(V_j[b, s]) · W_o[:, j]ᵀ

(the row's own head output was zero, so this is exactly the official row,
up to rounding; mean_s(V_j) = mean_s(value)·W_vᵀ + b_v by linearity).

Differences from the official module, on purpose: no ``self.attn``
attribute (ask the inner module for weights: ``return_weights`` or an
observer; they are zero on fully masked rows); in training mode the uniform
rows of fully masked queries get no dropout; float16 works (officially
``masked_fill`` with -1e9 overflows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..._checks import dropout_probability, positive_int
from ...modules.kinds.mha import MultiHeadAttention

__all__ = ["AnnotatedTransformerAttention", "from_official", "to_official"]

_KEYS = tuple(f"linears.{i}.{p}" for i in range(4) for p in ("weight", "bias"))


class AnnotatedTransformerAttention(nn.Module):
    """The official ``MultiHeadedAttention(h, d_model, dropout)`` interface.

    Args:
        h: number of heads (divides d_model).
        d_model: model width.
        dropout: dropout on the attention probabilities (training mode).
        device, dtype: of the parameters.

    Attributes:
        attention: the ``MultiHeadAttention(d_model, h, dropout=dropout)``
            doing the work and holding the weights.

    Raises:
        TypeError / ValueError: non-int or non-positive sizes, h not
            dividing d_model, dropout outside [0, 1).
    """

    def __init__(
        self,
        h: int,
        d_model: int,
        dropout: float = 0.1,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        h, d_model = positive_int("h", h), positive_int("d_model", d_model)
        if d_model % h != 0:
            raise ValueError(f"d_model={d_model} must be divisible by h={h}")
        self.h, self.d_model, self.d_k = h, d_model, d_model // h
        self.attention = MultiHeadAttention(
            d_model, h, dropout=dropout_probability(dropout), device=device, dtype=dtype
        )

    def _keep_mask(self, mask: torch.Tensor, B: int, Tq: int, Tk: int) -> torch.Tensor:
        """Official mask -> bool "may attend" [B|1, h|1, Tq|1, Tk], as ``mask.unsqueeze(1)``."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dim() not in (1, 2, 3):
            raise ValueError(
                f"mask must be [B, 1, Tk] (padding), [B, Tq, Tk] or [1, Tq, Tk]; got {tuple(mask.shape)}"
            )
        keep = (mask != 0).unsqueeze(1)  # same mask for every head: (B, Tq|1, Tk) -> (B, 1, Tq|1, Tk)
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))  # lower ranks -> 4-D
        try:
            shape = torch.broadcast_shapes(keep.shape, (B, self.h, Tq, Tk))
        except RuntimeError:
            shape = None
        if shape != (B, self.h, Tq, Tk):
            raise ValueError(
                f"mask {tuple(mask.shape)} (with a head axis: {tuple(keep.shape)}) does not broadcast to "
                f"the scores (B, h, Tq, Tk) = {(B, self.h, Tq, Tk)}; use [B, 1, Tk] or [B|1, Tq, Tk]"
            )
        return keep.to(mask.device)

    def _uniform_rows(self, out: torch.Tensor, value: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
        """Add the official result of fully masked rows: out [B, Tq, C], dead [B|1, h|1, Tq|1, 1]."""
        B, Tq, _ = out.shape
        H, D = self.h, self.d_k
        W_v, b_v = self.attention.projection_weights()["v"]
        v_mean = F.linear(value.mean(dim=1), W_v, b_v).view(B, H, D)  # (B, C) -> (B, H, D)
        W_o = self.attention.out_proj.weight.view(self.d_model, H, D)  # (C, H*D) -> (C, H, D)
        per_head = torch.einsum("bhd,chd->bhc", v_mean, W_o)  # (B, H, C): head j's mean value through W_o
        dead = dead[..., 0].expand(B, H, Tq).to(out.dtype)  # (B|1, H|1, Tq|1, 1) -> (B, H, Tq)
        return out + torch.einsum("bht,bhc->btc", dead, per_head)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None) -> torch.Tensor:
        """The official forward: query [B, Tq, d_model], key and value [B, Tk, d_model].

        ``mask`` as in ``textbook.annotated.MultiHeadedAttention.forward``
        (1/True = keep, any dtype compared with 0; a head axis is inserted
        at dim 1); a query row with no kept key attends uniformly to all Tk keys.

        Returns:
            Output [B, Tq, d_model].

        Raises:
            TypeError / ValueError: tensors of the wrong shape or kind, a
                mask that does not broadcast to the scores.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must be [B, T, d_model={self.d_model}], got {tuple(t.shape)}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must share [B, Tk]; got {tuple(key.shape)} and {tuple(value.shape)}")
        B, Tq, Tk = query.shape[0], query.shape[1], key.shape[1]
        keep = None if mask is None else self._keep_mask(mask, B, Tq, Tk)
        if key is query and value is query:
            out = self.attention(query, attn_mask=keep)  # fused q/k/v projection
        else:
            out = self.attention(query, key, value, attn_mask=keep)
        if keep is not None:
            dead = ~keep.any(dim=-1, keepdim=True)  # (B|1, h|1, Tq|1, 1): rows with no kept key
            if bool(dead.any()):
                out = self._uniform_rows(out, value, dead)
        return out

    def extra_repr(self) -> str:
        return f"h={self.h}, d_model={self.d_model}"


def from_official(
    state_dict: dict[str, torch.Tensor], *, h: int, d_model: int, dropout: float = 0.1
) -> AnnotatedTransformerAttention:
    """Build the equivalent of ``MultiHeadedAttention(h, d_model, dropout)`` with these weights.

    Args:
        state_dict: exactly ``linears.{0,1,2,3}.{weight,bias}``, weights
            [d_model, d_model] and biases [d_model] (one module's state dict,
            e.g. ``model.encoder.layers[0].self_attn.state_dict()``).
        h, d_model, dropout: the official constructor's arguments.

    Returns:
        An :class:`AnnotatedTransformerAttention` in eval mode, on the
        state dict's device and dtype.

    Raises:
        ValueError: missing or unexpected keys (listed), wrong shapes, mixed
            dtypes/devices, invalid h / d_model / dropout.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    missing = [k for k in _KEYS if k not in state_dict]
    unexpected = sorted(k for k in state_dict if k not in _KEYS)
    if missing or unexpected:
        raise ValueError(
            f"not an Annotated Transformer MultiHeadedAttention state dict: missing {missing}, "
            f"unexpected {unexpected}; expected {list(_KEYS)}"
        )
    module = AnnotatedTransformerAttention(h, d_model, dropout)
    C = module.d_model
    for k in _KEYS:
        t = state_dict[k]
        want = (C, C) if k.endswith("weight") else (C,)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{k} must have shape {want} for d_model={C}, got {got}")
    ref = state_dict["linears.0.weight"]
    if any(state_dict[k].dtype != ref.dtype or state_dict[k].device != ref.device for k in _KEYS):
        raise ValueError(
            "state dict tensors differ in dtype/device: "
            + ", ".join(f"{k}: {state_dict[k].dtype} on {state_dict[k].device}" for k in _KEYS)
        )
    if not ref.dtype.is_floating_point:
        raise ValueError(f"weights must be floating point, got {ref.dtype}")
    module = module.to(device=ref.device, dtype=ref.dtype)
    inner = module.attention
    with torch.no_grad():
        inner.qkv_proj.weight.copy_(torch.cat([state_dict[f"linears.{i}.weight"] for i in range(3)]))
        inner.qkv_proj.bias.copy_(torch.cat([state_dict[f"linears.{i}.bias"] for i in range(3)]))
        inner.out_proj.weight.copy_(state_dict["linears.3.weight"])
        inner.out_proj.bias.copy_(state_dict["linears.3.bias"])
    return module.eval()


def to_official(module: AnnotatedTransformerAttention | MultiHeadAttention) -> dict[str, torch.Tensor]:
    """The official state dict ``linears.{0,1,2,3}.{weight,bias}`` (detached clones).

    Args:
        module: an :class:`AnnotatedTransformerAttention`, or a
            ``MultiHeadAttention`` with the official structure (H = G heads
            of size embed_dim / H, kdim = vdim = embed_dim, all biases, no
            rope or qk_norm).

    Raises:
        TypeError: another kind of module.
        ValueError: a MultiHeadAttention the official class cannot express.
    """
    inner = module.attention if isinstance(module, AnnotatedTransformerAttention) else module
    if not isinstance(inner, MultiHeadAttention):
        raise TypeError(f"expected AnnotatedTransformerAttention or MultiHeadAttention, got {type(module).__name__}")
    problems = []
    if inner.num_kv_heads != inner.num_heads:
        problems.append(f"num_kv_heads={inner.num_kv_heads} != num_heads={inner.num_heads}")
    if inner.num_heads * inner.head_dim != inner.embed_dim:
        problems.append(f"num_heads*head_dim={inner.num_heads * inner.head_dim} != embed_dim={inner.embed_dim}")
    if inner.kdim != inner.embed_dim or inner.vdim != inner.embed_dim:
        problems.append(f"kdim={inner.kdim}, vdim={inner.vdim} differ from embed_dim={inner.embed_dim}")
    if inner.out_proj.bias is None or inner.projection_weights()["q"][1] is None:
        problems.append("a projection has no bias")
    if getattr(inner, "rope", None) is not None or getattr(inner, "qk_norm", None) is not None:
        problems.append("rope / qk_norm have no official counterpart")
    if problems:
        raise ValueError("module has no Annotated Transformer layout: " + "; ".join(problems))
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate("qkv"):
        weight, bias = inner.projection_weights()[name]
        out[f"linears.{i}.weight"], out[f"linears.{i}.bias"] = weight.detach().clone(), bias.detach().clone()
    out["linears.3.weight"] = inner.out_proj.weight.detach().clone()
    out["linears.3.bias"] = inner.out_proj.bias.detach().clone()
    return out
