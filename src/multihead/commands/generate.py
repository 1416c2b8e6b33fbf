"""``multihead generate``: sample text from a GPT preset, a saved checkpoint or a Hugging Face GPT-2 folder.

A preset builds a freshly initialised model (seeded, so the same seed gives
the same model); ``--checkpoint`` loads one written by
``multihead.models.checkpoint.save_checkpoint`` (or by ``--save-init``), or
the run directory of ``multihead train`` (its latest checkpoint, and its
tokenizer to encode the prompt and decode the output; see ``run_dir``).
``--hf DIR`` loads a local Hugging Face GPT-2 folder (config.json with
model_type "gpt2", model.safetensors, and its tokenizer.json unless
``--tokenizer`` gives one) into multihead's ``GPT``
(``multihead.hf.load_gpt2_folder``; what ``multihead export`` writes too).

``--weights bf16`` or ``int8`` generates with weight-only quantized linear
layers (``multihead.models.quantize_weights``) and prints, once, the logit
error against the float32 model over the prompt and its greedy continuation
(``multihead.tools.logit_error``).

``--streaming K,W`` decodes with a streaming cache per block (StreamingLLM):
the first K tokens and the last W stay, at their slots in the cache, so a
model without a learned position table (``GPTConfig.positions`` "rope",
"alibi" or "none") generates past its context length in bounded memory;
a model with one is refused in one line.

Byte-level models (vocab_size 256) read the prompt as UTF-8 bytes; other
vocabularies need ``--tokenizer tokenizer.json`` (Hugging Face ``tokenizers``)
unless a run directory brings its own tokenizer.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..models.gpt import GPT_PRESETS
from ..modules.weight_only import WEIGHT_FORMATS
from ..paths import output_folder
from .checking import checking
from .imports import add_import_argument, import_modules
from .run_dir import is_sentence_encoder, run_checkpoint
from .tokens import load_tokenizer

__all__ = [
    "add_arguments", "run", "Generation", "prepare", "generate", "encode_prompt", "decode_tokens", "DEFAULT_PRESET",
    "DEFAULT_PROMPT", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_TEMPERATURE",
]  # fmt: skip

DEFAULT_PRESET = "tiny"
DEFAULT_PROMPT = "Hello"
DEFAULT_MAX_NEW_TOKENS = 50
DEFAULT_TEMPERATURE = 1.0
BYTE_VOCAB = 256
DESCRIPTION = (
    "Build a GPT-2 style model from a preset with freshly initialised, seeded weights, or load "
    "a checkpoint (config.json + model.safetensors, e.g. written by --save-init, or the run "
    "directory of 'multihead train': its latest checkpoint and its own tokenizer), or a local Hugging Face "
    "GPT-2 folder (--hf DIR: config.json, model.safetensors, tokenizer.json), then sample a "
    "continuation of the prompt and print prompt + continuation. Byte-level models (vocab 256: "
    "the tiny and mini presets) read the prompt as UTF-8 bytes; other vocabularies need "
    "--tokenizer tokenizer.json (a run directory brings its tokenizer). A preset's untrained "
    "weights produce noise: they show the decoding machinery (KV cache, temperature, top-k, "
    "top-p), not a language model. --weights bf16|int8 stores the linear layers' weights in "
    "fewer bytes for decoding (activations stay float32) and prints the logit error against float32 "
    "once. --save-init only saves the model, so the sampling options "
    "cannot go with it. A checkpoint of an attention kind from your own package needs --import."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead generate``."""
    parser.description = DESCRIPTION
    parser.add_argument(
        "--preset",
        help=f"model preset: {', '.join(GPT_PRESETS)} (default {DEFAULT_PRESET} unless --checkpoint or --hf is given)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="checkpoint directory, .safetensors file, or run directory of 'multihead train' to load",
    )
    parser.add_argument(
        "--hf", metavar="DIR",
        help="a local Hugging Face GPT-2 folder (config.json, model.safetensors, tokenizer.json) to load",
    )  # fmt: skip
    parser.add_argument("text", nargs="?", metavar="PROMPT", help="text to continue (the same as --prompt)")
    parser.add_argument("--prompt", help=f"text to continue (default {DEFAULT_PROMPT!r})")
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N", help=f"tokens to add (default {DEFAULT_MAX_NEW_TOKENS})"
    )
    parser.add_argument(
        "--temperature", type=float, metavar="T", help=f"0 = greedy; higher = more random (default {DEFAULT_TEMPERATURE})"
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, metavar="P", help="sample among the smallest set with mass >= P")
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the weights and the sampling (default 0)"
    )
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="Hugging Face tokenizer.json (required when vocab_size is not 256)"
    )
    parser.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default="fp32",
        help="weights of the linear layers while generating: fp32 (default: the model as loaded), bf16, or int8 "
        "with per-channel scales; bf16/int8 print the logit error against fp32 once",
    )  # fmt: skip
    parser.add_argument(
        "--streaming", metavar="K,W",
        help="keep the first K tokens (attention sinks) and the last W, placed at their slots in the cache, and "
        "generate past the context length in bounded memory (K + W <= context length; models without a learned "
        "position table only)",
    )  # fmt: skip
    parser.add_argument("--save-init", metavar="PATH", help="save the freshly initialised preset model to PATH and exit")
    add_import_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``multihead generate``: everything is checked and the model built, then it samples (or saves)."""
    with checking():
        import_modules(args.imports)
        if args.text is not None and args.prompt is not None:
            raise ValueError(
                f"give the prompt once, as PROMPT or --prompt (got {args.text!r} and --prompt {args.prompt!r})"
            )
        job = prepare(
            preset=args.preset, checkpoint=args.checkpoint, hf=args.hf, prompt=args.prompt if args.text is None else args.text,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, tokenizer=args.tokenizer, save_init=args.save_init, weights=args.weights,
            streaming=args.streaming,
        )  # fmt: skip
    return generate(job)


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


@dataclass
class Generation:
    """What ``prepare`` checked and built: the model, and either the ids to continue or where to save it."""

    model: nn.Module
    source: str
    tokenizer: object | None
    ids: list[int] | None
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    save_init: str | None
    weights: str = "fp32"
    reference: nn.Module | None = None  # the float32 model of a bf16/int8 one
    streaming: tuple[int, int] | None = None  # (sink tokens, window) of --streaming


def prepare(
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
    hf: str | None = None,
    weights: str = "fp32",
    streaming: str | None = None,
) -> Generation:
    """Check the options, build or load the model and encode the prompt.

    None means the default (``DEFAULT_PROMPT``, ``DEFAULT_MAX_NEW_TOKENS``,
    ``DEFAULT_TEMPERATURE``, no top-k/top-p). With ``save_init`` the freshly
    built preset model is to be saved there and nothing is encoded. With
    ``weights`` "bf16" or "int8" the model is quantized
    (``models.quantize_weights``) and the float32 one kept as the reference.
    ``streaming`` is the text of ``--streaming K,W``.

    Raises:
        ValueError: conflicting or invalid options: --preset with
            --checkpoint or --hf; --save-init with --checkpoint, --hf or a sampling option,
            or a PATH that cannot be written; --weights other than fp32 with
            --save-init, or for a model quantize_weights refuses; --top-k or --top-p with
            --temperature 0 (greedy ignores them); sampling values out of
            range; a missing --tokenizer file; a run directory with no
            checkpoint yet, or with --tokenizer (it has its own); an --hf
            folder that is not a GPT-2 folder multihead can load; a malformed
            --streaming K,W. All are checked before a model is built; a
            prompt too long for the model, and --streaming for a model with
            a learned position table or K + W beyond its context, after.
    """
    from ..models.checkpoint import load_checkpoint
    from ..models.gpt import GPT, GPTConfig

    sources = {"--preset": preset, "--checkpoint": checkpoint, "--hf": hf}
    given = [f"{flag} {value}" for flag, value in sources.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of --preset, --checkpoint and --hf, not several (got {' '.join(given)})")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights {weights}: must be one of {', '.join(WEIGHT_FORMATS)}")
    if weights != "fp32" and save_init is not None:
        raise ValueError(f"--save-init saves the float32 model and generates nothing, so --weights {weights} would be ignored")
    if hf is not None and save_init is not None:
        raise ValueError(f"--save-init writes a freshly initialised preset model; it cannot be combined with --hf {hf}")
    if save_init is not None:
        sampling = {
            "--prompt": None if prompt is None else repr(prompt), "--max-new-tokens": max_new_tokens,
            "--temperature": temperature, "--top-k": top_k, "--top-p": top_p, "--tokenizer": tokenizer,
        }  # fmt: skip
        _check_save_init(save_init, checkpoint, {**sampling, "--streaming": streaming})
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    stream = None if streaming is None else _streaming_pair(streaming)
    tok = None if tokenizer is None else load_tokenizer(tokenizer)  # before the model: a missing file is refused at once
    if checkpoint is not None and save_init is None and is_sentence_encoder(checkpoint):
        raise ValueError(
            f"--checkpoint {checkpoint} holds a sentence encoder (BERT), which encodes text but does not generate "
            f"it; generate needs a GPT (multihead inspect --checkpoint {checkpoint} shows its heads)"
        )
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
    elif hf is not None:
        model, own = _hf_gpt2(hf, tok)
        tok = own if tok is None else tok
        source = f"Hugging Face GPT-2 folder {hf}, {'its tokenizer.json' if tokenizer is None else 'the --tokenizer'}"
    else:
        name = preset or DEFAULT_PRESET
        config = GPTConfig.from_preset(name)
        torch.manual_seed(seed)
        model = GPT(config)
        source = f"preset {name!r}, fresh weights (seed {seed})"
    model.eval()
    if stream is not None:
        from ..models.gpt_positions import check_streaming

        try:
            check_streaming(model.config, *stream)
        except ValueError as e:
            raise ValueError(f"--streaming {streaming}: {e}") from None
    reference = None
    if weights != "fp32":
        from ..models.quantize import quantize_weights

        reference, model = model, quantize_weights(model, weights)
    ids = None
    if save_init is None:
        prompt = DEFAULT_PROMPT if prompt is None else prompt
        ids = encode_prompt(prompt, model.config.vocab_size, tok)
        if len(ids) > model.config.context_length:
            raise ValueError(
                f"the prompt's {len(ids)} tokens exceed the model's context_length={model.config.context_length}"
            )
    return Generation(
        model, source, tok, ids, DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        DEFAULT_TEMPERATURE if temperature is None else temperature, top_k, top_p, seed, save_init, weights, reference,
        stream,
    )  # fmt: skip


def _streaming_pair(text: str) -> tuple[int, int]:
    """(K, W) of ``--streaming K,W``: K >= 0 sink tokens, W >= 1 recent ones.

    Raises:
        ValueError: another form, naming the text.
    """
    parts = text.split(",")
    try:
        sinks, window = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        sinks = window = None
    if sinks is None or sinks < 0 or window < 1:
        raise ValueError(f"--streaming {text}: expected K,W with K >= 0 sink tokens and W >= 1 recent ones (e.g. 4,60)")
    return sinks, window


def _hf_gpt2(hf: str, tokenizer) -> tuple[nn.Module, object | None]:
    """(GPT, the folder's tokenizer or None) of a Hugging Face GPT-2 folder, checked before the weights are read.

    Raises:
        ValueError: no such folder, a missing file, another model_type, a
            GPT-2 option multihead does not implement, weights that do not fit.
    """
    from ..hf.folders import load_gpt2_folder, model_folder, read_config

    label = f"--hf {hf}"
    folder = model_folder(hf, ("config.json", "model.safetensors"), label=label)
    model_type = read_config(folder, label=label).get("model_type")
    if model_type != "gpt2":
        raise ValueError(f"{label}: model_type {model_type!r}; generate takes a GPT-2 folder (model_type 'gpt2')")
    if tokenizer is None and not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{label}: no tokenizer.json in it to encode the prompt; give --tokenizer FILE")
    try:
        return load_gpt2_folder(folder)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None


def generate(
    job: Generation,
    echo: Callable[[str], None] = print,
    info: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> int:
    """Sample and ``echo`` prompt + continuation (or save the model with ``save_init``); return 0.

    Diagnostics go to ``info`` (stderr), the text to ``echo`` (stdout).
    """
    from ..models.checkpoint import save_checkpoint

    model = job.model
    if job.save_init is not None:
        config_path, weights_path = save_checkpoint(model, job.save_init)
        info(f"saved {job.source}: {config_path} + {weights_path}")
        echo(str(job.save_init))
        return 0
    stream = "" if job.streaming is None else f"; streaming: {job.streaming[0]} sink tokens + the last {job.streaming[1]}"
    info(f"model: {job.source}, {model.num_parameters():,} parameters; prompt {len(job.ids)} tokens{stream}")
    if job.reference is not None:
        from ..tools.logit_error import logit_error

        err = logit_error(job.reference, model, torch.tensor([job.ids]), job.max_new_tokens)
        info(f"weights {job.weights}: logit error against fp32 over the prompt and its greedy continuation: {err.line()}")
    generator = torch.Generator().manual_seed(job.seed)
    out = model.generate(
        torch.tensor([job.ids]),
        job.max_new_tokens,
        temperature=job.temperature,
        top_k=job.top_k,
        top_p=job.top_p,
        generator=generator,
        streaming=job.streaming,
    )
    echo(decode_tokens(out[0].tolist(), job.tokenizer))
    return 0
