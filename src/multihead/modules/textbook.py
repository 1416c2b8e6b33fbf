"""Former home of Raschka's chapter 3 classes; the code lives in ``multihead.textbook.raschka``."""

from ..textbook.raschka import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

__all__ = [
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]
