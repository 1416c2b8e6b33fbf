"""Official ``CollaborativeAttention`` weights (epfml/collaborative-attention).

    module = from_official(state_dict, dim_input=768, dim_value_all=768,
                           dim_key_query_all=384, dim_output=768,
                           num_attention_heads=12, use_dense_layer=True,
                           use_layer_norm=False)
    (y,) = module(hidden_states, attention_mask=ext_mask)

Parameter map (official -> multihead ``CollaborativeAttention``)::

    query.weight        -> attention.q_proj.weight
    key.weight          -> attention.k_proj.weight
    mixing              -> attention.mixing
    content_bias.weight -> attention.content_bias.weight
    value.weight/.bias  -> attention.v_proj.weight/.bias
    dense.weight/.bias  -> attention.out_proj.weight/.bias
                           (without a dense layer: identity and zero bias)
    layer_norm.*        -> layer_norm.*  (post-LN residual, eps 1e-5)

The official scale 1 / sqrt(D_kq / H) (a float division) is the module's
default scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..._checks import dropout_probability, positive_int
from ...functional import attention
from ...modules.kinds.collaborative import CollaborativeAttention

__all__ = ["OfficialCollaborativeAttention", "from_official", "to_official"]


class OfficialCollaborativeAttention(nn.Module):
    """The official module's interface around a multihead ``CollaborativeAttention``.

    ``forward(hidden_states, attention_mask=None, head_mask=None,
    encoder_hidden_states=None, encoder_attention_mask=None)`` returns
    ``(Y,)`` or ``(Y, P)`` with ``output_attentions``, exactly as the
    official code: masks are additive (Hugging Face style, e.g. (B, 1, 1, S)
    with 0 / -10000), ``encoder_attention_mask`` replaces ``attention_mask``
    when ``encoder_hidden_states`` is given (even when it is None), the head
    mask multiplies the weights after softmax and dropout without
    renormalising, and P is returned after dropout and head masking.

    Attributes:
        attention: the ``CollaborativeAttention`` doing the work.
        layer_norm: ``nn.LayerNorm`` applied to hidden_states + output, or None.
        use_dense_layer, output_attentions: the official flags.
    """

    def __init__(
        self,
        attention_module: CollaborativeAttention,
        *,
        use_dense_layer: bool,
        use_layer_norm: bool,
        output_attentions: bool = False,
    ) -> None:
        super().__init__()
        self.attention = attention_module
        self.use_dense_layer = bool(use_dense_layer)
        self.output_attentions = bool(output_attentions)
        ref = attention_module.out_proj.weight
        self.layer_norm = (
            nn.LayerNorm(attention_module.out_dim, eps=1e-5, device=ref.device, dtype=ref.dtype)
            if use_layer_norm
            else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """hidden_states [B, T, D_in] -> (Y [B, T, D_out],) or (Y, P [B, H, T, S])."""
        m = self.attention
        key = None
        mask = attention_mask
        if encoder_hidden_states is not None:
            key, mask = encoder_hidden_states, encoder_attention_mask
        if mask is not None and mask.dim() == 2:
            mask = mask[:, None, None, :]  # (B, S) additive -> (B, 1, 1, S)
        if head_mask is None and not self.output_attentions:
            out = m(hidden_states, key, attn_mask=mask)
            probs = None
        else:
            q, k, v = m.project(hidden_states, key)
            B, H = q.shape[0], q.shape[1]
            k = k.expand(B, H, k.shape[2], k.shape[3])  # one key head, stride 0 over heads
            _, probs = attention(q, k, v, attn_mask=mask, scale=m.scale, return_weights=True, backend="math")
            probs = F.dropout(probs, m.dropout, training=self.training)
            if head_mask is not None:
                probs = probs * head_mask
            out = m.merge_heads(probs @ v)  # (B, H, T, S) @ (B, H, S, Dv) -> (B, H, T, Dv)
        if self.layer_norm is not None:
            out = self.layer_norm(hidden_states + out)
        return (out, probs) if self.output_attentions else (out,)


def _take(state_dict: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"official state dict lacks {name!r}; it has {sorted(state_dict)}")
    t = state_dict[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"official {name!r} must have shape {shape}, got {tuple(t.shape)}")
    return t


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    dim_input: int,
    dim_value_all: int,
    dim_key_query_all: int,
    dim_output: int,
    num_attention_heads: int,
    output_attentions: bool = False,
    attention_probs_dropout_prob: float = 0.0,
    use_dense_layer: bool = True,
    use_layer_norm: bool = False,
    mixing_initialization: object = None,
) -> OfficialCollaborativeAttention:
    """Build the multihead equivalent of an official ``CollaborativeAttention``.

    Args: the official constructor's arguments (``mixing_initialization`` is
    accepted and ignored: the mixing comes from the state dict).

    Returns:
        an ``OfficialCollaborativeAttention`` (float dtype of the state dict).

    Raises:
        ValueError: D_v not divisible by H, D_out != D_v without a dense
            layer, D_in != D_out with a LayerNorm, missing, unexpected or
            mis-shaped parameters (the message names them).
    """
    D_in = positive_int("dim_input", dim_input)
    D_v = positive_int("dim_value_all", dim_value_all)
    D_kq = positive_int("dim_key_query_all", dim_key_query_all)
    D_out = positive_int("dim_output", dim_output)
    H = positive_int("num_attention_heads", num_attention_heads)
    p = dropout_probability(attention_probs_dropout_prob, "attention_probs_dropout_prob")
    if D_v % H != 0:
        raise ValueError(f"dim_value_all={D_v} must be divisible by num_attention_heads={H}")
    if not use_dense_layer and D_out != D_v:
        raise ValueError(f"without a dense layer dim_output={D_out} must equal dim_value_all={D_v}")
    if use_layer_norm and not D_in == D_out == D_v:
        raise ValueError(f"use_layer_norm needs dim_input == dim_output == dim_value_all, got {D_in}, {D_out}, {D_v}")
    expected = {
        "query.weight": (D_kq, D_in),
        "key.weight": (D_kq, D_in),
        "mixing": (H, D_kq),
        "content_bias.weight": (H, D_in),
        "value.weight": (D_v, D_in),
        "value.bias": (D_v,),
    }
    if use_dense_layer:
        expected |= {"dense.weight": (D_out, D_v), "dense.bias": (D_out,)}
    if use_layer_norm:
        expected |= {"layer_norm.weight": (D_v,), "layer_norm.bias": (D_v,)}
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected parameters in the official state dict: {unexpected}")
    w = {name: _take(state_dict, name, shape) for name, shape in expected.items()}
    ref = w["query.weight"]
    m = CollaborativeAttention(
        D_in,
        H,
        shared_dim=D_kq,
        head_dim=D_v // H,
        out_dim=D_out,
        dropout=p,
        device=ref.device,
        dtype=ref.dtype,
    )
    ours = {
        "q_proj.weight": w["query.weight"],
        "k_proj.weight": w["key.weight"],
        "mixing": w["mixing"],
        "content_bias.weight": w["content_bias.weight"],
        "v_proj.weight": w["value.weight"],
        "v_proj.bias": w["value.bias"],
        "out_proj.weight": w["dense.weight"] if use_dense_layer else torch.eye(D_v, dtype=ref.dtype, device=ref.device),
        "out_proj.bias": w["dense.bias"] if use_dense_layer else torch.zeros(D_v, dtype=ref.dtype, device=ref.device),
    }
    m.load_state_dict(ours)
    if not use_dense_layer:
        m.out_proj.requires_grad_(False)  # stands for "no dense layer"
    out = OfficialCollaborativeAttention(
        m, use_dense_layer=use_dense_layer, use_layer_norm=use_layer_norm, output_attentions=output_attentions
    )
    if use_layer_norm:
        out.layer_norm.load_state_dict({"weight": w["layer_norm.weight"], "bias": w["layer_norm.bias"]})
    return out


def to_official(module: OfficialCollaborativeAttention) -> dict[str, torch.Tensor]:
    """The official state dict of a module built by :func:`from_official`."""
    m = module.attention
    sd = {
        "query.weight": m.q_proj.weight,
        "key.weight": m.k_proj.weight,
        "mixing": m.mixing,
        "content_bias.weight": m.content_bias.weight,
        "value.weight": m.v_proj.weight,
        "value.bias": m.v_proj.bias,
    }
    if module.use_dense_layer:
        sd |= {"dense.weight": m.out_proj.weight, "dense.bias": m.out_proj.bias}
    if module.layer_norm is not None:
        sd |= {"layer_norm.weight": module.layer_norm.weight, "layer_norm.bias": module.layer_norm.bias}
    return {k: v.detach().clone() for k, v in sd.items()}
