"""``--checkpoint RUN_DIR``: the latest checkpoint and tokenizer of a ``multihead train`` run.

``generate`` and ``inspect`` accept the run directory itself::

    runs/tiny/                       --checkpoint runs/tiny
      checkpoints/latest        ->   names step-000200
      checkpoints/step-000200/       model.safetensors: the weights loaded
      tokenizer/                     the run's own tokenizer (bytes or BPE)

Any other path is left to ``multihead.models.checkpoint.load_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_checkpoint"]


def run_checkpoint(path: str) -> tuple[Path, object, int] | None:
    """The latest checkpoint and tokenizer of a ``multihead train`` run directory.

    Args:
        path: the value of ``--checkpoint``.

    Returns:
        (step directory holding model.safetensors, the run's tokenizer, step),
        or None when ``path`` is not a run directory (no ``checkpoints/`` or
        ``tokenizer/`` folder in it).

    Raises:
        ValueError: a run with no complete checkpoint yet, a broken
            ``checkpoints/latest`` pointer, or a missing or unreadable tokenizer.
    """
    run_dir = Path(path)
    if not ((run_dir / "checkpoints").is_dir() or (run_dir / "tokenizer").is_dir()):
        return None
    from ..train.checkpoint import latest_checkpoint
    from ..train.tokenizer import load_tokenizer_dir

    step_dir = latest_checkpoint(run_dir)
    if step_dir is None:
        raise ValueError(
            f"--checkpoint {path}: a training run with no complete checkpoint yet "
            f"({run_dir / 'checkpoints' / 'latest'} does not exist)"
        )
    if not (run_dir / "tokenizer").is_dir():
        raise ValueError(f"--checkpoint {path}: the run has no tokenizer/ folder to encode the prompt with")
    try:
        tokenizer = load_tokenizer_dir(run_dir / "tokenizer")
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"--checkpoint {path}: cannot read its tokenizer/ ({e})") from None
    step = int(step_dir.name.rpartition("-")[2])  # step-000200 -> 200 (the name is checked by latest_checkpoint)
    return step_dir, tokenizer, step
