"""Attention classes as the tutorials teach them, with their published bugs fixed.

* Raschka, *Build a Large Language Model (From Scratch)*, chapter 3: ``SelfAttention_v1``,
  ``SelfAttention_v2``, ``CausalAttention``, ``MultiHeadAttentionWrapper``,
  ``MultiHeadAttention`` (a seed set right before construction reproduces the book).
* The Annotated Transformer: ``MultiHeadedAttention``, ``subsequent_mask``, ``clones``,
  ``attention``.
* A common PyTorch tutorial's two multi-head forms: ``AttentionHead``,
  ``PerHeadMultiHeadAttention``, ``SplitMultiHeadAttention``, ``scaled_dot_product``.

Example:
    >>> import torch
    >>> from multihead.textbook import MultiHeadAttention
    >>> _ = torch.manual_seed(123)
    >>> mha = MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
    >>> mha(torch.rand(2, 6, 3)).shape
    torch.Size([2, 6, 2])
"""

from .annotated import MultiHeadedAttention, attention, clones, subsequent_mask
from .raschka import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from .tutorial import (
    AttentionHead,
    PerHeadMultiHeadAttention,
    SplitMultiHeadAttention,
    scaled_dot_product,
)

__all__ = [
    # Raschka, chapter 3
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
    # Annotated Transformer
    "MultiHeadedAttention",
    "subsequent_mask",
    "clones",
    "attention",
    # tutorial forms
    "AttentionHead",
    "PerHeadMultiHeadAttention",
    "SplitMultiHeadAttention",
    "scaled_dot_product",
]
