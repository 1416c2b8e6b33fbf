"""How much each head of a transformers model matters on one text, by ablation.

    scores = encoder_importance(model, ids, num_layers, num_heads)   # [L, H] float64

The model (loaded with ``load_hf``: multihead attention) is read as a text
encoder: e is the mean of its last hidden states over the text's tokens,
and head h of layer l scores 1 - cos(e with that head alone masked, e)
(``head_mask``). One forward per head plus one: L * H + 1 passes. The same
score as ``multihead.tools.objectives.encoder_importance`` for multihead's
own encoders.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tools.objectives import embedding_distance
from .scopes import head_mask

__all__ = ["encoder_importance"]


@torch.no_grad()
def encoder_importance(model: nn.Module, ids: torch.Tensor, num_layers: int, num_heads: int) -> torch.Tensor:
    """[L, H] float64: 1 - cos of the mean-pooled last hidden state per masked head.

    Args:
        model: a transformers model on multihead attention whose output has
            ``last_hidden_state`` [1, T, C] (``AutoModel``).
        ids: [1, T] token ids of the text.
        num_layers, num_heads: L and H (the model's attention layers and heads).
    """
    mask = torch.ones_like(ids)  # (1, T)

    def pooled() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state.mean(dim=1)  # (1, T, C) -> (1, C)

    distance = embedding_distance(pooled())
    base = float(distance(pooled()))  # 0 up to rounding, subtracted as head_importance does
    scores = torch.zeros(num_layers, num_heads, dtype=torch.float64)
    for layer in range(num_layers):
        for head in range(num_heads):
            with head_mask(model, {layer: [head]}):
                scores[layer, head] = float(distance(pooled())) - base
    return scores
