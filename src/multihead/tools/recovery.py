"""Recovery training after head surgery: distil a converted or pruned model
(the student) towards the original (the teacher).

    losses = recover(student, teacher, batches, outputs, steps=200, lr=1e-4)   # GPT, "kl"
    losses = recover(gqa, minilm, sentence_batches, embed, steps=40, objective="cosine")

``outputs(model, batch)`` returns what is matched, for the student (with
gradients) and for the teacher (under no_grad, in eval mode):

    objective   outputs                      loss of one step
    "kl"        logits [..., V] (GPT [B, T, V])  KL(p_teacher || p_student) summed over V,
                                             mean over every other position
    "cosine"    embeddings [..., C] ([N, C])  mean over rows of 1 - cos(student, teacher)
    "mse"       any shape                     mean squared difference over all elements

One step, s = 0 .. steps - 1, on batch ``batches[s % len(batches)]``::

    lr = learning_rate(s, ...)                  the training loop's warm-up + cosine
    loss = objective(outputs(student, batch), outputs(teacher, batch))
    loss.backward(); clip_grad_norm_(grad_clip); AdamW step; zero grads

The optimizer is the training loop's (``multihead.train.loop``): AdamW with
betas (0.9, 0.95) over ``parameter_groups`` (decay on the 2-D+ weights of
linear layers only), and the learning rate follows
``multihead.train.config.learning_rate``: a linear warm-up over ``warmup``
steps to ``lr``, then a cosine down to ``min_lr`` at the last step.

The student trains in train mode (its own dropout applies) and is left in
eval mode; the teacher runs in eval mode and gets back every submodule's own
mode afterwards; its parameters are never written (not even ``.grad``).
Random numbers (dropout) come from ``seed`` inside ``torch.random.fork_rng``,
so the caller's generator state is unchanged and two calls with the same
arguments compute the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..progress import progress_bar
from ..train.config import TrainConfig, learning_rate
from ..train.loop import parameter_groups
from .distill import OBJECTIVES, check_objective, divergence
from .heads import eval_mode

__all__ = ["recover", "OBJECTIVES"]

_BETAS = (0.9, 0.95)  # the training loop's defaults (TrainConfig.beta1, beta2)
_ADAM_EPS = 1e-8


def recover(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable,
    outputs: Callable[[nn.Module, object], torch.Tensor],
    *,
    steps: int,
    lr: float = 1e-4,
    objective: str = "kl",
    weight_decay: float = 0.0,
    warmup: int | None = None,
    min_lr: float | None = None,
    grad_clip: float = 1.0,
    params: Iterable[nn.Parameter] | None = None,
    progress: bool = True,
    seed: int = 0,
) -> list[float]:
    """Train ``student`` for ``steps`` AdamW steps to reproduce ``teacher``'s outputs.

    Args:
        student: the model to train, in place (a GPT, encoder, any module).
        teacher: the reference model; only read.
        batches: the training batches, anything ``outputs`` accepts (token
            ids [B, T], lists of sentences, tuples); held in a list and
            cycled when ``steps`` exceeds their number.
        outputs: ``outputs(model, batch) -> Tensor``, the quantity matched:
            logits [..., V] for "kl", embeddings [..., C] for "cosine", any
            floating tensor for "mse"; student and teacher must give the
            same shape.
        steps: optimizer steps (>= 1).
        lr: peak learning rate (> 0).
        objective: "kl", "cosine" or "mse" (see the module docstring).
        weight_decay: AdamW's decoupled decay on the 2-D+ weights of linear
            layers (``parameter_groups``); 0 by default.
        warmup: steps of linear warm-up (< steps); None: steps // 10.
        min_lr: learning rate at the last step (<= lr); None: lr / 10.
        grad_clip: maximum global gradient norm; 0 turns clipping off.
        params: train only these parameters of the student (the rest keep
            their values and get no gradient); None: every parameter that
            requires a gradient.
        progress: show a bar (tqdm, else rich) on stderr with the loss.
        seed: the seed of the random numbers the student's dropout draws.

    Returns:
        the loss of every step before its update (``steps`` floats; for
        "kl" in nats per position).

    Raises:
        TypeError: student or teacher not a module, outputs not callable,
            an output that is not a floating tensor, ``params`` holding
            something that is not a parameter of the student.
        ValueError: steps < 1, lr <= 0, an unknown objective, no batches,
            warmup outside [0, steps), min_lr outside [0, lr], a negative
            weight_decay or grad_clip, student and teacher outputs of
            different shapes, or "kl"/"cosine" outputs without a last
            dimension; each message names the values.
    """
    _check_arguments(student, teacher, outputs, steps, lr, objective, weight_decay, grad_clip)
    batches = list(batches)
    if not batches:
        raise ValueError("recover needs at least one batch, got an empty batches")
    warmup = steps // 10 if warmup is None else warmup
    min_lr = lr / 10 if min_lr is None else min_lr
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
        raise ValueError(f"warmup must be an int in [0, steps), got warmup={warmup!r} with steps={steps}")
    if not isinstance(min_lr, (int, float)) or not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr must be in [0, lr], got min_lr={min_lr!r} with lr={lr}")
    schedule = TrainConfig(max_steps=steps, lr=lr, min_lr=min_lr, warmup=warmup)  # learning_rate reads these four
    groups = _groups(student, weight_decay, params)
    trained = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS, eps=_ADAM_EPS)
    losses: list[float] = []
    devices = [student_device] if (student_device := _device(student)).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), eval_mode(teacher), progress_bar(steps, progress, "recovery") as show:
        torch.manual_seed(seed)
        student.train()
        try:
            for step in range(steps):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step, schedule)
                batch = batches[step % len(batches)]
                with torch.no_grad():
                    want = _output(outputs, teacher, batch, "teacher")
                got = _output(outputs, student, batch, "student")
                if got.shape != want.shape:
                    raise ValueError(
                        f"student and teacher outputs differ in shape: student {tuple(got.shape)}, "
                        f"teacher {tuple(want.shape)} (batch {step % len(batches)})"
                    )
                loss = divergence(got, want, objective)
                optimizer.zero_grad(set_to_none=True)
                loss.backward(inputs=trained)
                if grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(trained, grad_clip)
                optimizer.step()
                losses.append(float(loss.detach()))
                show(f"{objective} {losses[-1]:.4f}")
        finally:
            optimizer.zero_grad(set_to_none=True)
            student.eval()
    return losses


# ---------------------------------------------------------------- pieces
def _check_arguments(student, teacher, outputs, steps, lr, objective, weight_decay, grad_clip) -> None:
    for name, model in (("student", student), ("teacher", teacher)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(outputs):
        raise TypeError(f"outputs must be a callable outputs(model, batch) -> Tensor, got {type(outputs).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got steps={steps!r}")
    for name, value, zero_ok in (
        ("lr", lr, False),
        ("weight_decay", weight_decay, True),
        ("grad_clip", grad_clip, True),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {name}={value!r} ({type(value).__name__})")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{name} must be a finite float {'>= 0' if zero_ok else '> 0'}, got {name}={value!r}")
    check_objective(objective)
    shared = {id(p) for p in teacher.parameters()} & {id(p) for p in student.parameters()}
    if shared:
        raise ValueError(
            f"student and teacher share {len(shared)} parameter tensor(s): training the student would change "
            "the teacher; give the student its own copy (to_gqa and copy.deepcopy do)"
        )


def _groups(student: nn.Module, weight_decay: float, params) -> list[dict]:
    """The training loop's AdamW groups, restricted to ``params`` when given."""
    groups = parameter_groups(student, weight_decay)
    if params is None:
        return groups
    chosen = list(params)
    own = {id(p) for g in groups for p in g["params"]}
    for i, p in enumerate(chosen):
        if not isinstance(p, nn.Parameter) or id(p) not in own:
            raise TypeError(
                f"params[{i}] is not a trainable parameter of the student "
                f"({type(p).__name__}{' of shape ' + str(tuple(p.shape)) if isinstance(p, torch.Tensor) else ''})"
            )
    if not chosen:
        raise ValueError("params is empty: nothing to train")
    keep = {id(p) for p in chosen}
    return [{**g, "params": [p for p in g["params"] if id(p) in keep]} for g in groups]


def _output(outputs, model: nn.Module, batch, name: str) -> torch.Tensor:
    out = outputs(model, batch)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        kind = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"outputs({name}, batch) must return a floating tensor, got {kind}")
    if out.dim() == 0:
        raise ValueError(f"outputs({name}, batch) must have a last dimension to compare over, got a 0-d tensor")
    return out


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
