"""Head importance scores (Michel, Levy and Neubig, "Are Sixteen Heads Really
Better than One?", NeurIPS 2019): one number per (layer, head).

    scores = head_importance(model, batches, loss_fn)                 # [L, H] float64
    scores = head_importance(model, batches, loss_fn, method="ablation")
    scores = head_importance(model, pairs, keep_outputs, method="gates")   # tools.gate_importance

``loss_fn(model, batch)`` returns a scalar loss tensor for one batch (the
batch-mean cross-entropy of a classifier, a language-model loss, ...).

method="gradient" (the paper's proxy, as the official code computes it).
Head h of layer l has a context ctx_h [B, T, Dv] (attention weights times
values, before the heads are merged); for every batch

    dot[b, h, t] = < ctx_h[b, t, :], dL/dctx_h[b, t, :] >

    absolute="token"   (official code):  I[l, h] += sum_b sum_t |dot[b, h, t]|
    absolute="example" (paper's I_h = E_x |dL(x)/dxi_h|):
                                          I[l, h] += sum_b |sum_t dot[b, h, t]|

summed over the tokens ``token_mask(batch)`` [B, T] marks True (all tokens
when None), then divided by the number of counted tokens ("token") or of
examples ("example"). normalize="layer" divides each row by its L2 norm
plus 1e-20. The sum over t of dot is dL/dxi_h for a multiplicative gate xi_h
= 1 on the head's context, which is how the paper defines the score.

method="ablation": I[l, h] = mean over batches of the loss with head h of
layer l masked (``tools.heads.mask_heads``: its context is zero) minus the
mean loss of the full model; L * H + 1 passes over the batches, without
gradients. Positive: the loss rises without the head. ``absolute`` and
``token_mask`` do not apply (the loss says which tokens count).

method="gates" (Voita et al., ACL 2019): hard-concrete gates on every head
trained with an L0 penalty on ``loss_fn`` (the model itself unchanged); the
score is each gate's probability of being open, averaged over a sweep of
penalties (``gate_training``); see ``tools.gate_importance``, and
``tools.distill.distillation`` for a loss that keeps the model's own outputs.
``normalize`` does not apply (probabilities are comparable across layers).

All methods run the model in eval mode (no dropout) and restore every
submodule's own mode afterwards. Layers are numbered as in
``tools.heads.attention_layers`` (model order); heads are the query heads
(GQA/MQA). Layers may have different head counts (a pruned model): the
table is [L, Hmax] and holds NaN past each layer's last head.

Differences from the official code (``calculate_head_importance`` in
pmichel31415/pytorch-pretrained-BERT, branch paul, and
``batch_head_importance`` / ``estimate_head_importance`` in
pmichel31415/fairseq ``prune.py``):

* Divisors. The BERT fork divides rows 0 .. L-2 by the number of real
  tokens and the last row by the number of examples requested
  (``subset_size``); here every row is divided by its own count of the
  tokens it summed (fairseq's rule). With normalize="layer" (the default,
  as in the fork's function) the row divisors cancel up to the 1e-20 term.
* Padding. The fork sums |dot| over all T positions, padding included, and
  counts only real tokens; fairseq masks padding in the sum and the count.
  Here ``token_mask`` does what fairseq does; without it every position is
  summed and counted. Padded positions have zero gradient in a BERT
  classifier in practice, so with a token_mask the fork's rows 0 .. L-2 are
  reproduced.
* The loss is whatever ``loss_fn`` returns; with a batch mean (as the
  fork) each example carries a factor 1 / (its batch size), so a smaller
  last batch weighs its examples more, as there.
* The batches are those given, all of them (no RandomSampler or
  ``subset_size``); they are held in a list, so a generator works.
* dL/dctx comes from ``torch.autograd.grad`` with respect to gates of ones
  [B, H, T, 1] multiplied onto each context (x * 1 is exact, so the forward
  is unchanged); dL/dgate[b, h, t] is the dot product above. The model's
  ``.grad`` fields are never written (not zeroed either): nothing
  accumulates into the parameters.
* The accumulator is float64 (the fork's is float32 whatever the model).
* One (L, H) table for all attention layers in model order; fairseq keeps a
  table per attention type (encoder self, decoder self, encoder-decoder)
  and has a ``--one-minus`` option, not provided here. A layer called
  several times per loss (shared weights, a loop) adds every call's tokens.
* normalize="layer" adds 1e-20 to the norm, as the BERT fork (fairseq adds
  nothing).
* "ablation" is not in the official scoring code (its ablation scripts mask
  one head at a time and evaluate the task metric); it is offered here as
  the direct measure the gradient score approximates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..modules.base import AttentionLayer
from ..progress import progress_bar
from .gate_importance import GateTraining, gate_sweep
from .heads import eval_mode, mask_heads
from .scoring import check_all_ran, check_scalar_loss, score_table, scored_inputs

__all__ = ["head_importance", "METHODS", "NORMALIZATIONS", "ABSOLUTE_MODES"]

METHODS = ("gradient", "ablation", "gates")
NORMALIZATIONS = ("layer", None)
ABSOLUTE_MODES = ("token", "example")


def head_importance(
    model: nn.Module,
    batches: Iterable,
    loss_fn: Callable,
    *,
    method: str = "gradient",
    normalize: str | None = "layer",
    absolute: str = "token",
    token_mask: Callable | None = None,
    gate_training: GateTraining | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Score every head of every attention layer of ``model``.

    Args:
        model: a module containing multihead attention layers.
        batches: an iterable of batches (anything ``loss_fn`` accepts).
        loss_fn: ``loss_fn(model, batch) -> loss``, a scalar tensor.
        method: "gradient", "ablation" or "gates" (see the module docstring).
        normalize: "layer" (each row divided by its L2 norm + 1e-20) or None;
            "gradient" and "ablation" only ("gates" returns probabilities).
        absolute: "token" (|dot| per token, the official code) or "example"
            (|sum over tokens| per example, the paper); "gradient" only.
        token_mask: ``token_mask(batch) -> [B, T] bool``, True for the tokens
            that count (e.g. not padding); None counts every token.
            "gradient" only.
        gate_training: :class:`~multihead.tools.gate_importance.GateTraining`
            (penalties, steps, lr, init, seed); "gates" only, default
            ``GateTraining()``.
        progress: show a bar on stderr (tqdm, else rich) over the passes.

    Returns:
        [L, H] float64 scores on the CPU, L attention layers, H query heads
        (the most of any layer; NaN where a layer has fewer).

    Raises:
        TypeError: a model that is not a module, a loss that is not a tensor,
            a token_mask that is not a bool tensor.
        ValueError: an unknown method / normalize / absolute; a model without
            attention layers; no batches; a loss with more than one element or without a
            gradient path to the heads; a layer the loss never ran; a
            token_mask of the wrong shape or selecting no token; a
            token_mask with a method other than "gradient"; gate_training
            with a method other than "gates".
    """
    if method not in METHODS:
        raise ValueError(f"unknown method={method!r}; valid: {list(METHODS)}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"unknown normalize={normalize!r}; valid: {list(NORMALIZATIONS)}")
    if absolute not in ABSOLUTE_MODES:
        raise ValueError(f"unknown absolute={absolute!r}; valid: {list(ABSOLUTE_MODES)}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"token_mask must be callable as token_mask(batch), got {type(token_mask).__name__}")
    if method != "gradient" and token_mask is not None:
        raise ValueError(f"token_mask applies to method='gradient' only; with {method!r} the loss decides what counts")
    if gate_training is not None and method != "gates":
        raise ValueError(f"gate_training applies to method='gates' only, got method={method!r}")
    if gate_training is not None and not isinstance(gate_training, GateTraining):
        raise TypeError(f"gate_training must be a GateTraining, got {type(gate_training).__name__}")
    layers, batches = scored_inputs(model, batches)
    heads = sum(layer.num_heads for layer in layers)
    if method == "gates":
        training = GateTraining() if gate_training is None else gate_training
        with progress_bar(len(training.penalties) * (training.steps + 1), progress, "head importance", "pass") as step:
            return gate_sweep(model, batches, loss_fn, training, step=step).scores
    passes = len(batches) * (1 if method == "gradient" else heads + 1)
    with eval_mode(model), progress_bar(passes, progress, "head importance", "pass") as step:
        if method == "gradient":
            scores = _gradient(model, layers, batches, loss_fn, absolute, token_mask, step)
        else:
            scores = _ablation(model, layers, batches, loss_fn, step)
    if normalize == "layer":
        scores = scores / (scores.nan_to_num().norm(dim=1, keepdim=True) + 1e-20)
    return scores


# ---------------------------------------------------------------- gradient
def _gradient(model, layers, batches, loss_fn, absolute, token_mask, step) -> torch.Tensor:
    L = len(layers)
    total = score_table(layers)  # [L, Hmax]: 0, NaN past a layer's last head
    counted = torch.zeros(L, dtype=torch.float64)  # tokens ("token") or examples ("example") per layer
    for batch in batches:
        gates: list[list[torch.Tensor]] = [[] for _ in layers]
        handles = [layer.register_head_hook(_gate_hook(gates[i])) for i, layer in enumerate(layers)]
        try:
            with torch.enable_grad():
                loss = check_scalar_loss(loss_fn(model, batch))
        finally:
            for handle in handles:
                handle.remove()
        check_all_ran(layers, [len(g) for g in gates])
        flat = [g for calls in gates for g in calls]
        if not loss.requires_grad:
            raise ValueError(
                "the loss has no gradient path to the attention heads (was it computed under torch.no_grad() "
                "or detached?)"
            )
        grads = torch.autograd.grad(loss, flat, allow_unused=True)
        keep = None if token_mask is None else token_mask(batch)
        at = 0
        for i, calls in enumerate(gates):
            per_example = None
            for gate in calls:
                grad = grads[at]
                at += 1
                dot = torch.zeros(gate.shape[:3], dtype=torch.float64) if grad is None else grad[..., 0].double().cpu()
                B, _, T = dot.shape  # dot [B, H, T] = <ctx, dL/dctx> per token
                m = _mask(keep, B, T, i).to(torch.float64)[:, None, :]  # (B, T) -> (B, 1, T)
                if absolute == "token":
                    total[i, : dot.shape[1]] += (dot.abs() * m).sum(dim=(0, 2))
                    counted[i] += m.sum()
                else:
                    s = (dot * m).sum(dim=2)  # (B, H): dL/dxi_h per example, this call
                    per_example = s if per_example is None else per_example + s
            if per_example is not None:
                total[i, : per_example.shape[1]] += per_example.abs().sum(dim=0)
                counted[i] += per_example.shape[0]
        step()
    if bool((counted == 0).any()):
        empty = [i for i in range(L) if counted[i] == 0]
        raise ValueError(f"no token was counted for layers {empty}: token_mask selected nothing (or B = 0)")
    return total / counted[:, None]


def _gate_hook(store: list[torch.Tensor]):
    def hook(layer: AttentionLayer, out: torch.Tensor) -> torch.Tensor:
        B, H, T, _ = out.shape
        gate = torch.ones(B, H, T, 1, dtype=out.dtype, device=out.device, requires_grad=True)
        store.append(gate)
        return out * gate  # x * 1 == x exactly; dL/dgate[b, h, t] = <ctx, dL/dctx>

    return hook


def _mask(keep, B: int, T: int, layer: int) -> torch.Tensor:
    """token_mask's [B, T] bool on the CPU, or all True."""
    if keep is None:
        return torch.ones(B, T, dtype=torch.bool)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"token_mask must return a bool tensor [B, T], got {got}")
    if tuple(keep.shape) != (B, T):
        raise ValueError(
            f"token_mask returned shape {tuple(keep.shape)}, but layer {layer}'s heads have (B, T) = ({B}, {T})"
        )
    return keep.cpu()


# ---------------------------------------------------------------- ablation
@torch.no_grad()
def _ablation(model, layers, batches, loss_fn, step) -> torch.Tensor:
    L = len(layers)
    calls = [0] * L
    handles = [layer.register_head_hook(_counter(calls, i)) for i, layer in enumerate(layers)]
    try:
        base = _mean_loss(model, batches, loss_fn, step)
    finally:
        for handle in handles:
            handle.remove()
    check_all_ran(layers, calls)
    scores = score_table(layers)  # [L, Hmax]: 0, NaN past a layer's last head
    for i in range(L):
        for h in range(layers[i].num_heads):
            with mask_heads(model, {i: [h]}):
                scores[i, h] = _mean_loss(model, batches, loss_fn, step) - base
    return scores


def _counter(calls: list[int], i: int):
    def hook(layer: AttentionLayer, out: torch.Tensor) -> None:
        calls[i] += 1

    return hook


def _mean_loss(model, batches, loss_fn, step) -> float:
    total = 0.0
    for batch in batches:
        total += float(check_scalar_loss(loss_fn(model, batch)).detach().double())
        step()
    return total / len(batches)
