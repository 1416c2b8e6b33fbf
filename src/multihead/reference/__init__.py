"""NumPy float64 reference implementations of attention (the specification).

``basic`` holds the textbook forms (list of heads, vectorised, einsum);
``attention`` holds the general reference that torch code is tested against.
"""

from multihead.reference.attention import attention, causal_mask
from multihead.reference.basic import (
    multihead_attention_einsum,
    multihead_attention_list,
    multihead_attention_vec,
    multihead_cross_attention_list,
    self_attention,
    softmax,
)

__all__ = [
    "attention",
    "causal_mask",
    "multihead_attention_einsum",
    "multihead_attention_list",
    "multihead_attention_vec",
    "multihead_cross_attention_list",
    "self_attention",
    "softmax",
]
