"""Tools that take models or tensors: capture (and, as they land, roles,
views, importance, pruning, conversion, FLOP accounting)."""

from .capture import AttentionRecord, LayerAttention, attention_modules, capture

__all__ = ["capture", "AttentionRecord", "LayerAttention", "attention_modules"]
