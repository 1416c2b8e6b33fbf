"""Which models ``multihead compare`` trains: one per attention kind, matched in size.

Every kind is trained in the same GPT (same preset, data, tokenizer, seed and
token budget); only the attention layer changes. Its options are those its
class declares (``comparison_options(kind, num_heads)``), chosen so each
kind is what its paper calls it at this width (GQA: half as many key/value
heads as query heads), with the user's own options for that kind over them
(``multihead compare --attention-option gqa:num_kv_heads=1``). The default list (:func:`default_kinds`) is every
registered kind, MHA first, but those whose class gives a
``comparison_skip`` reason; a kind from the user's own module joins it once
that module is imported.

Size rule: a kind that changes the parameter count (GQA/MQA remove key/value
projections, DCMHA adds its weight generator, overlapping heads widen the
output projection, ...) gets an MLP hidden width ``mlp_dim`` solved so that
the whole model has as many parameters as the MHA model, to the nearest
whole hidden unit:

    params(M) = params_without_mlp + L * (2 * C * M + M + C)      (fc, proj, their biases)
    M = round((params(MHA) - params_without_mlp - L * C) / (L * (2 * C + 1)))

A kind within ``MATCH_TOLERANCE`` (0.5 %) of the MHA count keeps 4C.
Attention FLOPs and KV-cache bytes per token come from each layer's own
``cost()`` (``modules.cost`` conventions), summed over the L layers, each
block's layer with its own heads and options (local and global layers):

    prefill FLOPs/token = cost(T=context, causal=True).total_flops / context
    decode FLOPs/token  = cost(T=1, S=context).core_flops       (the last position attends
                          + cost(T=1, S=1).projection_flops      to the cache, a local layer
                                                                  to its window; only its
                                                                  own token is projected)
    KV bytes/token      = tools.flops.kv_cache_size(model): cost(...).kv_cache_bytes_per_token
                          at the model's dtype (float32: 4 bytes per element), as convert and
                          prune print it
    KV bytes at context = kv_cache_size(model, context=context_length).bytes, for a model
                          with local layers only: one sequence's caches, a local layer's
                          holding its window
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..models.gpt import GPT, GPTConfig
from ..modules.kinds.mha import MultiHeadAttention
from ..modules.registry import attention_class, check_kind, list_attention_kinds
from ..tools.flops import kv_cache_size

__all__ = ["default_kinds", "BASELINE", "MATCH_TOLERANCE", "KindPlan", "plan_kind", "parse_kinds"]

MATCH_TOLERANCE = 0.005
#: The kind every other is matched in size to and compared with: plain multi-head attention ("mha").
BASELINE = MultiHeadAttention.kind


def default_kinds() -> tuple[str, ...]:
    """Every registered kind whose class gives no ``comparison_skip``, ``BASELINE`` first, then by name."""
    kinds = [k for k in list_attention_kinds() if attention_class(k).comparison_skip is None]
    return tuple(sorted(kinds, key=lambda k: (k != BASELINE, k)))


@dataclass(frozen=True)
class KindPlan:
    """One kind's model in a comparison.

    Attributes:
        kind: the attention kind.
        attention_options: its options (the class's ``comparison_options``).
        mlp_dim: the MLP hidden width (None: 4C, the MHA model's).
        parameters: parameters of the whole model (tied embeddings counted once).
        mha_parameters: the MHA model's count, the target.
        prefill_flops_per_token, decode_flops_per_token: attention FLOPs over
            all layers (projections included), per token.
        kv_cache_bytes_per_token: over all layers, at the model's dtype (float32).
        kv_cache_at_context: {"context": context_length, "bytes": one sequence's
            caches there, local layers holding their window} for a model with a
            local layer; None for one without.
    """

    kind: str
    attention_options: dict[str, Any]
    mlp_dim: int | None
    parameters: int
    mha_parameters: int
    prefill_flops_per_token: float
    decode_flops_per_token: int
    kv_cache_bytes_per_token: int
    kv_cache_at_context: dict[str, int] | None = None


def parse_kinds(text: str) -> tuple[str, ...]:
    """"mha,gqa" -> ("mha", "gqa"); every name must be a registered kind, once.

    Raises:
        ValueError: an empty list, an unknown kind (listing the known ones) or a repeat.
    """
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds:
        raise ValueError(f"--attention needs at least one kind, got {text!r}")
    for k in kinds:
        check_kind(k)
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise ValueError(f"attention kind(s) {repeated} given more than once in {text!r}")
    return kinds


def _model(config: GPTConfig) -> GPT:
    with torch.device("meta"):  # sizes only: no memory, no random numbers
        return GPT(config)


def plan_kind(base: GPTConfig, kind: str, options: dict[str, Any] | None = None) -> KindPlan:
    """The size-matched model of ``kind`` for the MHA model ``base`` (see the module docstring);
    ``options`` (``multihead compare --attention-option KIND:K=V``) go over the class's
    ``comparison_options``."""
    options = {**attention_class(kind).comparison_options(kind, base.num_heads), **(options or {})}
    mha = _model(GPTConfig.from_dict({**base.to_dict(), "attention": BASELINE, "attention_options": {}, "mlp_dim": None}))
    target = mha.num_parameters()
    config = GPTConfig.from_dict({**base.to_dict(), "attention": kind, "attention_options": options, "mlp_dim": None})
    model = _model(config)
    count = model.num_parameters()
    mlp_dim = None
    if abs(count - target) > MATCH_TOLERANCE * target:
        L, C = config.num_layers, config.embed_dim
        M = 4 * C
        without_mlp = count - L * (2 * C * M + M + C)
        mlp_dim = max(1, round((target - without_mlp - L * C) / (L * (2 * C + 1))))
        config = GPTConfig.from_dict({**config.to_dict(), "mlp_dim": mlp_dim})
        model = _model(config)
        count = model.num_parameters()
    T, layers = config.context_length, [block.attn for block in model.blocks]
    prefill = sum(attn.cost(T, causal=True).total_flops for attn in layers)
    # keys/values of the past are cached: only the new token is projected
    decode = sum(attn.cost(1, T).core_flops + attn.cost(1, 1).projection_flops for attn in layers)
    return KindPlan(
        kind=kind,
        attention_options=options,
        mlp_dim=mlp_dim,
        parameters=count,
        mha_parameters=target,
        prefill_flops_per_token=prefill / T,
        decode_flops_per_token=decode,
        kv_cache_bytes_per_token=kv_cache_size(model).bytes_per_token,
        kv_cache_at_context=({"context": T, "bytes": kv_cache_size(model, context=T).bytes}
                             if any(attn.sliding_window is not None for attn in layers) else None),  # fmt: skip
    )
