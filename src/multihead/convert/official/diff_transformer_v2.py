"""Differential Transformer V2 weights (microsoft/unilm ``Diff-Transformer-V2``,
``MultiheadFlashDiffV2``) as a multihead module; the names and the forward are
described in ``multihead.convert.official.diff_transformer``.

    module = multihead.convert.from_official(
        "diff_transformer_v2", state_dict, d_model=1024, num_heads=8, num_kv_heads=4, head_dim=64)
"""

from __future__ import annotations

import torch

from ...modules.kinds.differential_v2 import DifferentialV2Attention
from .diff_transformer import OfficialCausalAttention, load_official, official_dtype

__all__ = ["from_official"]


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    d_model: int,
    num_heads: int,
    num_kv_heads: int | None,
    head_dim: int,
    use_diff_v2: bool = True,
    rope_base: float = 10000.0,
) -> OfficialCausalAttention:
    """Build the multihead equivalent of one official ``MultiheadFlashDiffV2``.

    Args:
        state_dict: the layer's parameters under the official names.
        d_model, num_heads, num_kv_heads, head_dim: the official constructor's
            arguments (``num_kv_heads`` None: num_heads; it divides 2·num_heads).
        use_diff_v2: must be True (False is the baseline attention: convert
            it as a "gqa" layer).
        rope_base: the base of the rope table the official model feeds in.

    Raises:
        ValueError: ``use_diff_v2=False``, sizes the official layer cannot
            have, or a state dict with missing, unexpected or wrongly shaped
            entries (each named).
    """
    if use_diff_v2 is not True:
        raise ValueError(f"use_diff_v2={use_diff_v2!r}: only the differential layer converts here; "
                         "the baseline is plain attention (a 'gqa' layer)")  # fmt: skip
    attn = DifferentialV2Attention(
        d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=False, out_bias=False,
        rope={"interleaved": True, "base": float(rope_base)}, dtype=official_dtype(state_dict),
    )  # fmt: skip
    names = {n: n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "lambda_proj.weight")}
    names["o_proj.weight"] = "out_proj.weight"
    load_official(attn, state_dict, names)
    return OfficialCausalAttention(attn).eval()
