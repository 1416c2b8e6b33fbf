"""Head importance from learned hard-concrete gates (Voita, Talbot, Moiseev,
Sennrich and Titov, "Analyzing Multi-Head Self-Attention: Specialized Heads
Do the Heavy Lifting, the Rest Can Be Pruned", ACL 2019).

    pairs, loss_fn = distillation(model, batches, outputs)        # keep the model's own outputs
    sweep = gate_sweep(model, pairs, loss_fn, GateTraining(penalties=(0.01, 0.03, 0.1)))
    sweep.open_probability      # [P, L, H]: P(gate open) after training at each penalty
    sweep.closing_order()       # [(layer, head), ...]: the first to close first
    head_importance(model, pairs, loss_fn, method="gates")        # [L, H] = sweep.scores

Every head h of every attention layer l gets a gate g[l, h] in [0, 1] that
multiplies its context (out [B, H, T, Dv], before the heads are merged),
put there by a head hook, so any kind that runs head hooks can be gated
(``modules.hard_concrete``: one draw of u per head per call, shared by the
batch, as the official code; temperature 0.33, stretch (-0.1, 1.1)). For
each penalty lambda the gates' log-parameters log_alpha [L, H] alone are
trained, from ``init`` for every lambda, with Adam for ``steps`` steps
(batches cycled) on

    loss = loss_fn(model, batch) + lambda * mean over layers of sum_h P(g[l, h] != 0)

the paper's objective (its concrete_coef is lambda; the official scripts use
0.1). The model runs in eval mode (no dropout) and its parameters are
neither trained nor given ``.grad``. After training, each penalty records
P(open) [L, H], the eval-mode gates (0: the head is closed and can be
removed) and ``loss_fn`` averaged over all batches with the eval gates on.

The score of a head is its P(open) averaged over the penalties: with one
penalty, its P(open) itself; over a sweep of increasing penalties, a head
that closes at a small penalty scores low, so sorting by score gives the
order in which the heads close.

Differences from the official code (lena-voita/the-story-of-heads,
``ConcreteGate``, ``MultiHeadAttnConcrete``, ``ConcreteProblem``):

* Only the gates are trained; the official runs fine-tune the whole
  translation model together with its gates. Here the model stays as it is,
  so the scores rank its heads as they are (prune, then retrain if wanted).
* The data term is ``loss_fn``: ``tools.distill.distillation`` makes it the
  divergence from the model's own outputs (the objective is to keep what the
  model computes); the official problem is the task's label-smoothed
  cross-entropy, which a ``loss_fn`` may equally be.
* log_alpha starts at ``init`` = 3.0 (eval gate 1, P(open) 0.98: the model
  starts unchanged); the official gates start Glorot-uniform around 0
  (eval gate 0.5), harmless there because the whole model trains.
* Adam with a constant learning rate; the official runs use lazy Adam with
  the Noam schedule over all parameters.
* Gates act on the contexts after the attention (as the official code: after
  probability dropout, before the output projection); gates the model already
  has ("gated" kind) stay and these multiply on top.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..modules import hard_concrete
from ..modules.base import AttentionLayer
from .fidelity import pruning_order
from .heads import eval_mode
from .scoring import check_all_ran, check_scalar_loss, score_table, scored_inputs

__all__ = ["GateTraining", "GateSweep", "gate_sweep"]


@dataclass(frozen=True)
class GateTraining:
    """How the gates are trained (see the module docstring).

    Attributes:
        penalties: the L0 penalty coefficients lambda, one training each.
        steps: Adam steps per penalty (batches cycled in order).
        lr: Adam's learning rate on log_alpha.
        init: log_alpha at the start of every training.
        seed: seeds the gates' noise (a private generator; torch's global
            generator is not used).
    """

    penalties: Sequence[float] = (0.1,)
    steps: int = 150
    lr: float = 0.1
    init: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        penalties = self.penalties
        if isinstance(penalties, numbers.Real) and not isinstance(penalties, bool):
            penalties = (penalties,)
        if isinstance(penalties, (str, bytes)) or not isinstance(penalties, Sequence) or not penalties:
            raise ValueError(f"penalties must be a non-empty sequence of floats >= 0, got penalties={self.penalties!r}")
        for p in penalties:
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(p) or p < 0:
                raise ValueError(f"every penalty must be a finite float >= 0, got penalties={self.penalties!r}")
        object.__setattr__(self, "penalties", tuple(float(p) for p in penalties))
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got steps={self.steps!r}")
        for name in ("lr", "init"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite float, got {name}={value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got lr={self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got seed={self.seed!r}")


@dataclass(frozen=True)
class GateSweep:
    """The trained gates, one row per penalty.

    Attributes:
        penalties: (P,) the penalties, as given.
        open_probability: [P, L, H] float64, P(gate open) after training.
        gates: [P, L, H] float64, the eval-mode gates (0 = closed).
        loss: (P,) ``loss_fn`` averaged over the batches with the eval gates on.
    """

    penalties: tuple[float, ...]
    open_probability: torch.Tensor
    gates: torch.Tensor
    loss: tuple[float, ...]

    @property
    def scores(self) -> torch.Tensor:
        """[L, H] float64: P(open) averaged over the penalties (low: closes early)."""
        return self.open_probability.mean(dim=0)

    def closed(self, index: int = -1) -> dict[int, list[int]]:
        """{layer: [heads]} whose eval gate is 0 after training at ``penalties[index]``."""
        closed = self.gates[index] == 0
        return {i: [h for h in range(closed.shape[1]) if closed[i, h]] for i in range(closed.shape[0]) if closed[i].any()}

    def closing_order(self) -> list[tuple[int, int]]:
        """Every (layer, head), lowest score first (ties in layer-major order)."""
        return pruning_order(self.scores)


def gate_sweep(
    model: nn.Module,
    batches: Sequence,
    loss_fn: Callable,
    training: GateTraining | None = None,
    *,
    step: Callable[[], None] = lambda: None,
) -> GateSweep:
    """Train hard-concrete gates on every head, once per penalty.

    Args:
        model: a module containing multihead attention layers (heads: the
            query heads; layers may have different counts, the tables are
            then [., L, Hmax] with NaN past a layer's last head).
        batches: a non-empty sequence of batches ``loss_fn`` accepts (e.g. the
            pairs of ``tools.distill.distillation``).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, the data term.
        training: :class:`GateTraining` (default: its defaults).
        step: called once per training step and per evaluation pass (a
            progress bar's update).

    Returns:
        a :class:`GateSweep`.

    Raises:
        ValueError: no batches; a loss
            that is not a scalar or has no gradient path to the heads.
    """
    training = GateTraining() if training is None else training
    layers, batches = scored_inputs(model, batches)
    missing = score_table(layers)  # [L, Hmax]: 0 where a head exists, NaN past a layer's last head
    probs, gates, losses = [], [], []
    generator = torch.Generator().manual_seed(training.seed)
    with eval_mode(model):
        for penalty in training.penalties:
            log_alpha = _train(model, layers, batches, loss_fn, penalty, training, generator, step)
            shut = hard_concrete.eval_gates(log_alpha)  # [L, Hmax]
            losses.append(_mean_loss(model, layers, batches, loss_fn, shut))
            step()
            probs.append(hard_concrete.open_probabilities(log_alpha).double() + missing)  # NaN past a layer's heads
            gates.append(shut.double() + missing)
    return GateSweep(training.penalties, torch.stack(probs), torch.stack(gates), tuple(losses))


def _train(model, layers, batches, loss_fn, penalty: float, training: GateTraining, generator, step) -> torch.Tensor:
    """log_alpha [L, Hmax] (detached) after ``training.steps`` Adam steps at this penalty."""
    exists = ~score_table(layers).isnan()  # [L, Hmax]: True where layer i has head h
    log_alpha = torch.full(exists.shape, float(training.init), dtype=torch.float32, requires_grad=True)
    optimizer = torch.optim.Adam([log_alpha], lr=training.lr)
    counts = [layer.num_heads for layer in layers]

    def sampled(i: int) -> torch.Tensor:
        return hard_concrete.sample_gates(log_alpha[i, : counts[i]], generator=generator)

    for k in range(training.steps):
        with _gated(layers, sampled) as calls:
            data = check_scalar_loss(loss_fn(model, batches[k % len(batches)]))
        check_all_ran(layers, calls)
        if not data.requires_grad:
            raise ValueError(
                "the loss has no gradient path to the attention heads (was it computed under "
                "torch.no_grad() or detached?)"
            )
        open_heads = (hard_concrete.open_probabilities(log_alpha) * exists).sum(dim=1)  # (L,): sum_h P(open)
        (grad,) = torch.autograd.grad(data.float() + penalty * open_heads.mean(), [log_alpha])
        log_alpha.grad = grad  # only the gates get a gradient; the model's parameters get none
        optimizer.step()
        step()
    return log_alpha.detach()


@torch.no_grad()
def _mean_loss(model, layers, batches, loss_fn, gates: torch.Tensor) -> float:
    """loss_fn averaged over the batches with the heads multiplied by ``gates`` [L, H]."""
    total = 0.0
    with _gated(layers, lambda i: gates[i, : layers[i].num_heads]):
        for batch in batches:
            total += float(check_scalar_loss(loss_fn(model, batch)).double())
    return total / len(batches)


class _gated:
    """Context manager: every call of layer i multiplies its heads by ``gate_of(i)`` [H]."""

    def __init__(self, layers: list[AttentionLayer], gate_of: Callable[[int], torch.Tensor]) -> None:
        self.layers, self.gate_of, self.handles = layers, gate_of, []
        self.calls = [0] * len(layers)

    def _hook(self, i: int):
        def hook(layer: AttentionLayer, out: torch.Tensor) -> torch.Tensor:
            self.calls[i] += 1
            g = self.gate_of(i).to(device=out.device, dtype=out.dtype)
            return out * g[:, None, None]  # (H,) -> (H, 1, 1), broadcast over out (B, H, T, Dv)

        return hook

    def __enter__(self) -> list[int]:
        self.handles = [layer.register_head_hook(self._hook(i)) for i, layer in enumerate(self.layers)]
        return self.calls  # calls per layer, counted while inside

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
