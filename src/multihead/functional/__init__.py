"""Functional attention: ``attention`` plus mask builders and backends."""

from .alibi import alibi_bias, alibi_slopes
from .attention import attention
from .backends import AUTO_ORDER, Backend, list_backends, register_backend
from .masks import (
    causal_mask,
    document_mask,
    merge_masks,
    padding_mask_from_ignore,
    padding_mask_from_keep,
    padding_mask_from_lengths,
    prefix_lm_mask,
    sliding_window_mask,
)
from .rope import apply_rope, rope_frequencies, rope_options
from .softmax import masked_softmax
from .weights import WeightSelection

__all__ = [
    "attention",
    "alibi_slopes",
    "alibi_bias",
    "masked_softmax",
    "WeightSelection",
    "apply_rope",
    "rope_frequencies",
    "rope_options",
    "causal_mask",
    "merge_masks",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "padding_mask_from_lengths",
    "padding_mask_from_keep",
    "padding_mask_from_ignore",
    "Backend",
    "AUTO_ORDER",
    "list_backends",
    "register_backend",
]
