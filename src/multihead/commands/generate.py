"""``multihead generate``: sample text from a GPT preset or a saved checkpoint.

A preset builds a freshly initialised model (seeded, so the same seed gives
the same model); ``--checkpoint`` loads one written by
``multihead.models.checkpoint.save_checkpoint`` (or by ``--save-init``), or
the run directory of ``multihead train`` (its latest checkpoint, and its
tokenizer to encode the prompt and decode the output; see ``run_dir``).

Byte-level models (vocab_size 256) read the prompt as UTF-8 bytes; other
vocabularies need ``--tokenizer tokenizer.json`` (Hugging Face ``tokenizers``)
unless a run directory brings its own tokenizer.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from .paths import output_folder
from .run_dir import run_checkpoint
from .tokens import load_tokenizer

__all__ = [
    "run", "encode_prompt", "decode_tokens", "DEFAULT_PRESET", "DEFAULT_PROMPT", "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
]  # fmt: skip

DEFAULT_PRESET = "tiny"
DEFAULT_PROMPT = "Hello"
DEFAULT_MAX_NEW_TOKENS = 50
DEFAULT_TEMPERATURE = 1.0
BYTE_VOCAB = 256


def encode_prompt(prompt: str, vocab_size: int, tokenizer=None) -> list[int]:
    """Token ids of ``prompt``: ``tokenizer`` when given, else UTF-8 bytes for a 256-token vocabulary.

    ``tokenizer`` is a Hugging Face ``tokenizers.Tokenizer`` or a tokenizer of
    ``multihead.train.tokenizer`` (whose ``encode`` returns the ids).

    Raises:
        ValueError: no tokenizer for a non-byte vocabulary, an empty
            encoding, or ids outside the model's vocabulary.
    """
    if tokenizer is not None:
        encoded = tokenizer.encode(prompt)
        ids = list(encoded) if isinstance(encoded, list) else list(encoded.ids)
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


def _check_save_init(save_init: str, checkpoint: str | None, sampling: dict) -> None:
    """Refuse what --save-init cannot honour, and a PATH that cannot be written, before any work."""
    from ..models.checkpoint import checkpoint_paths

    if checkpoint is not None:
        raise ValueError(
            f"--save-init writes a freshly initialised preset model; it cannot be combined with --checkpoint {checkpoint}"
        )
    given = [f"{flag} {value}" for flag, value in sampling.items() if value is not None]
    if given:
        raise ValueError(f"--save-init only saves the model and generates nothing, so {', '.join(given)} would be ignored")
    config_path, weights_path = checkpoint_paths(save_init)
    output_folder("--save-init", config_path.parent, (config_path.name, weights_path.name), shown=str(save_init))


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    """The sampling values, checked before a model is built (None = the default)."""
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0):
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be an integer >= 0")
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
        raise ValueError(f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"--top-k {top_k}: must be an integer >= 1")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"--top-p {top_p}: must be a number in (0, 1]")
    if temperature == 0 and (top_k is not None or top_p is not None):
        chosen = " ".join(f"{flag} {v}" for flag, v in (("--top-k", top_k), ("--top-p", top_p)) if v is not None)
        raise ValueError(f"--temperature 0 is greedy (always the most likely token), so {chosen} would be ignored")


def run(
    *,
    preset: str | None = None,
    checkpoint: str | None = None,
    prompt: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
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
    ``echo`` (stdout). None means the default (``DEFAULT_PROMPT``,
    ``DEFAULT_MAX_NEW_TOKENS``, ``DEFAULT_TEMPERATURE``, no top-k/top-p).
    Returns the exit status.

    Raises:
        ValueError: conflicting or invalid options (the CLI prints them):
            --preset with --checkpoint; --save-init with --checkpoint or a
            sampling option, or a PATH that cannot be written; --top-k or
            --top-p with --temperature 0 (greedy ignores them); sampling
            values out of range; a missing --tokenizer file; a run directory
            with no checkpoint yet, or with --tokenizer (it has its own).
            All are checked before a model is built; a prompt too long for
            the model after.
    """
    from ..models.checkpoint import load_checkpoint, save_checkpoint
    from ..models.gpt import GPT, GPTConfig

    if preset is not None and checkpoint is not None:
        raise ValueError(f"give --preset or --checkpoint, not both (got --preset {preset} --checkpoint {checkpoint})")
    if save_init is not None:
        sampling = {
            "--prompt": None if prompt is None else repr(prompt), "--max-new-tokens": max_new_tokens,
            "--temperature": temperature, "--top-k": top_k, "--top-p": top_p, "--tokenizer": tokenizer,
        }  # fmt: skip
        _check_save_init(save_init, checkpoint, sampling)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    tok = None if tokenizer is None else load_tokenizer(tokenizer)  # before the model: a missing file is refused at once
    found = None if checkpoint is None or save_init is not None else run_checkpoint(checkpoint)
    if found is not None:
        step_dir, run_tok, step = found
        if tok is not None and step is not None:
            raise ValueError(
                f"--checkpoint {checkpoint} is a training run with its own tokenizer; "
                f"--tokenizer {tokenizer} cannot replace it"
            )
        model = load_checkpoint(step_dir)
        tok = run_tok if tok is None else tok  # beside a checkpoint folder: --tokenizer, when given, is used
        where = f"run {checkpoint}, step {step} ({step_dir})" if step is not None else f"checkpoint {checkpoint}"
        source = f"{where}, {getattr(tok, 'kind', 'the --tokenizer')} tokenizer"
    elif checkpoint is not None:
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
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    ids = encode_prompt(prompt, model.config.vocab_size, tok)
    new = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if len(ids) > model.config.context_length:
        raise ValueError(
            f"the prompt's {len(ids)} tokens exceed the model's context_length={model.config.context_length}"
        )
    info(f"model: {source}, {model.num_parameters():,} parameters; prompt {len(ids)} tokens")
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(
        torch.tensor([ids]),
        new,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    echo(decode_tokens(out[0].tolist(), tok))
    return 0
