"""Tools that take models or tensors: capture attention, score head roles
(on one text, or over a corpus with their spread), draw the views, mask heads and score their importance (gradient,
ablation, learned gates) on the objectives of a GPT or a sentence
encoder, prune heads, convert MHA to GQA, distil a converted or pruned
model back towards the original, count a model's KV cache and time a
speed-up with its spread."""

from .capture import AttentionRecord, LayerAttention, attention_modules, capture
from .causal_roles import CAUSAL_ROLES, CausalScores, causal_head_scores, repeated_random_tokens
from .convert_heads import to_gqa
from .corpus_roles import CorpusRoles, corpus_roles, score_records
from .corpus_stats import CorpusHeadRoles, EvidenceRule, ScoreSpread
from .corpus_table import corpus_table, format_corpus_roles
from .distill import distillation, divergence
from .flops import KVCacheSize, kv_cache_size
from .gate_importance import GateSweep, GateTraining, gate_sweep
from .heads import attention_layers, mask_heads
from .importance import head_importance
from .objectives import (
    contrastive_loss,
    embed,
    encoder_importance,
    encoder_scores,
    gate_training,
    gpt_importance,
    gpt_scores,
    lm_loss,
    next_token_logits,
)
from .prune import prune_closed_heads, prune_heads
from .recovery import recover
from .roles import (
    ROLE_MARGIN,
    ROLE_THRESHOLDS,
    SCORE_MEANINGS,
    HeadRoles,
    classify_heads,
    format_legend,
    format_roles,
    role_legend,
    strongest_links,
)
from .timing import Speedup, measure_speedup
from .token_text import readable_tokens
from .visualize import write_html, write_json, write_png

__all__ = [
    "capture",
    "causal_head_scores",
    "CausalScores",
    "CAUSAL_ROLES",
    "repeated_random_tokens",
    "AttentionRecord",
    "LayerAttention",
    "attention_modules",
    "classify_heads",
    "HeadRoles",
    "corpus_roles",
    "score_records",
    "CorpusRoles",
    "CorpusHeadRoles",
    "ScoreSpread",
    "EvidenceRule",
    "corpus_table",
    "format_corpus_roles",
    "ROLE_THRESHOLDS",
    "ROLE_MARGIN",
    "SCORE_MEANINGS",
    "role_legend",
    "format_legend",
    "format_roles",
    "strongest_links",
    "write_html",
    "readable_tokens",
    "write_png",
    "write_json",
    "attention_layers",
    "mask_heads",
    "head_importance",
    "lm_loss",
    "next_token_logits",
    "embed",
    "contrastive_loss",
    "gpt_scores",
    "encoder_scores",
    "gate_training",
    "gpt_importance",
    "encoder_importance",
    "gate_sweep",
    "GateTraining",
    "GateSweep",
    "distillation",
    "divergence",
    "kv_cache_size",
    "KVCacheSize",
    "measure_speedup",
    "Speedup",
    "to_gqa",
    "prune_heads",
    "prune_closed_heads",
    "recover",
]
