"""Distillation objectives: how far a model's outputs are from a teacher's.

    pairs, loss_fn = distillation(model, batches, lambda m, x: m(x))   # the teacher: model as it is now
    loss = loss_fn(changed_model, pairs[0])                            # 0 while nothing changed

``divergence(student, teacher, objective)`` compares two output tensors of
the same shape; the last dim is the one compared:

    "kl"      logits [..., V]: KL(softmax(teacher) || softmax(student)) summed
              over V, mean over the other dims (nats per row)
    "cosine"  vectors [..., C]: mean over rows of 1 - cos(student, teacher)
    "mse"     mean squared difference over all elements
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .heads import eval_mode

__all__ = ["divergence", "distillation", "OBJECTIVES"]

OBJECTIVES = ("kl", "cosine", "mse")


def check_objective(objective: object) -> str:
    """The objective, or a ValueError naming the valid ones."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective={objective!r}; valid: {list(OBJECTIVES)}")
    return objective


def divergence(student: torch.Tensor, teacher: torch.Tensor, objective: str = "kl") -> torch.Tensor:
    """A scalar: how far ``student`` is from ``teacher`` (same shape [..., V or C]).

    Computed in at least float32; the gradient flows to ``student`` only.

    Raises:
        TypeError: outputs that are not floating-point tensors.
        ValueError: different shapes, an unknown objective.
    """
    check_objective(objective)
    for name, t in (("student", student), ("teacher", teacher)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"the {name} output must be a floating-point tensor, got {got}")
    if student.shape != teacher.shape:
        raise ValueError(f"student output shape {tuple(student.shape)} != teacher output shape {tuple(teacher.shape)}")
    dtype = torch.promote_types(student.dtype, torch.float32)
    s, t = student.to(dtype), teacher.detach().to(dtype)
    if objective == "kl":
        rows_s = s.log_softmax(-1).reshape(-1, s.shape[-1])  # (..., V) -> (N, V)
        rows_t = t.log_softmax(-1).reshape(-1, t.shape[-1])
        return F.kl_div(rows_s, rows_t, log_target=True, reduction="batchmean")
    if objective == "cosine":
        return (1 - F.cosine_similarity(s, t, dim=-1)).mean()
    return F.mse_loss(s, t)


def distillation(
    model: nn.Module,
    batches: Iterable,
    outputs: Callable,
    objective: str = "kl",
) -> tuple[list[tuple[object, torch.Tensor]], Callable]:
    """Pair every batch with ``model``'s output now, and a loss against it.

    Args:
        model: the teacher, as it is now (run in eval mode, without gradients;
            every submodule's mode restored after).
        batches: an iterable of batches (anything ``outputs`` accepts).
        outputs: ``outputs(model, batch) -> Tensor`` (logits, embeddings).
        objective: "kl", "cosine" or "mse" (see :func:`divergence`).

    Returns:
        ``(pairs, loss_fn)``: pairs = [(batch, teacher output)], and
        ``loss_fn(model, pair) = divergence(outputs(model, batch), teacher, objective)``,
        the form ``head_importance`` and training loops take.

    Raises:
        TypeError: ``outputs`` not callable.
        ValueError: no batches, an unknown objective.
    """
    check_objective(objective)
    if not callable(outputs):
        raise TypeError(f"outputs must be callable as outputs(model, batch), got {type(outputs).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: distillation needs at least one batch")
    with eval_mode(model), torch.no_grad():
        pairs = [(batch, outputs(model, batch).detach()) for batch in batches]

    def loss_fn(student: nn.Module, pair: tuple[object, torch.Tensor]) -> torch.Tensor:
        batch, target = pair
        return divergence(outputs(student, batch), target, objective)

    return pairs, loss_fn
