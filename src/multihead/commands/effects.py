"""``multihead effects``: which heads carry a GPT's answer, by replacing one head at a time.

    multihead effects --checkpoint runs/tiny --clean "When Mary and John went to the store, John gave a drink to" \\
        --corrupted "When Mary and John went to the store, Mary gave a drink to" --answer " Mary" --wrong " John"

Encodes both prompts and the two answers (each must be one token) with the
model's tokenizer (a run's, the tokenizer.json beside a checkpoint or in a
GPT-2 ``--hf`` folder, else UTF-8 bytes for a 256-token vocabulary), takes
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
(not a sentence encoder), the output folder (and matplotlib for the PNG),
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
    "Measure every attention head's causal effect on a GPT's answer: the logit difference between --answer "
    "and --wrong (one token each) at the last prompt token, when that head's output alone is replaced before "
    "the output projection: by zeros (zero), by its mean over the clean prompt's positions (mean), by its "
    "output on --corrupted (patch, the clean run; activation patching), or, in the corrupted run, by its "
    "output on --clean (restore). Prints the top heads and writes effects.html (heatmap, values on hover), "
    "effects.png and effects.json into --out. --hf takes a GPT-2 folder. See docs/effects.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead effects``."""
    parser.description = DESCRIPTION
    add_source_arguments(parser, hf_help="a local Hugging Face GPT-2 folder (config.json, model.safetensors, "
                                         "tokenizer.json)")  # fmt: skip
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


def _encode(flag: str, text: str, model, tokenizer) -> list[int]:
    from .generate import encode_prompt

    if not text:
        raise ValueError(f"{flag} is empty: give some text")
    try:
        return encode_prompt(text, model.config.vocab_size, tokenizer)
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: {err}") from None


def _check_gpt2_folder(hf: str) -> None:
    """Refuse an --hf folder that is not a GPT-2 folder, from its config.json alone."""
    from ..hf.folders import model_folder, read_config

    label = f"--hf {hf}"
    folder = model_folder(hf, ("config.json", "tokenizer.json", "model.safetensors"), label=label)
    model_type = read_config(folder, label=label).get("model_type")
    if model_type != "gpt2":
        raise ValueError(
            f"{label}: model_type {model_type!r}; effects loads GPT-2 folders (model_type 'gpt2') into multihead's GPT, "
            "whose head outputs it replaces; other transformers models can only have heads silenced "
            "(multihead.hf.head_mask, the zero method)"
        )


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
    """Check the options and --out, load the GPT, encode the prompts and answers.

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
        _check_gpt2_folder(hf)
    elif family(None, checkpoint, None)[0] != "gpt":
        raise ValueError(f"--checkpoint {checkpoint} is a sentence encoder (BERT); effects reads a GPT's next-token logits")
    loaded = load_source(None, checkpoint, hf)
    net, tokenizer = loaded.net, loaded.hf_tokenizer if loaded.hf_tokenizer is not None else loaded.tokenizer
    check_measurable(net, coupled_heads=coupled_heads)
    ids = {"--clean": _encode("--clean", clean, net, tokenizer)}
    if corrupted is not None:
        ids["--corrupted"] = _encode("--corrupted", corrupted, net, tokenizer)
    limit = net.config.context_length
    for flag, listed in ids.items():
        if len(listed) > limit:
            raise ValueError(f"{flag} encodes to {len(listed)} tokens, more than the model's context_length={limit}")
    if corrupted is not None and method in ("patch", "restore") and len(ids["--clean"]) != len(ids["--corrupted"]):
        raise ValueError(f"--clean encodes to {len(ids['--clean'])} tokens and --corrupted to {len(ids['--corrupted'])}; "
                         f"--method {method} swaps head outputs position by position, so give prompts of the same length")  # fmt: skip
    T = len(ids["--clean"])
    if not -T <= position < T:
        raise ValueError(f"--position {position}: out of range for the clean prompt's {T} tokens")
    answers = []
    for flag, text in (("--answer", answer), ("--wrong", wrong)):
        listed = _encode(flag, text, net, tokenizer)
        if len(listed) != 1:
            raise ValueError(f"{flag} {text!r} encodes to {len(listed)} tokens {listed}; give text that is one token of "
                             "the model's tokenizer (one byte for a byte-level model)")  # fmt: skip
        answers.append(listed[0])
    if answers[0] == answers[1]:
        raise ValueError(f"--answer {answer!r} and --wrong {wrong!r} are the same token {answers[0]}")
    device = next(net.parameters()).device
    tensors = {flag: torch.tensor([listed], device=device) for flag, listed in ids.items()}
    return Effects(net, loaded.source, tokenizer, tensors["--clean"], tensors.get("--corrupted"),
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
