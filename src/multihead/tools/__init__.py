"""Tools that take models or tensors: capture attention, score head roles,
draw the views (and, as they land, importance, pruning, conversion, FLOPs)."""

from .capture import AttentionRecord, LayerAttention, attention_modules, capture
from .roles import (
    ROLE_THRESHOLDS,
    SCORE_MEANINGS,
    HeadRoles,
    classify_heads,
    format_legend,
    format_roles,
    role_legend,
    strongest_links,
)
from .visualize import write_html, write_json, write_png

__all__ = [
    "capture",
    "AttentionRecord",
    "LayerAttention",
    "attention_modules",
    "classify_heads",
    "HeadRoles",
    "ROLE_THRESHOLDS",
    "SCORE_MEANINGS",
    "role_legend",
    "format_legend",
    "format_roles",
    "strongest_links",
    "write_html",
    "write_png",
    "write_json",
]
