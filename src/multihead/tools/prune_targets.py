"""Where ``prune_heads`` finds a model's attention layers, and how it rebuilds one.

A prunable model owns a config with per-layer head counts and numbers its
attention layers as ``tools.heads.attention_layers`` does (model order)::

    GPT              0 .. N-1   blocks.{i}.attn                 config.layer_heads / layer_kv_heads
    BertEncoder      0 .. N-1   layers.{i}.attention            config.layer_heads / layer_kv_heads
    SentenceEncoder  its encoder, as BertEncoder
    Transformer      encoder self-attention first, then each decoder layer's
                     self- and cross-attention (N_enc = 2, N_dec = 2):

                     0  encoder.0.self_attn    config.encoder_layer_heads[0]
                     1  encoder.1.self_attn    config.encoder_layer_heads[1]
                     2  decoder.0.self_attn    config.decoder_layer_heads[0]
                     3  decoder.0.cross_attn   config.cross_layer_heads[0]
                     4  decoder.1.self_attn    config.decoder_layer_heads[1]
                     5  decoder.1.cross_attn   config.cross_layer_heads[1]

``PruneTarget`` hides these differences from ``tools.prune``: the layers in
that order, a way to put a new layer in slot i, a config listing given head
counts, and a builder of slot i's attention from such a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..models.bert import BertEncoder, layer_attention
from ..models.gpt import GPT
from ..models.gpt_blocks import block_attention
from ..models.minilm import SentenceEncoder
from ..models.transformer import ATTENTION_ROLES, Transformer, transformer_attention
from ..modules.base import AttentionLayer
from ..modules.registry import attention_class

__all__ = ["PruneTarget", "prune_target"]


@dataclass
class PruneTarget:
    """The attention layers of one model, in ``attention_layers`` order, and how to replace them.

    Attributes:
        model: the module that owns ``config`` (a SentenceEncoder's encoder).
        slots: (parent module, attribute name) of attention layer i.
        build: (config, i, dtype) -> layer i's attention for ``config``, on the meta device.
        with_counts: (query heads per layer, key/value heads per layer) -> a new config listing them.
    """

    model: nn.Module
    slots: list[tuple[nn.Module, str]]
    build: Callable[[object, int, torch.dtype], nn.Module]
    with_counts: Callable[[list[int], list[int]], object]

    @property
    def layers(self) -> list[AttentionLayer]:
        return [getattr(parent, name) for parent, name in self.slots]

    def set_layer(self, i: int, attention: nn.Module) -> None:
        parent, name = self.slots[i]
        setattr(parent, name, attention)


def _uniform_model(model: GPT | BertEncoder) -> PruneTarget:
    if isinstance(model, GPT):
        slots, build = [(block, "attn") for block in model.blocks], block_attention
    else:
        slots, build = [(layer, "attention") for layer in model.layers], layer_attention
    config = model.config

    def with_counts(heads: list[int], kv: list[int]):
        return dataclasses.replace(
            config, layer_heads=heads, layer_kv_heads=None if config.num_kv_heads is None else kv
        )

    return PruneTarget(model, slots, lambda c, i, dtype: build(c, i, device="meta", dtype=dtype), with_counts)


def _encoder_decoder(model: Transformer) -> PruneTarget:
    config = model.config
    n_enc = len(model.encoder)
    roles = [("encoder", i) for i in range(n_enc)]
    roles += [(role, i) for i in range(len(model.decoder)) for role in ("decoder", "cross")]
    slots = [(layer, "self_attn") for layer in model.encoder]
    slots += [(layer, name) for layer in model.decoder for name in ("self_attn", "cross_attn")]

    def build(c, i: int, dtype: torch.dtype) -> nn.Module:
        return transformer_attention(c, *roles[i], device="meta", dtype=dtype)

    def with_counts(heads: list[int], kv: list[int]):
        fields = {}
        for role, (heads_field, kv_field) in ATTENTION_ROLES.items():
            picked = [j for j, (r, _) in enumerate(roles) if r == role]  # that role's layers, in layer order
            fields[heads_field] = [heads[j] for j in picked]
            fields[kv_field] = None if config.num_kv_heads is None else [kv[j] for j in picked]
        return dataclasses.replace(config, **fields)

    return PruneTarget(model, slots, build, with_counts)


def prune_target(model: nn.Module) -> PruneTarget:
    """The ``PruneTarget`` of a GPT, BertEncoder, SentenceEncoder or Transformer.

    Raises:
        TypeError: another kind of model.
        ValueError: an attention kind whose heads cannot be removed one by one
            (the message gives the kind's reason).
    """
    if isinstance(model, SentenceEncoder):
        model = model.encoder
    if not isinstance(model, (GPT, BertEncoder, Transformer)):
        raise TypeError(
            f"prune_heads takes a GPT, BertEncoder, SentenceEncoder or Transformer, got {type(model).__name__}"
        )
    kind = model.config.attention
    cls = attention_class(kind)
    if not cls.independent_heads:
        raise ValueError(f"attention kind {kind!r} cannot lose one head alone: {cls.head_independence}")
    if isinstance(model, Transformer):
        return _encoder_decoder(model)
    return _uniform_model(model)
