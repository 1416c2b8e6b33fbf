"""Tools that take models or tensors: capture attention, keep a forward's
named activations (``run_with_cache``), score head roles (on one text,
or over a corpus with their spread),
draw the views (files, or inline in a notebook for any model's
attentions; rollout and flow), mask heads, measure each head's causal
effect on a metric (zero, mean, patch, restore) and score their importance (gradient,
ablation, learned gates) on the objectives of a GPT or a sentence
encoder, prune heads, convert MHA to GQA or MLA, distil a converted or pruned
model back towards the original, count a model's KV cache and time a
speed-up with its spread."""

from .activations import ACTIVATION_NAMES, Activations, LayerActivations
from .capture import AttentionRecord, LayerAttention, attention_modules, capture
from .causal_roles import (
    CAUSAL_ROLES,
    CausalScores,
    causal_head_scores,
    repeated_random_tokens,
    special_token_ids,
)
from .convert_heads import to_gqa
from .convert_mla import to_mla
from .corpus_roles import CorpusRoles, corpus_roles, score_records
from .corpus_stats import CorpusHeadRoles, EvidenceRule, ScoreSpread
from .corpus_table import corpus_table, format_corpus_roles
from .distill import distillation, divergence
from .effects_view import write_effects_html, write_effects_png
from .flops import KVCacheSize, kv_cache_size
from .gate_importance import GateSweep, GateTraining, gate_sweep
from .head_effects import HeadEffects, head_effects, logit_difference
from .head_links import strongest_links
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
)
from .rollout import MAX_FLOW_TOKENS, attention_flow, attention_rollout
from .run_with_cache import run_with_cache
from .timing import Speedup, measure_speedup
from .token_text import readable_tokens
from .views import AttentionView, head_view, model_view, rollout_view
from .visualize import write_html, write_json, write_png

__all__ = [
    "capture",
    "run_with_cache",
    "Activations",
    "LayerActivations",
    "ACTIVATION_NAMES",
    "causal_head_scores",
    "CausalScores",
    "CAUSAL_ROLES",
    "repeated_random_tokens",
    "special_token_ids",
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
    "head_view",
    "model_view",
    "rollout_view",
    "AttentionView",
    "attention_rollout",
    "attention_flow",
    "MAX_FLOW_TOKENS",
    "attention_layers",
    "mask_heads",
    "head_effects",
    "HeadEffects",
    "logit_difference",
    "write_effects_html",
    "write_effects_png",
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
    "to_mla",
    "prune_heads",
    "prune_closed_heads",
    "recover",
]
