"""``multihead generate``: sample text from a GPT preset or a saved checkpoint.

A preset builds a freshly initialised model (seeded, so the same seed gives
the same model); ``--checkpoint`` loads one written by
``multihead.models.checkpoint.save_checkpoint`` (or by ``--save-init``).
Byte-level models (vocab_size 256) read the prompt as UTF-8 bytes; other
vocabularies need ``--tokenizer tokenizer.json`` (Hugging Face ``tokenizers``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["run", "encode_prompt", "decode_tokens", "DEFAULT_PRESET", "DEFAULT_PROMPT"]

DEFAULT_PRESET = "tiny"
DEFAULT_PROMPT = "Hello"
BYTE_VOCAB = 256


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise ValueError(f"--tokenizer {path}: no such file (expected a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        raise ValueError(f"--tokenizer {path}: not a readable tokenizer.json: {e}") from e


def encode_prompt(prompt: str, vocab_size: int, tokenizer=None) -> list[int]:
    """Token ids of ``prompt``: UTF-8 bytes for a 256-token vocabulary, else ``tokenizer``.

    Raises:
        ValueError: no tokenizer for a non-byte vocabulary, an empty
            encoding, or ids outside the model's vocabulary.
    """
    if tokenizer is not None:
        ids = tokenizer.encode(prompt).ids
    elif vocab_size == BYTE_VOCAB:
        ids = list(prompt.encode("utf-8"))
    else:
        raise ValueError(
            f"the model's vocab_size is {vocab_size}, not the byte-level {BYTE_VOCAB}: "
            "pass --tokenizer path/to/tokenizer.json (a Hugging Face tokenizers file) to encode the prompt"
        )
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty --prompt")
    if max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer produced id {max(ids)} >= the model's vocab_size {vocab_size}")
    return ids


def decode_tokens(ids: list[int], tokenizer=None) -> str:
    """Text of ``ids``: bytes decoded as UTF-8 with errors="replace", or ``tokenizer``."""
    if tokenizer is not None:
        return tokenizer.decode(ids)
    return bytes(ids).decode("utf-8", errors="replace")


def run(
    *,
    preset: str | None = None,
    checkpoint: str | None = None,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    tokenizer: str | None = None,
    save_init: str | None = None,
    echo: Callable[[str], None] = print,
    info: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> int:
    """Build or load a model, generate, and ``echo`` prompt + continuation.

    With ``save_init`` the freshly built preset model is saved there and
    nothing is generated. Diagnostics go to ``info`` (stderr), the text to
    ``echo`` (stdout). Returns the exit status.

    Raises:
        ValueError: conflicting or invalid options (the CLI prints them).
    """
    from ..models.checkpoint import load_checkpoint, save_checkpoint
    from ..models.gpt import GPT, GPTConfig

    if preset is not None and checkpoint is not None:
        raise ValueError(f"give --preset or --checkpoint, not both (got --preset {preset} --checkpoint {checkpoint})")
    if save_init is not None and checkpoint is not None:
        raise ValueError(
            "--save-init writes a freshly initialised preset model; it cannot be combined with --checkpoint"
        )
    if checkpoint is not None:
        model = load_checkpoint(checkpoint)
        source = f"checkpoint {checkpoint}"
    else:
        name = preset or DEFAULT_PRESET
        config = GPTConfig.from_preset(name)
        torch.manual_seed(seed)
        model = GPT(config)
        source = f"preset {name!r}, fresh weights (seed {seed})"
    model.eval()
    if save_init is not None:
        config_path, weights_path = save_checkpoint(model, save_init)
        info(f"saved {source}: {config_path} + {weights_path}")
        echo(str(save_init))
        return 0
    tok = _load_tokenizer(tokenizer)
    ids = encode_prompt(prompt, model.config.vocab_size, tok)
    info(f"model: {source}, {model.num_parameters():,} parameters; prompt {len(ids)} tokens")
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    echo(decode_tokens(out[0].tolist(), tok))
    return 0
