"""NumPy float64 reference implementations of attention (the specification).

``basic`` holds the textbook forms (list of heads, vectorised, einsum);
``attention`` holds the general reference that torch code is tested against;
one module per attention variant holds that variant in its paper's notation
(``collaborative``, ``dcmha``, ``differential``, ``gated``, ``mla``, ``moh``,
``output_gated``, ``overlapping``).
"""

from multihead.reference import collaborative, dcmha, differential, gated, mla, moh, output_gated, overlapping
from multihead.reference.attention import attention, causal_mask
from multihead.reference.basic import (
    multihead_attention_einsum,
    multihead_attention_list,
    multihead_attention_vec,
    multihead_cross_attention_list,
    self_attention,
    softmax,
)
from multihead.reference.collaborative import collaborative_attention
from multihead.reference.dcmha import dcmha_attention, talking_heads_attention
from multihead.reference.differential import differential_attention, differential_v2_attention
from multihead.reference.gated import gated_multihead_attention
from multihead.reference.mla import mla_attention
from multihead.reference.moh import moh_attention
from multihead.reference.output_gated import output_gated_attention
from multihead.reference.overlapping import overlapping_attention

__all__ = [
    "attention",
    "causal_mask",
    "multihead_attention_einsum",
    "multihead_attention_list",
    "multihead_attention_vec",
    "multihead_cross_attention_list",
    "self_attention",
    "softmax",
    "collaborative",
    "collaborative_attention",
    "dcmha",
    "dcmha_attention",
    "talking_heads_attention",
    "differential",
    "differential_attention",
    "differential_v2_attention",
    "gated",
    "gated_multihead_attention",
    "mla",
    "mla_attention",
    "moh",
    "moh_attention",
    "output_gated",
    "output_gated_attention",
    "overlapping",
    "overlapping_attention",
]
