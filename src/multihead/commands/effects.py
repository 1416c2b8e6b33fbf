"""``multihead effects``: which heads carry a causal model's answer, by replacing one head at a time.

    multihead effects --checkpoint runs/tiny --clean "When Mary and John went to the store, John gave a drink to" \\
        --corrupted "When Mary and John went to the store, Mary gave a drink to" --answer " Mary" --wrong " John"

``--hf`` takes a local Hugging Face folder (config.json, weights,
tokenizer.json): GPT-2 is loaded into multihead's own GPT, any other causal
model (Llama, Qwen, Mistral, ...) runs on multihead attention through
``multihead.hf`` (``AutoModelForCausalLM``), its heads replaced through
``multihead.hf.head_hook``.

Encodes both prompts and the two answers (each must be one token; answers
without the special tokens a tokenizer.json adds, such as a BOS) with the
model's tokenizer (a run's, the tokenizer.json beside a checkpoint or in
the ``--hf`` folder, else UTF-8 bytes for a 256-token vocabulary), takes
the metric as the logit difference answer - wrong at ``--position``
(default the last prompt token), runs ``tools.head_effects`` with
``--method`` (zero, mean, patch or restore: docs/effects.md), prints the
metric on both prompts and the ``--top`` heads with the largest |effect|,
and writes into ``--out``:

    effects.html   the layers x heads heatmap (signed colours, each value on hover; opens from disk)
    effects.png    the same map as an image
    effects.json   the map, both metric values, the prompts, answers and method

Everything is checked before the model runs and before anything is
written: the method, exactly one of ``--checkpoint`` and ``--hf``, a GPT
or a causal transformers model (not a sentence encoder, nor a model whose
heads see later tokens), the output folder (and matplotlib for the PNG),
prompts that encode and fit the context, answers of one token, prompts of
the same length for patch and restore, and a kind whose heads are coupled
(refused with its reason unless ``--coupled-heads``). The folder is
written whole (``staged_output``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from ..paths import output_folder
from .checking import checking
from .imports import add_import_argument, import_modules
from .model_sources import add_source_arguments, check_sources, family, load_source
from .staged_output import interruptible, write_folder

__all__ = ["add_arguments", "run", "Effects", "prepare", "measure", "OUTPUT_FILES", "METHODS", "DEFAULT_TOP"]

METHODS = ("zero", "mean", "patch", "restore")  # tools.head_effects.METHODS, without importing torch for --help
OUTPUT_FILES = ("effects.html", "effects.png", "effects.json")
DEFAULT_TOP = 10
DESCRIPTION = (
    "Measure every attention head's causal effect on a causal model's answer: the logit difference between --answer "
    "and --wrong (one token each) at the last prompt token, when that head's output alone is replaced before "
    "the output projection: by zeros (zero), by its mean over the clean prompt's positions (mean), by its "
    "output on --corrupted (patch, the clean run; activation patching), or, in the corrupted run, by its "
    "output on --clean (restore). Prints the top heads and writes effects.html (heatmap, values on hover), "
    "effects.png and effects.json into --out. --hf takes a GPT-2 folder or any causal transformers folder "
    "(Llama, Qwen, ...; run on multihead attention). See docs/effects.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead effects``."""
    parser.description = DESCRIPTION
    add_source_arguments(parser, hf_help="a local Hugging Face folder of a causal model: GPT-2, Llama, Qwen, ... "
                                         "(config.json, safetensors weights, tokenizer.json)")  # fmt: skip
    parser.add_argument("--clean", required=True, metavar="TEXT", help="the prompt the model answers correctly")
    parser.add_argument("--corrupted", metavar="TEXT", help="the prompt that changes the answer (patch, restore)")
    parser.add_argument("--answer", required=True, metavar="TOKEN", help="the clean prompt's answer (one token)")
    parser.add_argument("--wrong", required=True, metavar="TOKEN", help="the other answer (one token)")
    parser.add_argument("--method", default="patch", metavar="M", help=f"{', '.join(METHODS)} (default patch)")
    parser.add_argument("--position", type=int, default=-1, metavar="P",
                        help="the prompt position whose next-token logits are read (default -1, the last)")  # fmt: skip
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="N", help=f"heads printed (default {DEFAULT_TOP})")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N", help="heads replaced per forward (default 8)")
    parser.add_argument("--coupled-heads", action="store_true",
                        help="also measure kinds whose heads mix (moh, dcmha, ...): head h is then output slot h")  # fmt: skip
    parser.add_argument("--out", default="effects", metavar="DIR", help="folder for effects.html/png/json (default effects)")
    add_import_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``multihead effects``: check and load everything, then measure, print and write."""

    def body() -> int:
        with checking():
            import_modules(args.imports)
            job = prepare(
                checkpoint=args.checkpoint, hf=args.hf, clean=args.clean, corrupted=args.corrupted, answer=args.answer,
                wrong=args.wrong, method=args.method, position=args.position, top=args.top, batch_size=args.batch_size,
                coupled_heads=args.coupled_heads, out=args.out,
            )  # fmt: skip
        measure(job)
        return 0

    return interruptible("multihead effects", args.out, body)


@dataclass
class Effects:
    """What ``prepare`` checked and loaded for ``measure``: the model, token ids [1, T] and the answer ids."""

    net: object
    source: str
    tokenizer: object | None
    clean: object
    corrupted: object | None
    texts: dict
    answer: int
    wrong: int
    method: str
    position: int
    top: int
    batch_size: int
    coupled_heads: bool
    folder: Path


def _check_options(method: str, top: int, batch_size: int) -> None:
    if method not in METHODS:
        raise ValueError(f"--method {method}: unknown method; valid: {', '.join(METHODS)}")
    if top < 1:
        raise ValueError(f"--top {top}: give a number >= 1")
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: give a number >= 1")
    if find_spec("matplotlib") is None:
        raise ImportError("multihead effects draws effects.png with matplotlib, which is not installed: "
                          "pip install 'multihead[viz]'")  # fmt: skip


def _encode(flag: str, text: str, model, tokenizer, special: bool = True) -> list[int]:
    """The ids of ``text``; ``special=False``: without the special tokens a tokenizers file adds (an answer's BOS)."""
    from .generate import encode_prompt

    if not text:
        raise ValueError(f"{flag} is empty: give some text")
    if not special and hasattr(tokenizer, "no_padding"):  # a tokenizers.Tokenizer
        tokenizer = _Plain(tokenizer)
    try:
        return encode_prompt(text, model.config.vocab_size, tokenizer)
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: {err}") from None


@dataclass
class _Plain:
    """A ``tokenizers.Tokenizer`` that encodes without special tokens (``encode_prompt`` calls ``encode(text)``)."""

    tokenizer: object

    def encode(self, text: str):
        return self.tokenizer.encode(text, add_special_tokens=False)


def _load_hf(hf: str):
    """(model, tokenizer, source, context limit or None) of an --hf folder: a GPT-2 folder in multihead's
    GPT, any other causal transformers folder on multihead attention through ``multihead.hf``."""
    from ..hf.folders import model_folder, read_config, read_tokenizer

    label = f"--hf {hf}"
    folder = model_folder(hf, ("config.json", "tokenizer.json"), label=label)
    model_type = read_config(folder, label=label).get("model_type")
    if model_type == "bert":
        raise ValueError(f"{label}: model_type 'bert' is a sentence encoder; effects reads a causal model's "
                         "next-token logits")  # fmt: skip
    if model_type == "gpt2":
        loaded = load_source(None, None, hf, command="effects")
        return loaded.net, loaded.hf_tokenizer, loaded.source, loaded.net.config.context_length
    if find_spec("transformers") is None:
        raise ImportError(f"{label}: model_type {model_type!r} runs through transformers, which is not installed: "
                          "pip install transformers")  # fmt: skip
    from transformers import AutoModelForCausalLM

    from ..hf.folders import load_transformers_folder
    from .inspect_causal import is_causal

    net = load_transformers_folder(folder, label=label, model_class=AutoModelForCausalLM)
    config = net.config
    if not is_causal(net, hf=True, vocab_size=config.vocab_size):
        raise ValueError(f"{label}: the {model_type} model attends to later tokens; effects reads a causal "
                         "model's next-token logits")  # fmt: skip
    tokenizer = read_tokenizer(folder / "tokenizer.json")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    sizes = [getattr(config, n, None) for n in ("max_position_embeddings", "n_positions")]
    return net, tokenizer, f"{model_type} model {hf}", next((v for v in sizes if isinstance(v, int)), None)


def prepare(
    *,
    clean: str,
    answer: str,
    wrong: str,
    checkpoint: str | None = None,
    hf: str | None = None,
    corrupted: str | None = None,
    method: str = "patch",
    position: int = -1,
    top: int = DEFAULT_TOP,
    batch_size: int = 8,
    coupled_heads: bool = False,
    out: str = "effects",
) -> Effects:
    """Check the options and --out, load the model, encode the prompts and answers.

    Raises:
        ValueError / TypeError / ImportError: see the module docstring; nothing is written.
    """
    import torch

    from ..tools.head_effects import check_measurable

    check_sources(None, checkpoint, hf)
    _check_options(method, top, batch_size)
    if method in ("patch", "restore") and corrupted is None:
        raise ValueError(f"--method {method} needs --corrupted TEXT: the prompt whose head outputs are swapped in")
    folder = output_folder("--out", out, OUTPUT_FILES)
    if hf is not None:
        net, tokenizer, source, limit = _load_hf(hf)
    else:
        if family(None, checkpoint, None, command="effects")[0] != "gpt":
            raise ValueError(f"--checkpoint {checkpoint} is a sentence encoder (BERT); effects reads a GPT's "
                             "next-token logits")  # fmt: skip
        loaded = load_source(None, checkpoint, None, command="effects")
        net, tokenizer, source, limit = loaded.net, loaded.tokenizer, loaded.source, loaded.net.config.context_length
    check_measurable(net, coupled_heads=coupled_heads)
    ids = {"--clean": _encode("--clean", clean, net, tokenizer)}
    if corrupted is not None:
        ids["--corrupted"] = _encode("--corrupted", corrupted, net, tokenizer)
    for flag, listed in ids.items():
        if limit is not None and len(listed) > limit:
            raise ValueError(f"{flag} encodes to {len(listed)} tokens, more than the model's context_length={limit}")
    if corrupted is not None and method in ("patch", "restore") and len(ids["--clean"]) != len(ids["--corrupted"]):
        raise ValueError(f"--clean encodes to {len(ids['--clean'])} tokens and --corrupted to {len(ids['--corrupted'])}; "
                         f"--method {method} swaps head outputs position by position, so give prompts of the same length")  # fmt: skip
    T = len(ids["--clean"])
    if not -T <= position < T:
        raise ValueError(f"--position {position}: out of range for the clean prompt's {T} tokens")
    answers = []
    for flag, text in (("--answer", answer), ("--wrong", wrong)):
        listed = _encode(flag, text, net, tokenizer, special=False)
        if len(listed) != 1:
            raise ValueError(f"{flag} {text!r} encodes to {len(listed)} tokens {listed}; give text that is one token of "
                             "the model's tokenizer (one byte for a byte-level model)")  # fmt: skip
        answers.append(listed[0])
    if answers[0] == answers[1]:
        raise ValueError(f"--answer {answer!r} and --wrong {wrong!r} are the same token {answers[0]}")
    device = next(net.parameters()).device
    tensors = {flag: torch.tensor([listed], device=device) for flag, listed in ids.items()}
    return Effects(net, source, tokenizer, tensors["--clean"], tensors.get("--corrupted"),
                   {"clean": clean, "corrupted": corrupted, "answer": answer, "wrong": wrong}, answers[0], answers[1],
                   method, position, top, batch_size, coupled_heads, folder)  # fmt: skip


def measure(job: Effects, echo: Callable[[str], None] = print) -> dict:
    """Run ``head_effects``, print the summary and the top heads, write the three files; return effects.json's dict."""
    from ..io import write_text_atomic
    from ..tools.effects_view import write_effects_html, write_effects_png
    from ..tools.head_effects import head_effects, logit_difference

    texts = job.texts
    metric_name = f"logit difference {texts['answer']!r} - {texts['wrong']!r} at position {job.position}"
    found = head_effects(job.net, job.clean, job.corrupted, metric=logit_difference(job.answer, job.wrong, job.position),
                         method=job.method, batch_size=job.batch_size, coupled_heads=job.coupled_heads,
                         progress=True)  # fmt: skip
    L, H = found.effects.shape
    data = {"source": job.source, "metric": metric_name, "clean_text": texts["clean"],
            "corrupted_text": texts["corrupted"], "answer": {"text": texts["answer"], "id": job.answer},
            "wrong": {"text": texts["wrong"], "id": job.wrong}, "position": job.position, **found.to_dict()}  # fmt: skip
    echo(f"{job.source}: {L} layers x {H} heads, method {job.method}, metric: {metric_name}")
    echo(f"  clean      {found.clean:+.4f}  {texts['clean']!r}")
    if found.corrupted is not None:
        echo(f"  corrupted  {found.corrupted:+.4f}  {texts['corrupted']!r}")
    base = "corrupted" if job.method == "restore" else "clean"
    echo(f"top {min(job.top, L * H)} heads by |effect| (metric with the head replaced minus the {base} run's):")
    echo(f"  {'layer':>5}  {'head':>4}  {'effect':>10}")
    for layer, head, value in found.top(job.top):
        echo(f"  {layer:>5}  {head:>4}  {value:>+10.4f}")
    title = f"{job.source}: {job.method}"
    details = {"metric": metric_name, "clean prompt": texts["clean"]}
    if texts["corrupted"] is not None:
        details["corrupted prompt"] = texts["corrupted"]

    def write(staging: Path) -> None:
        write_effects_html(found, staging / "effects.html", title=title, details=details)
        write_effects_png(found, staging / "effects.png", title=title)
        write_text_atomic(staging / "effects.json", json.dumps(data, indent=2) + "\n")

    write_folder(job.folder, write, OUTPUT_FILES)
    for name in OUTPUT_FILES:
        echo(f"wrote {(job.folder / name).resolve()}")
    return data
