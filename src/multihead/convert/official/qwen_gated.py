"""The gated-attention paper's Qwen3 layer (qiuzh20/gated_attention, ``modeling_qwen3.py``,
``Qwen3Attention`` with ``headwise_attn_output_gate`` / ``elementwise_attn_output_gate``)
as a multihead ``output_gated`` module.

    module = multihead.convert.from_official(
        "qwen_gated", state_dict, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, elementwise_attn_output_gate=True)
    y = module(hidden_states)                  # [B, T, C] -> [B, T, C], causal
    cache = module.make_kv_cache(B, 64)        # then module(x_t, kv_cache=cache) token by token

``state_dict`` holds one layer's attention parameters under the official
names (prefix ``model.layers.{l}.self_attn.`` stripped; the ``rotary_emb.``
buffers are ignored)::

    q_proj.weight (G·(r·D + r·E), C)   per key/value group g (r = H/G heads each):
                                       the r heads' queries (r·D rows), then their
                                       gate logits (r·E rows; E = 1 headwise, D elementwise)
    k_proj.weight, v_proj.weight (G·D, C), o_proj.weight (C, H·D)
    *.bias with qkv_bias (the official layer reads ``config.qkv_bias`` for all four)
    q_norm.weight, k_norm.weight (D,)  with use_qk_norm (gain w)

The q rows are permuted into :class:`OutputGatedAttention`'s ``qkv_proj``
([q heads | gates | k | v], head-major); k, v and o are copied. The module
applies the official order: project -> q/k RMS norm -> rope (rotate-half,
every channel, base ``rope_theta``) -> softmax(q·kᵀ/√D) v -> × sigmoid(gate)
-> o_proj. With both gate flags set the official layer is headwise, and so is
this one. In float32 and float64 the result is the official one up to
rounding; in half precision the official norm rounds to the input dtype
before its gain and this one after.
"""

from __future__ import annotations

import torch
from torch import nn

from ...modules.kinds.output_gated import OutputGatedAttention
from ._shapes import check_official_shapes

__all__ = ["OfficialGatedAttention", "from_official", "grouped_rows", "load_official", "to_official"]


class OfficialGatedAttention(nn.Module):
    """One official output-gated layer (causal self-attention) on ``OutputGatedAttention``.

    Attributes:
        attention: the ``OutputGatedAttention`` (rope, and the official q/k norms).
        rows: [H·(D + E)] long: the official ``q_proj`` row of each of the
            module's q and gate rows (``to_official`` inverts it).
    """

    def __init__(self, attention: OutputGatedAttention, rows: torch.Tensor) -> None:
        super().__init__()
        self.attention = attention
        self.register_buffer("rows", rows, persistent=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        """hidden_states [B, T, C] -> attention output [B, T, C], causal.

        Args:
            attention_mask: [B, S], non-zero for real tokens (Hugging Face's
                2-D padding mask), over every key: the cached ones first.
            position_ids: [B, T] or [T] rope positions (None: 0 .. T-1 after
                the cached tokens).
            kv_cache: from :meth:`make_kv_cache`; this call's keys are
                appended and attended to with the cached ones.

        Raises:
            ValueError: an attention_mask that is not 2-D (and the module's
                own checks: shapes, cache room).
        """
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be the 2-D padding mask [B, S], got shape {tuple(attention_mask.shape)}"
                )
            key_mask = attention_mask != 0
        return self.attention(hidden_states, is_causal=True, key_mask=key_mask, positions=position_ids,
                              kv_cache=kv_cache)  # fmt: skip

    def make_kv_cache(self, batch_size: int, max_len: int, **options):
        """The module's cache: keys (normalised, rotated) and values, (batch_size, G, max_len, D)."""
        return self.attention.make_kv_cache(batch_size, max_len, **options)


def grouped_rows(H: int, G: int, D: int, E: int) -> torch.Tensor:
    """Official ``q_proj`` row of each module q row (h, d), then of each gate row (h, e),
    when the official rows are per key/value group [r heads' queries | their gates]."""
    r, block = H // G, (H // G) * (D + E)
    h = torch.arange(H)[:, None]
    q = (h // r) * block + (h % r) * D + torch.arange(D)  # (H, D)
    gate = (h // r) * block + r * D + (h % r) * E + torch.arange(E)  # (H, E)
    return torch.cat([q.reshape(-1), gate.reshape(-1)])


def official_shapes(m: OutputGatedAttention, *, bias: bool, norms: bool) -> dict[str, tuple[int, ...]]:
    """The official parameter names and shapes of a layer of ``m``'s sizes."""
    H, G, D, E, C = m.num_heads, m.num_kv_heads, m.head_dim, m.gate_width, m.embed_dim
    rows = {"q_proj": H * (D + E), "k_proj": G * D, "v_proj": G * D, "o_proj": C}
    shapes = {f"{n}.weight": (w, H * D if n == "o_proj" else C) for n, w in rows.items()}
    if bias:
        shapes.update({f"{n}.bias": (w,) for n, w in rows.items()})
    if norms:
        shapes.update({"q_norm.weight": (D,), "k_norm.weight": (D,)})
    return shapes


def load_official(
    m: OutputGatedAttention, state_dict: dict[str, torch.Tensor], rows: torch.Tensor, *, bias: bool
) -> OfficialGatedAttention:
    """Copy an official state dict into ``m`` (q rows permuted by ``rows``); wrap it, in eval mode.

    Raises:
        ValueError: missing, unexpected or misshapen entries (each named).
    """
    sd = {k: v for k, v in state_dict.items() if not k.startswith("rotary_emb.")}
    want = official_shapes(m, bias=bias, norms=m.qk_norm is not None)
    check_official_shapes(sd, want)
    dtype = m.out_proj.weight.dtype
    state = {}
    for suffix in ("weight", "bias") if bias else ("weight",):
        parts = [sd[f"q_proj.{suffix}"][rows], sd[f"k_proj.{suffix}"], sd[f"v_proj.{suffix}"]]
        state[f"qkv_proj.{suffix}"] = torch.cat(parts)
        state[f"out_proj.{suffix}"] = sd[f"o_proj.{suffix}"]
    if m.qk_norm is not None:
        state.update({f"qk_norm.{n}.weight": sd[f"{n}.weight"] for n in ("q_norm", "k_norm")})
    m.load_state_dict({k: v.detach().to(dtype) for k, v in state.items()}, strict=True)
    return OfficialGatedAttention(m, rows).eval()


def to_official(module: OfficialGatedAttention) -> dict[str, torch.Tensor]:
    """The official state dict (copies) of a converted module, the inverse of ``from_official``."""
    m, rows = module.attention, module.rows
    H, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    widths = [H * (D + m.gate_width), G * D, G * D]
    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        t = getattr(m.qkv_proj, suffix)
        if t is None:
            continue
        qg, k, v = t.detach().split(widths)
        out[f"q_proj.{suffix}"] = qg[torch.argsort(rows)].clone()
        out[f"k_proj.{suffix}"], out[f"v_proj.{suffix}"] = k.clone(), v.clone()
        out[f"o_proj.{suffix}"] = getattr(m.out_proj, suffix).detach().clone()
    if m.qk_norm is not None:
        out.update({f"{n}.weight": getattr(m.qk_norm, n).weight.detach().clone() for n in ("q_norm", "k_norm")})
    return out


def _head_dim(state_dict, num_kv_heads: int, head_dim: int | None) -> int:
    if head_dim is not None:
        return head_dim
    if "k_proj.weight" not in state_dict:
        raise ValueError(f"state_dict has no 'k_proj.weight'; keys: {sorted(state_dict)}")
    return state_dict["k_proj.weight"].shape[0] // num_kv_heads


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    headwise_attn_output_gate: bool = False,
    elementwise_attn_output_gate: bool = False,
    use_qk_norm: bool = True,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    qkv_bias: bool = False,
    attention_dropout: float = 0.0,
    use_sliding_window: bool = False,
) -> OfficialGatedAttention:
    """Build the multihead equivalent of one official gated ``Qwen3Attention`` layer.

    Args:
        state_dict: the layer's official parameters (module docstring).
        hidden_size, num_attention_heads, num_key_value_heads (None: H),
            head_dim (None: from ``k_proj.weight``), the two gate flags,
            use_qk_norm, rms_norm_eps, rope_theta, rope_scaling, qkv_bias,
            attention_dropout, use_sliding_window: the official
            ``Qwen3Config`` fields the attention reads.

    Returns:
        an :class:`OfficialGatedAttention` in eval mode, in the dtype of
        ``q_proj.weight``.

    Raises:
        ValueError: no gate (plain Qwen3 attention: use "gqa"), a rope
            scaling other than the default, a sliding window (the official
            layer applies it only in its flash-attention path), sizes that
            do not fit, or a state dict with missing, unexpected or
            misshapen entries.
    """
    if not (headwise_attn_output_gate or elementwise_attn_output_gate):
        raise ValueError("neither headwise_attn_output_gate nor elementwise_attn_output_gate is set: the layer has "
                         "no output gate (plain Qwen3 attention is the 'gqa' kind)")  # fmt: skip
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
        raise ValueError(f"rope_scaling={rope_scaling!r} is not supported: only the default rope")
    if use_sliding_window:
        raise ValueError("use_sliding_window=True is not supported (the official layer windows only its "
                         "flash-attention path)")  # fmt: skip
    G = num_attention_heads if num_key_value_heads is None else num_key_value_heads
    D = _head_dim(state_dict, G, head_dim)
    gate = "headwise" if headwise_attn_output_gate else "elementwise"  # the official if/elif order
    dtype = state_dict["q_proj.weight"].dtype if "q_proj.weight" in state_dict else None
    m = OutputGatedAttention(
        hidden_size, num_attention_heads, num_kv_heads=G, head_dim=D, gate=gate, qkv_bias=qkv_bias,
        out_bias=qkv_bias, dropout=attention_dropout, rope={"base": float(rope_theta)}, qk_norm=bool(use_qk_norm),
        qk_norm_eps=rms_norm_eps, dtype=dtype,
    )  # fmt: skip
    return load_official(m, state_dict, grouped_rows(m.num_heads, G, D, m.gate_width), bias=qkv_bias)
