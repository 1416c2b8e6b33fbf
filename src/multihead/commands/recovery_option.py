"""``--recover-steps N`` of ``multihead convert`` and ``multihead prune``: a short
distillation of the changed model towards the original (``tools.recovery.recover``).

    family    batches                             matched                        objective  peak lr
    GPT       the calibration windows [B, T]      next-token logits [B, T-1, V]  "kl"       RECOVER_LR["gpt"]
    encoder   the calibration pairs' first lines  sentence embeddings [B, C]     "cosine"   RECOVER_LR["encoder"]

AdamW with the training loop's parameter groups, linear warm-up over a
tenth of the steps then cosine to a tenth of the peak (``recover``'s
defaults), batches cycled. The learning rates were chosen on the default
mini GPT run and the pretrained MiniLM (docs/surgery.md).
"""

from __future__ import annotations

from torch import nn

from ..tools.objectives import embed, next_token_logits

__all__ = ["RECOVER_LR", "add_recover_steps", "check_recover_steps", "recover_model", "describe"]

RECOVER_LR = {"gpt": 1e-3, "encoder": 3e-4}


def add_recover_steps(parser) -> None:
    """Add ``--recover-steps N`` (default 0) to an ``argparse.ArgumentParser``."""
    parser.add_argument(
        "--recover-steps", type=int, default=0, metavar="N",
        help="then distil the result towards the original for N steps on the calibration data (default 0: none)",
    )  # fmt: skip


def check_recover_steps(steps: object) -> int:
    """``--recover-steps``: an int >= 0 (0: no recovery)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"--recover-steps {steps}: give a number of steps >= 0 (0: no recovery training)")
    return steps


def recover_model(student: nn.Module, teacher: nn.Module, batches: list, family: str, steps: int) -> dict:
    """Distil ``student`` towards ``teacher`` in place (left in eval mode); the report's "recovery" entry."""
    from ..tools.recovery import recover

    outputs, objective = (next_token_logits, "kl") if family == "gpt" else (embed, "cosine")
    lr = RECOVER_LR[family]
    losses = recover(student, teacher, batches, outputs, steps=steps, lr=lr, objective=objective, progress=True)
    student.eval()
    return {"steps": steps, "lr": lr, "objective": objective, "batches": len(batches),
            "loss": [losses[0], losses[-1]]}  # fmt: skip


def describe(recovery: dict) -> str:
    """One report line: the recovery run and what was measured before it."""
    first, last = recovery["loss"]
    line = (f"  recovery: {recovery['steps']} steps of {recovery['objective']} distillation (peak lr "
            f"{recovery['lr']:g}, {recovery['batches']} calibration batches), loss {first:.4g} -> {last:.4g}")
    before = recovery.get("before")
    if isinstance(before, dict):
        line += f"; before it: mean cosine {before['mean_cosine']:.4f}, top-10 kept {before['neighbours_top10']:.3f}"
    elif before is not None:
        line += f"; before it: val loss {before:.4f}"
    return line
