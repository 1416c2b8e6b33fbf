"""Stopping a training run whose loss is no longer a number.

After each optimizer step the loop checks the step's training loss and
gradient norm, and at each evaluation the validation loss::

    step n done -> train_loss, grad_norm finite?   (both reduced over ranks)
    evaluation  -> val_loss finite?                (reduced over ranks)
    not finite  -> raise LossDiverged(step n) before anything of step n is written

Every value checked is already the same on every rank (``World.mean`` and
the all-reduces of the validation loss and of the gradient norm), so every
process of a torchrun launch raises after the same step and none waits in a
collective. Nothing of the diverged step is written: no metrics line and no
checkpoint of its weights (NaN after the optimizer step), so the run
directory's latest checkpoint stays the last good one. ``multihead train``
prints the exception as one line and exits with ``EXIT_STATUS``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..io import write_text_atomic

__all__ = ["LossDiverged", "check_finite", "write_outcome", "clear_outcome", "read_outcome", "EXIT_STATUS", "OUTCOME"]

EXIT_STATUS = 3
OUTCOME = "diverged.json"  # {"step", "which", "value", "lr"}: written by ``write_outcome``


class LossDiverged(Exception):
    """A loss (or the gradient norm) that is NaN or infinite after step ``step``.

    Attributes:
        which: "training loss", "gradient norm" or "validation loss".
        step: the step (counted from 1) whose value was not finite.
        value: that value.
        lr: the learning rate of that step.
        run_dir: the run directory (its checkpoints are those before the step).
    """

    exit_status = EXIT_STATUS

    def __init__(self, which: str, step: int, value: float, lr: float, run_dir: Path) -> None:
        from ..models.run_dirs import latest_checkpoint

        self.which, self.step, self.value, self.lr, self.run_dir = which, step, value, lr, Path(run_dir)
        latest = latest_checkpoint(self.run_dir)
        kept = f"{latest} is the last good checkpoint" if latest is not None else "no checkpoint was written"
        super().__init__(
            f"the {which} is {value} at step {step}: training diverged and stopped; nothing of step {step} "
            f"was written, {kept}; lower --lr (it was {lr:.3g} at that step) or raise --warmup"
        )


def check_finite(which: str, value: float, *, step: int, lr: float, run_dir: Path) -> None:
    """Raise :class:`LossDiverged` when ``value`` is NaN or infinite."""
    if not math.isfinite(value):
        raise LossDiverged(which, step, value, lr, run_dir)


def write_outcome(error: LossDiverged) -> Path:
    """Record the divergence in ``error.run_dir / OUTCOME`` (strict JSON: the value as text)."""
    record = {"step": error.step, "which": error.which, "value": str(error.value), "lr": error.lr}
    return write_text_atomic(error.run_dir / OUTCOME, json.dumps(record) + "\n")


def clear_outcome(run_dir: Path) -> None:
    """Remove an earlier call's record (a run that trains again has no divergence yet)."""
    (Path(run_dir) / OUTCOME).unlink(missing_ok=True)


def read_outcome(run_dir: Path) -> dict | None:
    """The record ``write_outcome`` left in ``run_dir``, else None."""
    path = Path(run_dir) / OUTCOME
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
