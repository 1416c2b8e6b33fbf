"""What heads are scored on: the losses of a GPT and of a sentence encoder, and
the recipes ``multihead prune`` and ``multihead inspect --importance`` use.

    family                  method     loss the heads are scored on
    GPT                     gradient   next-token cross-entropy (``lm_loss``; rows normalised per layer)
                            ablation   next-token cross-entropy
                            gates      KL to the unpruned model's next-token distribution
    encoder (MiniLM, BERT)  gradient   in-batch next-line contrastive loss (``contrastive_loss``:
                                       cross-entropy of 20 * cos over the batch's next lines;
                                       padding excluded; rows normalised per layer)
                            ablation   1 - cos to the unpruned embeddings of the pairs' first
                                       lines (``tools.distill``, "cosine")
                            gates      the same distillation objective, gates trained on it
                                       (``tools.gate_importance``)

    scores = gpt_scores(gpt, "gradient", [x0, x1])             # windows [B, T] -> [L, H]
    scores = encoder_scores(encoder, "ablation", pairs)        # (line, next line) pairs -> [L, H]
    scores = gpt_importance(gpt, ids)                          # one text [1, T] -> [L, H]

Gates: ``GateTraining(penalties, steps=GATE_STEPS, lr=GATE_LR)``, default
penalties ``GATE_PENALTIES[family]``: one training per penalty, the score
of a head its P(open) averaged over them. The default penalties were chosen
on the pretrained MiniLM and the default mini GPT run to span few to most
heads closed (docs/surgery.md).

A GPT here is ``multihead.models.GPT`` (ids [B, T] -> logits [B, T, V]); an
encoder is ``multihead.models.minilm.SentenceEncoder`` (``tokenize``, and a
call on input_ids, attention_mask, token_type_ids -> embeddings [B, C]).
Every score table is [L, H] float64, NaN past a pruned layer's heads
(``tools.importance.head_importance``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .distill import distillation
from .gate_importance import GateTraining
from .importance import head_importance

__all__ = [
    "METHODS", "GATE_PENALTIES", "GATE_STEPS", "GATE_LR", "BATCH_SIZE", "SCALE", "next_token_logits", "lm_loss",
    "embed", "contrastive_loss", "anchor_batches", "embedding_distance", "gate_training", "encoder_scores",
    "gpt_scores", "gpt_importance", "encoder_importance",
]  # fmt: skip

METHODS = ("gradient", "ablation", "gates")
GATE_PENALTIES = {"encoder": (0.01, 0.03, 0.1), "gpt": (0.1, 0.3, 1.0)}
GATE_STEPS = GateTraining.steps
GATE_LR = GateTraining.lr
BATCH_SIZE = 64  # lines per encoder batch
SCALE = 20.0  # 1 / temperature of the contrastive loss


# ------------------------------------------------------------------ outputs and losses
def next_token_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Next-token logits [B, T-1, V] of a GPT on windows x [B, T] (the last token predicts nothing here)."""
    return model(x[:, :-1])


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (nats per token, a 0-d tensor) of a GPT on windows x [B, T], T >= 2:
    tokens 1..T-1 predicted from the ones before."""
    out = next_token_logits(model, x)  # (B, T-1, V)
    return F.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())


def embed(model: nn.Module, tok) -> torch.Tensor:
    """Sentence embeddings [B, C] of lines tokenized by ``model.tokenize`` (a ``SentenceEncoder``)."""
    return model(tok.input_ids, tok.attention_mask, tok.token_type_ids)


def contrastive_loss(model: nn.Module, batch) -> torch.Tensor:
    """In-batch next-line loss of a sentence encoder: anchor i must pick its own next line.

    Args:
        model: a ``SentenceEncoder`` whose embeddings have unit norm.
        batch: (tokens of 2B lines, B): the B anchors, then their B next lines.

    Returns:
        a 0-d tensor, cross-entropy of ``SCALE`` * cos [B, B] against the diagonal.
    """
    tok, B = batch
    emb = embed(model, tok)  # (2B, C), unit norm
    out = SCALE * emb[:B] @ emb[B:].T  # (B, B): 20 * cos
    return F.cross_entropy(out, torch.arange(B, device=out.device))


def anchor_batches(model: nn.Module, pairs: list[tuple[str, str]]) -> list:
    """The pairs' first lines, tokenized by ``model.tokenize`` in batches of ``BATCH_SIZE``."""
    return [model.tokenize([a for a, _ in pairs[i : i + BATCH_SIZE]]) for i in range(0, len(pairs), BATCH_SIZE)]


def embedding_distance(reference: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """e [1, C] -> 1 - cos(e, reference), a 0-d float64 tensor (``reference`` [1, C])."""
    ref = reference.double()
    return lambda e: 1 - F.cosine_similarity(e.double(), ref, dim=-1).reshape(())


# ------------------------------------------------------------------ scores on calibration data
def gate_training(family: str, penalties: tuple[float, ...] | None = None, steps: int | None = None) -> GateTraining:
    """The gate training of ``prune --method gates`` for "encoder" or "gpt" (None: the family's default)."""
    return GateTraining(penalties=GATE_PENALTIES[family] if penalties is None else penalties,
                        steps=GATE_STEPS if steps is None else steps, lr=GATE_LR)  # fmt: skip


def encoder_scores(model: nn.Module, method: str, pairs: list[tuple[str, str]], gates: GateTraining | None = None) -> torch.Tensor:
    """[L, H] float64 scores of a sentence encoder's heads on calibration (line, next line) pairs.

    Args:
        model: a ``SentenceEncoder``.
        method: "gradient", "ablation" or "gates" (the table in the module docstring).
        pairs: (line, next line) pairs, tokenized in batches of ``BATCH_SIZE``.
        gates: "gates" only; None: ``gate_training("encoder")``.
    """
    if method == "gradient":
        chunks = [pairs[i : i + BATCH_SIZE] for i in range(0, len(pairs), BATCH_SIZE)]
        batches = [(model.tokenize([a for a, _ in c] + [b for _, b in c]), len(c)) for c in chunks]
        return head_importance(model, batches, contrastive_loss, method="gradient", progress=True,
                               token_mask=lambda b: b[0].attention_mask.bool())  # fmt: skip
    targets, drift = distillation(model, anchor_batches(model, pairs), embed, objective="cosine")
    return _scores(model, method, targets, drift, gates, "encoder")


def gpt_scores(model: nn.Module, method: str, batches: list[torch.Tensor], gates: GateTraining | None = None) -> torch.Tensor:
    """[L, H] float64 scores of a GPT's heads on calibration windows.

    Args:
        model: a ``GPT``.
        method: "gradient", "ablation" or "gates" (the table in the module docstring).
        batches: token windows, each [B, T] with T >= 2.
        gates: "gates" only; None: ``gate_training("gpt")``.
    """
    if method != "gates":
        normalize = "layer" if method == "gradient" else None
        return head_importance(model, batches, lm_loss, method=method, normalize=normalize, progress=True)
    targets, kl = distillation(model, batches, next_token_logits, objective="kl")
    return _scores(model, method, targets, kl, gates, "gpt")


def _scores(model, method: str, batches: list, loss_fn, gates: GateTraining | None, family: str) -> torch.Tensor:
    if method == "ablation":
        return head_importance(model, batches, loss_fn, method="ablation", normalize=None, progress=True)
    training = gate_training(family) if gates is None else gates
    return head_importance(model, batches, loss_fn, method="gates", gate_training=training, progress=True)


# ------------------------------------------------------------------ scores on one text (ablation)
def gpt_importance(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[L, H] float64: the LM-loss increase on one text when each head alone is masked.

    Args:
        model: a ``GPT``.
        ids: [1, T] token ids of the text, T >= 2.

    Raises:
        ValueError: fewer than 2 tokens (nothing to predict).
    """
    if ids.shape[1] < 2:
        raise ValueError(
            f"the LM loss of a text predicts its next tokens: the text has {ids.shape[1]} token, give at least 2"
        )
    return head_importance(model, [ids], lm_loss, method="ablation", normalize=None)


def encoder_importance(encoder: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[L, H] float64: 1 - cos between the mean-pooled embedding of one text with each head
    alone masked and without any masked.

    Args:
        encoder: a ``SentenceEncoder`` (its ``encoder`` gives the last hidden states).
        ids: [1, T] token ids of the text.
    """
    mask = torch.ones_like(ids)  # (1, T): one sentence, no padding

    def pooled(net: nn.Module) -> torch.Tensor:
        last = net.encoder(ids, attention_mask=mask)  # (1, T, C)
        return last.mean(dim=1)  # (1, T, C) -> (1, C)

    with torch.no_grad():
        distance = embedding_distance(pooled(encoder.eval()))
    return head_importance(encoder, [ids], lambda net, _: distance(pooled(net)), method="ablation", normalize=None)
