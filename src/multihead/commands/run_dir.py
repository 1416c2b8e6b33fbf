"""``--checkpoint RUN_DIR``: the latest checkpoint and tokenizer of a ``multihead train`` run.

``generate`` and ``inspect`` accept the run directory itself::

    runs/tiny/                       --checkpoint runs/tiny
      checkpoints/latest        ->   names step-000200
      checkpoints/step-000200/       model.safetensors: the weights loaded
      tokenizer/                     the run's own tokenizer (bytes or BPE)

A checkpoint folder that carries its tokenizer beside it (what ``multihead
convert`` and ``multihead prune`` write for a BPE run or a Hugging Face
GPT-2) is accepted too, with no ``--tokenizer``::

    runs/mini-pruned/                --checkpoint runs/mini-pruned
      config.json, model.safetensors the checkpoint loaded
      tokenizer.json                 its BPE tokenizer (step: None)

A sentence-encoder folder (config.json format "multihead.sentence_encoder",
what prune and convert write for MiniLM or a BERT) is not a GPT's: it is
left to the caller (``is_sentence_encoder`` below), as is any
other path (``multihead.models.checkpoint.load_checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_checkpoint", "is_sentence_encoder"]


def run_checkpoint(path: str) -> tuple[Path, object, int | None] | None:
    """The latest checkpoint and tokenizer of a ``multihead train`` run directory,
    or a checkpoint folder and the tokenizer.json beside it.

    Args:
        path: the value of ``--checkpoint``.

    Returns:
        (step directory holding model.safetensors, the run's tokenizer, step);
        (the folder, its tokenizer.json as a ``BPETokenizer``, None) for a
        checkpoint folder with config.json, model.safetensors and
        tokenizer.json; None for any other path.

    Raises:
        ValueError: a run with no complete checkpoint yet, a broken
            ``checkpoints/latest`` pointer, or a missing or unreadable
            tokenizer (a tokenizer.json that is not byte-level BPE included).
    """
    run_dir = Path(path)
    if not ((run_dir / "checkpoints").is_dir() or (run_dir / "tokenizer").is_dir()):
        return _saved_checkpoint(path)
    from ..models.run_dirs import latest_checkpoint
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


def _saved_checkpoint(path: str) -> tuple[Path, object, None] | None:
    """(folder, BPETokenizer, None) for a checkpoint folder with its tokenizer.json; else None."""
    folder = Path(path)
    if not all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return None
    if is_sentence_encoder(path):  # its WordPiece tokenizer.json belongs to a BERT: not a GPT's
        return None
    from tokenizers import Tokenizer

    from ..train.tokenizer import BPETokenizer

    file = folder / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--checkpoint {path}: {file} is not a readable tokenizer.json ({reason})") from None
    if type(tokenizer.model).__name__ != "BPE":
        raise ValueError(f"--checkpoint {path}: {file} is a {type(tokenizer.model).__name__} tokenizer, not BPE")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return folder, BPETokenizer(tokenizer), None


def is_sentence_encoder(path: str) -> bool:
    """Whether ``path`` is a folder written by ``save_sentence_encoder`` (its config.json's format)."""
    from ..models.saved import saved_kind

    if not (Path(path) / "config.json").is_file():
        return False
    try:
        return saved_kind(path) == "sentence_encoder"
    except (OSError, ValueError):
        return False
