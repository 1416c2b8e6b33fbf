"""Differential Transformer weights (microsoft/unilm ``Diff-Transformer``) as multihead modules.

    module = multihead.convert.from_official(
        "diff_transformer", state_dict, embed_dim=1024, depth=3, num_heads=8, num_kv_heads=4)
    module = multihead.convert.from_official(
        "diff_transformer_v2", state_dict, d_model=1024, num_heads=8, num_kv_heads=4, head_dim=64)
    y = module(x)                                   # x [B, T, C] -> [B, T, C], causal, positions 0 .. T-1
    cache = module.make_kv_cache(B, max_len)        # then module(x_new, kv_cache=cache) decodes
    state_dict = multihead.convert.official.diff_transformer.to_official(module)   # the official names again

V1, ``MultiheadDiffAttn`` -> :class:`~multihead.modules.kinds.differential.DifferentialAttention`
(the same names, no biases)::

    q_proj.weight (C, C)  k_proj.weight, v_proj.weight (C·G/H, C)  out_proj.weight (C, C)
    lambda_q1, lambda_k1, lambda_q2, lambda_k2 (d,)              d = C / H / 2

V2, ``MultiheadFlashDiffV2`` (``use_diff_v2=True``) ->
:class:`~multihead.modules.kinds.differential_v2.DifferentialV2Attention`
(``multihead.convert.official.diff_transformer_v2``)::

    q_proj.weight (2H·d, C)  k_proj.weight, v_proj.weight (G·d, C)  lambda_proj.weight (H, C)
    o_proj.weight (C, H·d) -> out_proj.weight

Both official forwards are causal self-attention with interleaved rope on
each d-wide (sub-)head, its (cos, sin) table computed outside the layer
from the positions; the module here takes the positions (``positions=``,
default 0 .. T-1, continued by a KV cache) and computes the table with
``rope_base`` (10000 unless given). Their attention runs in the weights'
dtype here; the official V1 takes the softmax and λ in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from ...modules.kinds.differential import DifferentialAttention

__all__ = ["OfficialCausalAttention", "from_official", "load_official", "official_dtype", "to_official"]


class OfficialCausalAttention(nn.Module):
    """An official causal self-attention layer's forward, computed by a multihead kind.

    Attributes:
        attention: the multihead module (rope interleaved, no biases).
    """

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]: causal self-attention at ``positions`` ([T] or [B, T];
        default 0 .. T-1, after the cached tokens with ``kv_cache``)."""
        return self.attention(x, is_causal=True, positions=positions, kv_cache=kv_cache)

    def make_kv_cache(self, batch_size: int, max_len: int, **kwargs):
        """The attention's KV cache (``make_kv_cache`` of the kind)."""
        return self.attention.make_kv_cache(batch_size, max_len, **kwargs)


def load_official(module: nn.Module, state_dict: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """Copy the official tensors (official name -> ours in ``names``) into ``module``, checking
    that every name is there, none is extra and each shape fits."""
    ours = module.state_dict()
    extra = sorted(set(state_dict) - set(names))
    if extra:
        raise ValueError(f"unexpected official keys {extra}; expected {sorted(names)}")
    missing = sorted(set(names) - set(state_dict))
    if missing:
        raise ValueError(f"state_dict lacks {missing}")
    converted = {}
    for key, name in names.items():
        value = torch.as_tensor(state_dict[key])
        if tuple(value.shape) != tuple(ours[name].shape):
            raise ValueError(f"{key!r} has shape {tuple(value.shape)}, expected {tuple(ours[name].shape)}")
        converted[name] = value.detach().clone().to(ours[name].dtype)
    module.load_state_dict(converted, strict=True)


def official_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    if "q_proj.weight" not in state_dict:
        raise ValueError(f"state_dict has no 'q_proj.weight'; keys: {sorted(state_dict)}")
    return torch.as_tensor(state_dict["q_proj.weight"]).dtype


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    embed_dim: int,
    depth: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    rope_base: float = 10000.0,
) -> OfficialCausalAttention:
    """Build the multihead equivalent of one official ``MultiheadDiffAttn`` (V1).

    Args:
        state_dict: the layer's parameters under the official names (module
            docstring; strip any prefix such as ``layers.3.self_attn.`` first).
        embed_dim, depth, num_heads: the official constructor's arguments
            (``num_heads`` is the differential heads, half a Transformer's).
        num_kv_heads: ``args.decoder_kv_attention_heads`` (None: num_heads).
        rope_base: the base of the rope table the official model feeds in.

    Returns:
        an :class:`OfficialCausalAttention` in eval mode with copies of the
        weights, in the dtype of ``q_proj.weight``.

    Raises:
        ValueError: sizes the official layer cannot have, or a state dict
            with missing, unexpected or wrongly shaped entries (each named).
    """
    attn = DifferentialAttention(
        embed_dim, num_heads, num_kv_heads=num_kv_heads, depth=depth, qkv_bias=False, out_bias=False,
        rope={"interleaved": True, "base": float(rope_base)}, dtype=official_dtype(state_dict),
    )  # fmt: skip
    names = {n: n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight",
                            "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}  # fmt: skip
    load_official(attn, state_dict, names)
    return OfficialCausalAttention(attn).eval()


def to_official(module: OfficialCausalAttention | nn.Module) -> dict[str, torch.Tensor]:
    """The official state dict (copies) of a converted module, the inverse of ``from_official``
    (V1 here and V2 in ``differential_v2``: every name but V2's ``o_proj`` is the module's own).

    Raises:
        ValueError: a layer with biases, which the official layers do not have.
    """
    attn = module.attention if isinstance(module, OfficialCausalAttention) else module
    state = {n: t for n, t in attn.state_dict().items() if not n.startswith("qk_norm.")}
    biases = sorted(n for n in state if n.endswith(".bias"))
    if biases or attn.qk_norm is not None:
        raise ValueError(f"the official layer has no biases or qk_norm; this one has {biases or ['qk_norm']}")
    names = {"out_proj.weight": "o_proj.weight"} if attn.kind == "diff_v2" else {}
    return {names.get(n, n): t.detach().clone() for n, t in state.items()}
