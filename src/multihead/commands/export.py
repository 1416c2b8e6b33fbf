"""``multihead export``: write a model as a Hugging Face transformers folder.

    multihead export --checkpoint runs/tiny --hf tiny-hf          GPT -> GPT2LMHeadModel
    multihead export --model minilm-l6 --hf minilm-hf             MiniLM -> BertModel (+ sentence-transformers)
    multihead export --checkpoint minilm-half --hf half-hf --zero-heads

Model sources, as ``multihead prune`` takes them: ``--model minilm-l6``
(the pretrained all-MiniLM-L6-v2) or ``--checkpoint PATH``: a GPT
checkpoint, a ``multihead train`` run directory (its latest checkpoint and
its tokenizer), a checkpoint folder with its tokenizer.json (what ``prune``
and ``convert`` write), or a sentence encoder folder written by ``prune
--model`` / ``save_sentence_encoder``. ``--tokenizer FILE`` gives a GPT
checkpoint without one its tokenizer.json.

The folder is written by ``multihead.hf.export_hf`` (see there for the
files, the tokenizer and what transformers cannot hold). Everything is
checked first: the sources, --hf (new, empty or a previous export), the
model loaded and whether transformers can hold it; a refusal names the
reason and writes nothing.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .checking import checking

__all__ = ["add_arguments", "run", "Export", "prepare", "export", "MODELS"]

MODELS = ("minilm-l6",)
DESCRIPTION = (
    "Write a GPT checkpoint or run (as GPT2LMHeadModel) or MiniLM / a saved sentence encoder (as BertModel, "
    "with sentence-transformers' pooling files) as a Hugging Face folder that transformers' from_pretrained "
    "loads: config.json, model.safetensors and the tokenizer files. What transformers cannot hold (GQA, MQA "
    "and other attention kinds, rope, pruned heads without --zero-heads) is refused with the reason. "
    "See docs/export.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead export``."""
    parser.description = DESCRIPTION
    parser.add_argument("--hf", required=True, metavar="OUT", help="the folder to write (new, empty or a previous export)")
    parser.add_argument("--model", metavar="NAME", help=f"a pretrained model: {', '.join(MODELS)}")
    parser.add_argument(
        "--checkpoint", metavar="PATH",
        help="a GPT checkpoint, a multihead train run directory, or a sentence encoder folder written by prune",
    )  # fmt: skip
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json of a GPT checkpoint that has none beside it")
    parser.add_argument(
        "--zero-heads", action="store_true",
        help="a pruned model: write the removed heads back as zero heads (same outputs, unpruned size)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """``multihead export``: check the options, load the model and check it fits, then write the folder."""
    with checking():
        job = prepare(hf=args.hf, model=args.model, checkpoint=args.checkpoint, tokenizer=args.tokenizer,
                      zero_heads=args.zero_heads)  # fmt: skip
    export(job)
    return 0


@dataclass
class Export:
    """What ``prepare`` checked and loaded: the model, its tokenizer and where it goes."""

    model: nn.Module
    source: str
    folder: Path
    tokenizer: object | None
    zero_heads: bool
    architecture: str


def _sentence_folder(path: str) -> bool:
    """True for a folder written by ``save_sentence_encoder``."""
    from ..models.minilm import SENTENCE_FORMAT

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("format") == SENTENCE_FORMAT
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def prepare(
    *,
    hf: str,
    model: str | None = None,
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    zero_heads: bool = False,
) -> Export:
    """Check the options and --hf, load the model, check transformers can hold it.

    Raises:
        ValueError: not exactly one of ``model`` and ``checkpoint``, an
            unknown model, --tokenizer where the model brings its own, an
            --hf that cannot be written, or a model transformers cannot
            hold (the reason); nothing is written.
    """
    from ..hf.export import check_export_folder, check_hf_export, export_tokenizer, pruned

    if (model is None) == (checkpoint is None):
        raise ValueError(f"give exactly one of --model and --checkpoint (got --model {model} and --checkpoint {checkpoint})")
    if model is not None and model not in MODELS:
        raise ValueError(f"--model {model}: unknown model; valid: {', '.join(MODELS)}")
    folder = check_export_folder(hf, "--hf")
    tok = None
    if tokenizer is not None:
        from .tokens import load_tokenizer

        tok = load_tokenizer(tokenizer)
    if model is not None or _sentence_folder(checkpoint):
        if tok is not None:
            raise ValueError(f"--tokenizer {tokenizer} is for a GPT checkpoint; a sentence encoder brings its own")
        if model is not None:
            from ..models.minilm import load_minilm

            net, source = load_minilm(), f"model {model}"
        else:
            from ..models.minilm import load_sentence_encoder

            net, source = load_sentence_encoder(checkpoint), f"sentence encoder {checkpoint}"
    else:
        from .gpt_inputs import load_gpt

        net, _, own, source = load_gpt(checkpoint)
        if own is not None and tok is not None:
            raise ValueError(f"--checkpoint {checkpoint} brings its own tokenizer; --tokenizer {tokenizer} cannot replace it")
        tok = own if tok is None else tok
    architecture = check_hf_export(net, zero_heads=zero_heads)
    tok = export_tokenizer(net, tok)
    if zero_heads and not pruned(net):
        raise ValueError(f"--zero-heads is for a pruned model; {source} has every head in every layer")
    return Export(net.eval(), source, folder, tok, zero_heads, architecture)


def _layer_heads(net: nn.Module) -> list[int] | None:
    """The per-layer head counts of a GPT or sentence encoder (None: uniform)."""
    return getattr(net, "encoder", net).config.layer_heads


def export(job: Export, echo=print) -> Path:
    """Write the folder and say what was written and how to load it."""
    from ..hf.export import export_hf

    folder = export_hf(job.model, job.folder, tokenizer=job.tokenizer, zero_heads=job.zero_heads)
    files = sorted(p.name for p in folder.iterdir())
    echo(f"{job.source}: wrote {folder.resolve()} ({', '.join(files)})")
    if job.zero_heads:
        echo(f"  removed heads written back as zero heads (layer heads {_layer_heads(job.model)})")
    if "tokenizer.json" not in files:
        echo("  no tokenizer was written: give --tokenizer FILE to add one")
    extra = ", add_pooling_layer=False" if job.architecture == "BertModel" else ""
    echo(f"  load it with transformers.{job.architecture}.from_pretrained({str(folder)!r}{extra})")
    if "modules.json" in files:
        echo(f"  or sentence_transformers.SentenceTransformer({str(folder)!r})")
    return folder
