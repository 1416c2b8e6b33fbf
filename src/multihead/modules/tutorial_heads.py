"""Former home of the tutorial's two multi-head forms; the code lives in ``multihead.textbook.tutorial``."""

from ..textbook.tutorial import AttentionHead, PerHeadMultiHeadAttention, SplitMultiHeadAttention, scaled_dot_product

__all__ = ["scaled_dot_product", "AttentionHead", "PerHeadMultiHeadAttention", "SplitMultiHeadAttention"]
