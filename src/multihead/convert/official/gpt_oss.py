"""gpt-oss's attention layer (transformers ``models/gpt_oss/modeling_gpt_oss.py``,
``GptOssAttention``) as a multihead ``gqa`` module with ``sinks`` and ``window``.

    module = multihead.convert.from_official(
        "gpt_oss", state_dict, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, sliding_window=128, layer_type="sliding_attention",
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    y = module(hidden_states)                  # [B, T, C] -> [B, T, C], causal
    cache = module.make_kv_cache(B, 64)        # then module(x_t, kv_cache=cache) token by token

``state_dict`` holds one layer's attention parameters under the official
names (prefix ``model.layers.{l}.self_attn.`` stripped)::

    q_proj.weight (H·D, C), k_proj.weight, v_proj.weight (G·D, C), o_proj.weight (C, H·D)
    *.bias with attention_bias (gpt-oss: True)
    sinks (H,)                 each head's sink logit

The official forward: project -> rope (rotate-half over all D channels, base
``rope_theta``) -> softmax over [q·kᵀ/√D + mask | sink_h], sink column
dropped -> o_proj. The mask is causal, and on a sliding layer (``layer_type``
"sliding_attention", or ``layer_types[layer_idx]``) also hides keys j <= i -
sliding_window (transformers' ``sliding_window_overlay``): the module's
``window=sliding_window``. A full layer ignores ``sliding_window``.

gpt-oss checkpoints use YaRN rope (``rope_type`` "yarn"); this converter takes
only the default rope and refuses the others by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ...modules.kinds.mha import MultiHeadAttention
from ...modules.window_cache import window_cache
from ._shapes import check_official_shapes

__all__ = ["OfficialGptOssAttention", "from_official", "to_official"]

LAYER_TYPES = ("full_attention", "sliding_attention")


class OfficialGptOssAttention(nn.Module):
    """One official gpt-oss attention layer (causal self-attention) on ``MultiHeadAttention``.

    Attributes:
        attention: the ``MultiHeadAttention`` (``sinks``, ``window`` on sliding
            layers, rope).
    """

    def __init__(self, attention: MultiHeadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:  # fmt: skip
        """hidden_states [B, T, C] -> attention output [B, T, C], causal (and windowed).

        Args:
            attention_mask: [B, S], non-zero for real tokens (Hugging Face's
                2-D padding mask), over every key: the cached ones first.
            position_ids: [B, T] or [T] rope positions (None: 0 .. T-1 after
                the cached tokens).
            kv_cache: from :meth:`make_kv_cache` (or a ``StreamingKVCache``).

        Raises:
            ValueError: an attention_mask that is not 2-D (and the module's
                own checks: shapes, cache room).
        """
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be the 2-D padding mask [B, S], got shape "
                                 f"{tuple(attention_mask.shape)}")  # fmt: skip
            key_mask = attention_mask != 0
        return self.attention(hidden_states, is_causal=True, key_mask=key_mask, positions=position_ids,
                              kv_cache=kv_cache)  # fmt: skip

    def make_kv_cache(self, batch_size: int, max_len: int, **options):
        """The module's cache: rotated keys and values, (batch_size, G, max_len, D), or
        on a sliding layer the last ``sliding_window`` of them (``modules.window_cache``)."""
        return window_cache(self.attention, batch_size, max_len, **options)


def _rope_base(rope_parameters: dict | None, rope_theta: float | None) -> float:
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported: only the default rope "
                         "(rope_parameters={'rope_type': 'default', 'rope_theta': ...})")  # fmt: skip
    return float(params.get("rope_theta", 10000.0 if rope_theta is None else rope_theta))


def _layer_type(layer_type: str | None, layer_types: list[str] | None, layer_idx: int | None) -> str:
    if layer_type is None and layer_types is not None:
        if layer_idx is None or not 0 <= layer_idx < len(layer_types):
            raise ValueError(f"layer_types given: layer_idx must be an index into its {len(layer_types)} "
                             f"entries, got layer_idx={layer_idx!r}")  # fmt: skip
        layer_type = layer_types[layer_idx]
    layer_type = "full_attention" if layer_type is None else layer_type
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
    return layer_type


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    layer_type: str | None = None,
    layer_types: list[str] | None = None,
    layer_idx: int | None = None,
    rope_parameters: dict | None = None,
    rope_theta: float | None = None,
    attention_bias: bool = True,
    attention_dropout: float = 0.0,
) -> OfficialGptOssAttention:
    """Build the multihead equivalent of one official ``GptOssAttention`` layer.

    Args:
        state_dict: the layer's official parameters (module docstring).
        hidden_size, num_attention_heads, num_key_value_heads, head_dim
            (None: hidden_size // num_attention_heads, as the config does),
            sliding_window, rope_parameters (``rope_type``, ``rope_theta``),
            rope_theta (older configs' top-level field), attention_bias,
            attention_dropout: the ``GptOssConfig`` fields the attention reads.
        layer_type: "sliding_attention" or "full_attention" (None: from
            ``layer_types[layer_idx]``, else "full_attention").

    Returns:
        an :class:`OfficialGptOssAttention` in eval mode, in the dtype of
        ``q_proj.weight``.

    Raises:
        ValueError: a rope type other than the default, an unknown layer type,
            a sliding layer without a sliding_window, sizes that do not fit,
            or a state dict with missing, unexpected or misshapen entries.
    """
    kind = _layer_type(layer_type, layer_types, layer_idx)
    if kind == "sliding_attention" and sliding_window is None:
        raise ValueError("layer_type='sliding_attention' needs sliding_window (an int >= 1)")
    H, G = num_attention_heads, num_key_value_heads
    D = hidden_size // H if head_dim is None else head_dim
    dtype = state_dict["q_proj.weight"].dtype if "q_proj.weight" in state_dict else None
    m = MultiHeadAttention(
        hidden_size, H, num_kv_heads=G, head_dim=D, qkv_bias=attention_bias, out_bias=attention_bias,
        dropout=attention_dropout, rope={"base": _rope_base(rope_parameters, rope_theta)}, sinks=True,
        window=sliding_window if kind == "sliding_attention" else None, dtype=dtype,
    )  # fmt: skip
    rows = {"q_proj": H * D, "k_proj": G * D, "v_proj": G * D, "o_proj": hidden_size}
    want = {f"{n}.weight": (r, H * D if n == "o_proj" else hidden_size) for n, r in rows.items()}
    if attention_bias:
        want.update({f"{n}.bias": (r,) for n, r in rows.items()})
    want["sinks"] = (H,)
    check_official_shapes(state_dict, want)
    state = {k.replace("o_proj.", "out_proj."): v.detach().to(dtype) for k, v in state_dict.items()}
    m.load_state_dict(state, strict=True)  # q_proj/k_proj/v_proj load into the fused qkv_proj
    return OfficialGptOssAttention(m).eval()


def to_official(module: OfficialGptOssAttention) -> dict[str, torch.Tensor]:
    """The official state dict (copies) of a converted module, the inverse of ``from_official``."""
    m = module.attention
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        t = getattr(m.qkv_proj, suffix)
        if t is None:
            continue
        q, k, v = t.detach().split([H * D, G * D, G * D])
        out.update({f"q_proj.{suffix}": q.clone(), f"k_proj.{suffix}": k.clone(), f"v_proj.{suffix}": v.clone()})
        out[f"o_proj.{suffix}"] = getattr(m.out_proj, suffix).detach().clone()
    out["sinks"] = m.sinks.detach().clone()
    return out
