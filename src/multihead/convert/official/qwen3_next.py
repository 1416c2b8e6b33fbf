"""Qwen3-Next's gated full-attention layer (transformers
``models/qwen3_next/modeling_qwen3_next.py``, ``Qwen3NextAttention``) as a
multihead ``output_gated`` module.

    module = multihead.convert.from_official(
        "qwen3_next", state_dict, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, rope_parameters={"rope_theta": 10000000, "partial_rotary_factor": 0.25})
    y = module(hidden_states)                  # [B, T, C] -> [B, T, C], causal
    cache = module.make_kv_cache(B, 64)        # then module(x_t, kv_cache=cache) token by token

``state_dict`` holds one layer's attention parameters under the official
names (prefix ``model.layers.{l}.self_attn.`` stripped)::

    q_proj.weight (H·2D, C)            per head h: its query (D rows), then its
                                       gate logits (D rows): an elementwise gate
    k_proj.weight, v_proj.weight (G·D, C), o_proj.weight (C, H·D)
    *.bias with attention_bias
    q_norm.weight, k_norm.weight (D,)  RMS norm gains stored as w, applied as (1 + w)

The q rows are permuted into :class:`OutputGatedAttention`'s ``qkv_proj``; the
norms keep their stored w (``qk_norm_unit_offset=True``: the gain is 1 + w,
computed in float32 for half-precision inputs as the official norm does,
with eps ``rms_norm_eps``). Rope is partial: only the first
int(D · partial_rotary_factor) channels of each head rotate, rotate-half
within them (``rope={"rotary_dim": ...}``), base ``rope_theta``. Order:
project -> q/k norm -> rope -> softmax(q·kᵀ/√D) v -> × sigmoid(gate) -> o_proj.
"""

from __future__ import annotations

import torch

from ...modules.kinds.output_gated import OutputGatedAttention
from .qwen_gated import OfficialGatedAttention, _head_dim, load_official, to_official

__all__ = ["OfficialGatedAttention", "from_official", "per_head_rows", "to_official"]  # to_official: the inverse


def per_head_rows(H: int, D: int) -> torch.Tensor:
    """Official ``q_proj`` row of each module q row (h, d), then of each gate row (h, d),
    when the official rows are per head [query D | gate D]."""
    h = torch.arange(H)[:, None] * 2 * D
    return torch.cat([(h + torch.arange(D)).reshape(-1), (h + D + torch.arange(D)).reshape(-1)])


def _rope(rope_parameters: dict | None, rope_theta: float | None, partial_rotary_factor: float | None, D: int) -> dict:
    """The module's rope option from the config's rope fields (nested or, in older configs, top-level)."""
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported: only the default rope")
    theta = params.get("rope_theta", 10000.0 if rope_theta is None else rope_theta)
    factor = params.get("partial_rotary_factor", 0.25 if partial_rotary_factor is None else partial_rotary_factor)
    rotary_dim = int(D * factor)  # as the official rope's dim
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"head_dim={D} x partial_rotary_factor={factor} gives {rotary_dim} rotated channels; "
                         "a positive even number is needed")  # fmt: skip
    return {"base": float(theta), "rotary_dim": rotary_dim}


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int | None = None,
    rms_norm_eps: float = 1e-6,
    rope_parameters: dict | None = None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
    attention_bias: bool = False,
    attention_dropout: float = 0.0,
) -> OfficialGatedAttention:
    """Build the multihead equivalent of one official ``Qwen3NextAttention`` layer.

    Args:
        state_dict: the layer's official parameters (module docstring).
        hidden_size, num_attention_heads, num_key_value_heads, head_dim
            (None: from ``k_proj.weight``), rms_norm_eps, rope_parameters
            (``rope_theta``, ``partial_rotary_factor``, ``rope_type``),
            rope_theta and partial_rotary_factor (older configs' top-level
            fields; defaults 10000 and 0.25), attention_bias,
            attention_dropout: the ``Qwen3NextConfig`` fields the attention reads.

    Returns:
        an :class:`~multihead.convert.official.qwen_gated.OfficialGatedAttention` in
        eval mode, in the dtype of ``q_proj.weight``.

    Raises:
        ValueError: a rope type other than the default, a rotated width that
            is not a positive even number, sizes that do not fit, or a state
            dict with missing, unexpected or misshapen entries.
    """
    G = num_key_value_heads
    D = _head_dim(state_dict, G, head_dim)
    dtype = state_dict["q_proj.weight"].dtype if "q_proj.weight" in state_dict else None
    m = OutputGatedAttention(
        hidden_size, num_attention_heads, num_kv_heads=G, head_dim=D, gate="elementwise", qkv_bias=attention_bias,
        out_bias=attention_bias, dropout=attention_dropout, rope=_rope(rope_parameters, rope_theta,
        partial_rotary_factor, D), qk_norm=True, qk_norm_eps=rms_norm_eps, qk_norm_unit_offset=True, dtype=dtype,
    )  # fmt: skip
    return load_official(m, state_dict, per_head_rows(m.num_heads, D), bias=attention_bias)
