"""The losses ``multihead prune`` scores heads with, per model family and method.

    encoder (MiniLM, BERT)    gradient  in-batch next-line contrastive loss (cross-entropy
                                        of 20 * cos over the batch's next lines; padding
                                        excluded; rows normalised per layer)
                              ablation  1 - cos to the unpruned embeddings of the pairs'
                                        first lines (``tools.distill``, "cosine")
                              gates     the same distillation objective, gates trained
                                        on it (``tools.gate_importance``)
    GPT                       gradient  next-token cross-entropy (rows normalised per layer)
                              ablation  next-token cross-entropy
                              gates     KL to the unpruned model's next-token distribution

Gates: ``GateTraining(penalties, steps=GATE_STEPS, lr=GATE_LR)``, default
penalties ``GATE_PENALTIES[family]``: one training per penalty, the score
of a head its P(open) averaged over them. The default penalties were chosen
on the pretrained MiniLM and the default mini GPT run to span few to most
heads closed (docs/surgery.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tools.distill import distillation
from ..tools.gate_importance import GateTraining
from ..tools.importance import head_importance

__all__ = ["METHODS", "GATE_PENALTIES", "GATE_STEPS", "GATE_LR", "encoder_scores", "gpt_scores", "lm_loss",
           "embed", "logits", "gate_training"]  # fmt: skip

METHODS = ("gradient", "ablation", "gates")
GATE_PENALTIES = {"encoder": (0.01, 0.03, 0.1), "gpt": (0.1, 0.3, 1.0)}
GATE_STEPS = GateTraining.steps
GATE_LR = GateTraining.lr
BATCH_SIZE = 64
SCALE = 20.0  # 1 / temperature of the contrastive loss


def embed(model, tok) -> torch.Tensor:
    """Sentence embeddings [B, C] of tokenized lines."""
    return model(tok.input_ids, tok.attention_mask, tok.token_type_ids)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token logits [B, T-1, V] of windows x [B, T] (the last token predicts nothing here)."""
    return model(x[:, :-1])


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows x [B, T]."""
    out = logits(model, x)  # (B, T-1, V)
    return F.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())


def _contrastive(model, batch) -> torch.Tensor:
    """In-batch next-line loss: anchor i must pick its own next line; batch = (tokens [2B, T], B)."""
    tok, B = batch
    emb = embed(model, tok)  # (2B, C), unit norm
    out = SCALE * emb[:B] @ emb[B:].T  # (B, B): 20 * cos
    return F.cross_entropy(out, torch.arange(B, device=out.device))


def anchor_batches(model, pairs: list[tuple[str, str]]) -> list:
    """The pairs' first lines, tokenized in batches of ``BATCH_SIZE``."""
    return [model.tokenize([a for a, _ in pairs[i : i + BATCH_SIZE]]) for i in range(0, len(pairs), BATCH_SIZE)]


def encoder_scores(model, method: str, pairs: list[tuple[str, str]], gates: GateTraining | None = None) -> torch.Tensor:
    """[L, H] scores of an encoder's heads on calibration (line, next line) pairs
    (``gates``: "gates" only, default ``gate_training("encoder")``)."""
    if method == "gradient":
        chunks = [pairs[i : i + BATCH_SIZE] for i in range(0, len(pairs), BATCH_SIZE)]
        batches = [(model.tokenize([a for a, _ in c] + [b for _, b in c]), len(c)) for c in chunks]
        return head_importance(model, batches, _contrastive, method="gradient", progress=True,
                               token_mask=lambda b: b[0].attention_mask.bool())  # fmt: skip
    targets, drift = distillation(model, anchor_batches(model, pairs), embed, objective="cosine")
    return _scores(model, method, targets, drift, gates, "encoder")


def gpt_scores(model, method: str, batches: list[torch.Tensor], gates: GateTraining | None = None) -> torch.Tensor:
    """[L, H] scores of a GPT's heads on calibration windows [B, T] (``gates``:
    "gates" only, default ``gate_training("gpt")``)."""
    if method != "gates":
        normalize = "layer" if method == "gradient" else None
        return head_importance(model, batches, lm_loss, method=method, normalize=normalize, progress=True)
    targets, kl = distillation(model, batches, logits, objective="kl")
    return _scores(model, method, targets, kl, gates, "gpt")


def _scores(model, method: str, batches: list, loss_fn, gates: GateTraining | None, family: str) -> torch.Tensor:
    if method == "ablation":
        return head_importance(model, batches, loss_fn, method="ablation", normalize=None, progress=True)
    training = gate_training(family) if gates is None else gates
    return head_importance(model, batches, loss_fn, method="gates", gate_training=training, progress=True)


def gate_training(family: str, penalties: tuple[float, ...] | None = None, steps: int | None = None) -> GateTraining:
    """The gate training of ``prune --method gates`` for "encoder" or "gpt" (None: the default)."""
    return GateTraining(penalties=GATE_PENALTIES[family] if penalties is None else penalties,
                        steps=GATE_STEPS if steps is None else steps, lr=GATE_LR)  # fmt: skip
