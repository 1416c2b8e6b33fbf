"""``multihead convert --to gqa|mqa|mla``: a model's attention converted to grouped-query or latent attention.

    multihead convert --to gqa --num-kv-heads 2 --checkpoint runs/mini --out runs/mini-gqa2
    multihead convert --to mqa --model minilm-l6 --out minilm-mqa
    multihead convert --to mla --kv-rank 128 --model minilm-l6 --out minilm-mla128
    multihead convert --to gqa --num-kv-heads 4 --hf path/to/bert-or-gpt2 --out converted

Takes the same models as ``multihead prune`` (``model_sources``): the
pretrained MiniLM (``--model minilm-l6``), a GPT checkpoint or the run
directory of ``multihead train`` (its latest checkpoint), a folder that
prune or convert wrote (``--checkpoint``, GPT or sentence encoder), or a
Hugging Face BERT or GPT-2 folder (``--hf``). ``--to mqa`` is G = 1.
Every attention layer is converted with
``multihead.tools.convert_heads.to_gqa`` (a pruned model layer by layer;
G must divide every layer's key/value heads), or with ``--to mla`` by
``multihead.tools.convert_mla.to_mla`` into an "mla" layer whose keys and
values come from one latent of ``--kv-rank`` r channels (``--method
activation``, the default, or ``svd``; the model must have no rope, qk_norm
or sinks, r is at most 2·G·D of every layer); the result is saved into
``--out`` and a report printed, also written to ``--out/report.json``::

    parameters                 before and after
    KV cache                   bytes per token over all layers, at the model's
                               dtype (``tools.flops.kv_cache_size``); with local
                               layers also one sequence's bytes at the model's
                               context (``surgery_report``)
    validation loss            a GPT run: the run's own fixed validation batches
                               (data/val.bin, VAL_SEED, its batch size, context
                               and eval_batches); a GPT-2 --hf folder: windows of
                               the Shakespeare validation text (``prune_hf``)
    fidelity                   an encoder: mean cosine and top-10 neighbour
                               agreement on --heldout-lines held-out Shakespeare
                               lines (``encoder_inputs``), as prune reports them

Calibration for ``--method aligned`` or ``activation`` (and ``--recover-steps``): GPT:
``--calibration-batches`` batches of ``CALIBRATION_BATCH_SIZE`` windows
drawn (seed ``CALIBRATION_SEED``) from the run's data/train.bin, or from the
training part of ``--calibration-data`` (``shakespeare`` or a UTF-8 file)
encoded with the run's tokenizer, or as bytes for a byte-level checkpoint;
a GPT-2 folder: windows of the Shakespeare training text through its
tokenizer.json. Encoder: that many batches of ``CALIBRATION_BATCH_SIZE``
first lines of the calibration pairs (``encoder_inputs``).

The output folder of a BPE model also gets its ``tokenizer.json`` beside
config.json, an encoder its own; a pruned model's report.json keeps the
prune report's "removed" heads, so ``inspect`` still shows each head where
it was. ``--checkpoint OUT`` opens it in every
command and ``multihead.models.load_model`` in Python. The folder is
written whole (``staged_output``): Ctrl-C or SIGTERM leaves no part of it,
prints one line and exits with 130 or 143.

Mistakes are refused before anything is written: an --out that cannot be
written, not exactly one model source, G outside the layers' head counts or
not dividing their key/value heads, an unknown target or method, "aligned"
on a model with rope or qk_norm, calibration options with "mean" or "svd",
--kv-rank without --to mla or outside 1..2·G·D, --to mla on a model with
rope, qk_norm or sinks,
--calibration-data for an encoder or a GPT-2 folder, --heldout-lines for a
GPT, layers that are not mha/gqa/mqa. ``--import MODULE`` is imported first
(a checkpoint of a kind from the user's own package).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..paths import output_folder
from ..tools.convert_heads import METHODS
from ..tools.convert_mla import MLA_METHODS
from .checking import checking
from .convert_options import (
    TARGETS,
    UNCALIBRATED,
    check_family_options,
    check_gqa_model,
    check_mla_model,
    check_options,
    model_layers,
)
from .encoder_inputs import HELDOUT_LINES, shakespeare_lines
from .gpt_inputs import (
    CALIBRATION_BATCH_SIZE,
    CALIBRATION_SEED,
    OUTPUT_FILES,
    calibration_windows,
    validation,
    write_outputs,
)
from .imports import add_import_argument, import_modules
from .model_sources import HF_FOLDER, MODELS, add_source_arguments, check_sources, family, load_source
from .recovery_option import add_recover_steps, recover_model
from .staged_output import interruptible
from .surgery_report import echo_measurements, kv_cache_entries, kv_cache_rows

__all__ = [
    "add_arguments", "run", "Conversion", "prepare", "convert", "TARGETS", "CALIBRATION_BATCH_SIZE",
    "CALIBRATION_SEED", "DEFAULT_CALIBRATION_BATCHES",
]  # fmt: skip

DEFAULT_METHOD = {"gqa": "mean", "mqa": "mean", "mla": "activation"}
DEFAULT_CALIBRATION_BATCHES = 8
BATCH_SIZE = 64  # encoder lines per forward pass of the fidelity
DESCRIPTION = (
    "Give every attention layer of a model G key/value heads (--to mqa: one), or with --to mla one latent of "
    "--kv-rank channels for its keys and values: the pretrained MiniLM "
    "(--model), a GPT checkpoint, the run directory of 'multihead train' or a folder prune or convert wrote "
    "(--checkpoint), or a Hugging Face BERT or GPT-2 folder (--hf). mean: average each group's key and value "
    "projections; aligned: rotate the heads onto each other first, from calibration data; mla: activation "
    "(default) or svd, a joint low-rank factorisation of the key and value projections. Saves the "
    "converted model into --out (whole or not at all) and prints parameters and KV-cache bytes per token "
    "before and after, the validation loss (a GPT run, GPT-2) or the held-out fidelity (an encoder); "
    "report.json holds the same. Examples: multihead convert --to mqa --model minilm-l6 --out minilm-mqa; "
    "multihead convert --to gqa --num-kv-heads 2 --hf path/to/gpt2 --out gpt2-gqa; "
    "multihead convert --to mla --kv-rank 128 --model minilm-l6 --out minilm-mla128. See docs/surgery.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead convert``."""
    parser.description = DESCRIPTION
    parser.add_argument("--to", required=True, metavar="KIND", help=f"target attention: {', '.join(TARGETS)}")
    parser.add_argument(
        "--num-kv-heads", type=int, metavar="G", help="key/value heads per layer, dividing H (--to mqa: 1)"
    )
    parser.add_argument("--kv-rank", type=int, metavar="R", help="--to mla: channels of the shared key/value latent")
    parser.add_argument(
        "--method", metavar="M",
        help=f"gqa, mqa: {' or '.join(METHODS)} (default mean); mla: {' or '.join(MLA_METHODS)} (default activation)",
    )  # fmt: skip
    parser.add_argument("--model", metavar="NAME", help=f"a pretrained model: {', '.join(MODELS)}")
    add_source_arguments(parser, hf_help=HF_FOLDER)
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the converted model and report.json")
    parser.add_argument(
        "--calibration-data", metavar="SOURCE",
        help="GPT checkpoint, aligned, activation or recovery: shakespeare or a UTF-8 text file "
        "(default: a run directory's data/train.bin)",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-batches", type=int, metavar="N",
        help=f"aligned, activation or recovery: batches of {CALIBRATION_BATCH_SIZE} windows or lines "
        f"(default {DEFAULT_CALIBRATION_BATCHES})",
    )  # fmt: skip
    parser.add_argument(
        "--heldout-lines", type=int, metavar="N",
        help=f"encoders (MiniLM, BERT): held-out lines of the fidelity (default {HELDOUT_LINES})",
    )  # fmt: skip
    add_recover_steps(parser)
    add_import_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``multihead convert``: check the options, load the model and its data, then convert."""

    def body() -> int:
        with checking():
            import_modules(args.imports)
            job = prepare(
                to=args.to, num_kv_heads=args.num_kv_heads, out=args.out, model=args.model,
                checkpoint=args.checkpoint, hf=args.hf, method=args.method, calibration_data=args.calibration_data,
                calibration_batches=args.calibration_batches, heldout_lines=args.heldout_lines,
                recover_steps=args.recover_steps, kv_rank=args.kv_rank,
            )  # fmt: skip
        convert(job)
        return 0

    return interruptible("multihead convert", args.out, body)


@dataclass
class Conversion:
    """What ``prepare`` checked and loaded for ``convert``.

    ``calibration``: GPT windows [B, T] or encoder line batches (lists of
    str); ``validate``: a GPT's (loss function of a model, description);
    ``pairs``/``heldout``: an encoder's calibration pairs and held-out lines.
    """

    model: nn.Module
    num_kv_heads: int | None  # None: --to mla
    method: str
    folder: Path
    source: str
    calibration: list | None
    validate: tuple | None
    recover_steps: int
    tokenizer_file: Path | None  # a BPE model's tokenizer.json, copied beside the converted checkpoint
    encoder: bool = False
    pooling: str | None = None
    pairs: list | None = None
    heldout: list | None = None
    removed: dict | None = None  # the heads a pruned --checkpoint lost, from its prune report
    kv_rank: int | None = None  # --to mla: the latent's channels


def prepare(
    *,
    to: str,
    num_kv_heads: int | None,
    out: str,
    model: str | None = None,
    checkpoint: str | None = None,
    hf: str | None = None,
    method: str | None = None,
    calibration_data: str | None = None,
    calibration_batches: int | None = None,
    heldout_lines: int | None = None,
    recover_steps: int = 0,
    kv_rank: int | None = None,
) -> Conversion:
    """Check the options and --out, load the model and its calibration and measuring data.

    Args:
        to: the target kind, "gqa", "mqa" or "mla".
        num_kv_heads: G, the key/value heads of every converted layer (None with "mqa", "mla").
        out: the folder for the converted model and report.json.
        model, checkpoint, hf: exactly one model source (``model_sources``).
        method: "mean" or "aligned" (``to_gqa``), "activation" or "svd"
            (``to_mla``); None: the target's default (mean, activation).
        calibration_data: a GPT checkpoint's calibration text: "shakespeare" or a file.
        calibration_batches: batches for "aligned" and recovery (default
            ``DEFAULT_CALIBRATION_BATCHES``).
        heldout_lines: an encoder's held-out lines (None: ``HELDOUT_LINES``).
        recover_steps: steps of distillation towards the original after the
            conversion, on the calibration batches (``recovery_option``); 0: none.
        kv_rank: "mla": the latent's channels r.

    Raises:
        ValueError: see the module docstring; nothing is written.
    """
    check_sources(model, checkpoint, hf)
    method = DEFAULT_METHOD.get(to, "mean") if method is None else method
    G = check_options(to, num_kv_heads, method, calibration_data, calibration_batches, heldout_lines, recover_steps,
                       kv_rank)  # fmt: skip
    folder = output_folder("--out", out, OUTPUT_FILES)
    kind, _ = family(model, checkpoint, hf, command="convert")
    check_family_options(kind, hf, calibration_data, heldout_lines)
    loaded = load_source(model, checkpoint, hf, command="convert")
    net = loaded.net
    if to == "mla":
        check_mla_model(net, kv_rank)
    else:
        check_gqa_model(net, G, method)
    removed = None if checkpoint is None else _pruned_heads(Path(checkpoint), model_layers(net)[0].layer_heads)
    count = DEFAULT_CALIBRATION_BATCHES if calibration_batches is None else calibration_batches
    calibrate = method not in UNCALIBRATED or recover_steps
    if loaded.encoder:
        held = HELDOUT_LINES if heldout_lines is None else heldout_lines
        pairs, heldout = shakespeare_lines(net, count * CALIBRATION_BATCH_SIZE if calibrate else 0, held)
        step = CALIBRATION_BATCH_SIZE
        lines = [[a for a, _ in pairs[i : i + step]] for i in range(0, len(pairs), step)] if calibrate else None
        return Conversion(net, G, method, folder, loaded.source, lines, None, recover_steps, None, True,
                          loaded.pooling, pairs, heldout, removed, kv_rank)  # fmt: skip
    calibration = validate = None
    if loaded.hf_tokenizer is not None:
        from . import prune_hf

        if calibrate:
            calibration = prune_hf.gpt2_calibration(net, loaded.hf_tokenizer, count, CALIBRATION_BATCH_SIZE,
                                                    CALIBRATION_SEED, hf)  # fmt: skip
        validate = prune_hf.gpt2_validation(net, loaded.hf_tokenizer, CALIBRATION_BATCH_SIZE, hf)
    else:
        if calibrate:
            calibration = calibration_windows(net, loaded.run_dir, loaded.tokenizer, calibration_data, count)
        validate = validation(loaded.run_dir) if loaded.run_dir is not None else None
    return Conversion(net, G, method, folder, loaded.source, calibration, validate, recover_steps,
                      loaded.tokenizer_file, removed=removed, kv_rank=kv_rank)  # fmt: skip


def _pruned_heads(folder: Path, counts: list[int] | None) -> dict | None:
    """The "removed" table of the prune report beside a pruned checkpoint, when it describes it
    (its layer_heads are the model's): kept in convert's report, so inspect still places each head."""
    from ..io import read_json_file

    if counts is None or not (folder / "report.json").is_file():
        return None
    try:
        report = read_json_file(folder / "report.json")
    except (OSError, ValueError):
        return None
    removed = report.get("removed")
    return removed if report.get("layer_heads") == counts and isinstance(removed, dict) else None


def convert(job: Conversion, echo: Callable[[str], None] = print) -> dict:
    """Convert, distil back when asked, measure, save, print and return the report (as in report.json)."""
    from ..tools.convert_heads import to_gqa
    from ..tools.convert_mla import to_mla
    from ..tools.objectives import anchor_batches

    model, method, calibration = job.model, job.method, job.calibration
    data = None if method in UNCALIBRATED else calibration
    if job.kv_rank is not None:
        new = to_mla(model, job.kv_rank, method=method, calibration=data).eval()
    else:
        new = to_gqa(model, job.num_kv_heads, method=method, calibration=data).eval()
    measure = _fidelity(model, job.heldout) if job.encoder else None if job.validate is None else job.validate[0]
    recovery = None
    if job.recover_steps:
        before = None if measure is None else measure(new)
        batches = anchor_batches(new, job.pairs) if job.encoder else calibration
        recovery = recover_model(new, model, batches, "encoder" if job.encoder else "gpt", job.recover_steps)
        recovery["before"] = before
    (config0, layers0), (config1, layers1) = model_layers(model), model_layers(new)
    report = {
        "source": job.source,
        "method": method,
        "attention": [config0.attention, config1.attention],
        "num_heads": config0.num_heads,
        "layer_heads": config1.layer_heads,
        "removed": job.removed,
        "num_kv_heads": [layers0[0].num_kv_heads, None if job.kv_rank is not None else layers1[0].num_kv_heads],
        "kv_rank": job.kv_rank,
        "parameters": [_count(model), _count(new)],
        **kv_cache_entries(model, new),
        "calibration_batches": None if calibration is None else len(calibration),
        "val_loss": None,
        "val_batches": None,
        "fidelity": None if measure is None or not job.encoder else measure(new),
        "pooling": job.pooling,
        "recovery": recovery,
    }
    if job.validate is not None:
        report["val_loss"], report["val_batches"] = [measure(model), measure(new)], job.validate[1]
    write_outputs(job.folder, lambda f: _save(new, f), report, job.tokenizer_file)
    _print(report, job.folder, job.encoder, job.tokenizer_file is not None, echo)
    return report


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _fidelity(original, heldout: list[str]):
    """Mean cosine and top-10 neighbour agreement of a model's embeddings of ``heldout`` with the original's."""
    from ..tools.fidelity import fidelity

    reference = original.encode(heldout, batch_size=BATCH_SIZE)  # (N, C)

    def measure(m) -> dict:
        cos, agree = fidelity(reference, m.encode(heldout, batch_size=BATCH_SIZE))
        return {"lines": len(heldout), "mean_cosine": cos, "neighbours_top10": agree}

    return measure


def _save(model, folder: Path) -> None:
    from ..models.checkpoint import save_checkpoint
    from ..models.gpt import GPT
    from ..models.minilm import save_sentence_encoder

    if isinstance(model, GPT):
        save_checkpoint(model, folder)
    else:
        save_sentence_encoder(model, folder)


def _print(report: dict, folder: Path, encoder: bool, has_tokenizer: bool, echo: Callable[[str], None]) -> None:
    (a0, a1), (g0, g1) = report["attention"], report["num_kv_heads"]
    after = f"a latent of {report['kv_rank']} channels" if report.get("kv_rank") is not None else g1
    echo(
        f"{report['source']}: {a0} ({g0} key/value heads) -> {a1} ({after}), method {report['method']}, "
        f"{report['num_heads']} query heads" + (f" (per layer {report['layer_heads']})" if report["layer_heads"] else "")
    )
    rows = [("parameters", *report["parameters"]), *kv_cache_rows(report)]
    if report["val_loss"] is not None:
        rows.append(("val loss (nats/token)", *(f"{v:.4f}" for v in report["val_loss"])))
    width = max(len(r[0]) for r in rows)
    echo(f"  {'':<{width}}  {'before':>12}  {'after':>12}")
    for name, before, after in rows:
        echo(f"  {name:<{width}}  {before!s:>12}  {after!s:>12}")
    echo_measurements(report, echo)
    names = ", ".join(n for n in OUTPUT_FILES if (folder / n).is_file())
    echo(f"wrote {folder.resolve()} ({names})")
    if encoder:
        echo(f'try: multihead inspect --checkpoint {folder} "The law will never be perfect."')
    else:
        echo(f'try: multihead generate --checkpoint {folder} "To be"')
