"""The model ``multihead prune`` and ``multihead convert`` work on: exactly one of three sources.

    --model minilm-l6     the pretrained all-MiniLM-L6-v2                     -> SentenceEncoder
    --checkpoint PATH     a GPT checkpoint or a ``multihead train`` run       -> GPT
                          a sentence-encoder folder (what prune and convert
                          write for MiniLM or a BERT)                         -> SentenceEncoder
    --hf DIR              a Hugging Face folder, model_type "bert"            -> SentenceEncoder
                          model_type "gpt2" (with its tokenizer.json)         -> GPT

``family`` tells encoder from GPT reading only small files (config.json,
the weights' header), so a command refuses options that do not fit the
model before any weights are read; ``load_source`` then loads it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .run_dir import is_sentence_encoder

__all__ = ["HF_FOLDER", "MODELS", "Source", "add_source_arguments", "check_sources", "family", "load_source"]

MODELS = ("minilm-l6",)
HF_FOLDER = "a local Hugging Face folder (config.json, model.safetensors, tokenizer.json) of model_type bert or gpt2"


def add_source_arguments(parser: argparse.ArgumentParser, *, hf_help: str) -> None:
    """``--checkpoint PATH`` and ``--hf DIR`` (``--model`` differs by command and stays with it)."""
    checkpoint = "a GPT checkpoint, the run directory of 'multihead train', or a folder prune or convert wrote"
    parser.add_argument("--checkpoint", metavar="PATH", help=checkpoint)
    parser.add_argument("--hf", metavar="DIR", help=hf_help)


def check_sources(model: str | None, checkpoint: str | None, hf: str | None) -> None:
    """Exactly one of --model, --checkpoint and --hf, and a known --model.

    Raises:
        ValueError: none or several given, or an unknown model name.
    """
    if sum(v is not None for v in (model, checkpoint, hf)) != 1:
        raise ValueError(
            f"give exactly one of --model, --checkpoint and --hf "
            f"(got --model {model}, --checkpoint {checkpoint} and --hf {hf})"
        )
    if model is not None and model not in MODELS:
        raise ValueError(f"--model {model}: unknown model; valid: {', '.join(MODELS)}")


def family(model: str | None, checkpoint: str | None, hf: str | None, *, command: str) -> tuple[str, Path | None]:
    """("encoder" or "gpt", the checked --hf folder or None), from small files only.

    Raises:
        ValueError: an --hf folder ``multihead {command}`` does not take (``prune_hf.check_folder``).
    """
    if model is not None:
        return "encoder", None
    if hf is not None:
        from .prune_hf import check_folder

        folder, model_type = check_folder(hf, command)
        return ("encoder" if model_type == "bert" else "gpt"), folder
    return ("encoder" if is_sentence_encoder(checkpoint) else "gpt"), None


@dataclass
class Source:
    """A loaded model and what came with it.

    Attributes:
        net: a ``GPT`` or ``SentenceEncoder`` in eval mode.
        encoder: whether ``net`` is a sentence encoder.
        source: how the reports name it ("model minilm-l6", "run R, step 200", ...).
        pooling: an encoder's pooling, in words.
        run_dir: a GPT's training run directory (its data and validation batches).
        tokenizer: a GPT's BPE tokenizer (a run's, or the tokenizer.json beside a
            checkpoint); None for a byte-level GPT and for encoders.
        tokenizer_file: the tokenizer.json to copy beside a saved GPT.
        hf_tokenizer: a GPT-2 folder's ``tokenizers.Tokenizer``.
    """

    net: nn.Module
    encoder: bool
    source: str
    pooling: str | None = None
    run_dir: Path | None = None
    tokenizer: object | None = None
    tokenizer_file: Path | None = None
    hf_tokenizer: object | None = None


def _pooling(net) -> str:
    return f"{net.pooling} pooling{', L2-normalised' if net.normalize else ''}"


def load_source(model: str | None, checkpoint: str | None, hf: str | None, *, command: str) -> Source:
    """Load the one model given to ``multihead {command}``.

    Raises:
        ValueError, OSError: a model that cannot be read (the loaders' messages).
    """
    if model is not None:
        from ..models.minilm import load_minilm

        net = load_minilm()
        return Source(net, True, f"model {model}", _pooling(net))
    if hf is not None:
        kind, folder = family(None, None, hf, command=command)
        if kind == "encoder":
            from ..hf.folders import load_sentence_encoder_folder

            net, pooling = load_sentence_encoder_folder(folder)
            return Source(net, True, f"bert model {hf}", pooling)
        from ..hf.folders import load_gpt2_folder

        net, hf_tokenizer = load_gpt2_folder(folder)
        return Source(net, False, f"gpt2 model {hf}", tokenizer_file=folder / "tokenizer.json",
                      hf_tokenizer=hf_tokenizer)  # fmt: skip
    if is_sentence_encoder(checkpoint):
        from ..models.minilm import load_sentence_encoder

        net = load_sentence_encoder(checkpoint)
        return Source(net, True, f"sentence encoder {checkpoint}", _pooling(net))
    from .gpt_inputs import load_gpt, tokenizer_json

    net, run_dir, tokenizer, source = load_gpt(checkpoint)
    tokenizer = tokenizer if tokenizer is not None and tokenizer.kind != "bytes" else None
    tokenizer_file = tokenizer_json(checkpoint, run_dir) if tokenizer is not None else None
    return Source(net, False, source, run_dir=run_dir, tokenizer=tokenizer, tokenizer_file=tokenizer_file)
