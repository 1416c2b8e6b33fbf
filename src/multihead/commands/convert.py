"""``multihead convert --to gqa``: a GPT checkpoint converted to grouped-query attention.

    multihead convert --to gqa --num-kv-heads 2 --checkpoint runs/mini --out runs/mini-gqa2

Loads a GPT checkpoint (``config.json`` + ``model.safetensors``) or the run
directory of ``multihead train`` (its latest checkpoint), converts every
attention layer with ``multihead.tools.convert_heads.to_gqa``, saves the
result with ``save_checkpoint`` (atomically) into ``--out`` and prints a
report, also written to ``--out/report.json``::

    parameters                 before and after (``GPT.num_parameters``)
    KV-cache bytes per token   all layers' ``cost()``, at the model's dtype
    validation loss            run directory only: the run's own fixed
                               validation batches (data/val.bin, VAL_SEED,
                               its batch size, context and eval_batches)

Calibration for ``--method aligned``: ``--calibration-batches`` batches of
``CALIBRATION_BATCH_SIZE`` windows drawn (seed ``CALIBRATION_SEED``) from
the run's data/train.bin, or from the training part of
``--calibration-data`` (``shakespeare`` or a UTF-8 file) encoded with the
run's tokenizer, or as bytes for a byte-level checkpoint.

The output folder of a BPE run (or of a checkpoint folder with its
tokenizer.json) also gets that ``tokenizer.json``, beside config.json:
``multihead generate --checkpoint OUT`` and ``multihead inspect --checkpoint
OUT`` read it from there (``run_dir``); a byte-level model needs none.

Mistakes are refused before anything is written: an --out that cannot be
written, G outside [1, H] or not dividing the key/value heads, an unknown
method, "aligned" on a model with rope or qk_norm, calibration options
with "mean", a checkpoint that is not a GPT or whose layers are not
mha/gqa/mqa. ``--import MODULE`` is imported first (a checkpoint of a kind
from the user's own package).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..tools.convert_heads import METHODS
from .checking import checking
from .gpt_inputs import (
    CALIBRATION_BATCH_SIZE,
    CALIBRATION_SEED,
    calibration_windows,
    load_gpt,
    tokenizer_json,
    validation,
    write_outputs,
)
from .imports import add_import_argument, import_modules
from .paths import output_folder
from .recovery_option import add_recover_steps, check_recover_steps, describe, recover_model

__all__ = [
    "add_arguments", "run", "Conversion", "prepare", "convert", "TARGETS", "CALIBRATION_BATCH_SIZE",
    "CALIBRATION_SEED", "DEFAULT_CALIBRATION_BATCHES",
]  # fmt: skip

TARGETS = ("gqa",)
DEFAULT_CALIBRATION_BATCHES = 8
OUTPUT_FILES = ("config.json", "model.safetensors", "report.json", "tokenizer.json")
_FAMILY = ("mha", "gqa", "mqa")
DESCRIPTION = (
    "Load a GPT checkpoint or the run directory of 'multihead train', give every attention layer "
    "G key/value heads (mean: average each group's key and value projections; aligned: rotate the "
    "heads onto each other first, from calibration data), save the converted checkpoint into --out "
    "and print parameters and KV-cache bytes per token before and after, and for a run directory the "
    "validation loss on the run's own validation batches; report.json holds the same. A BPE run's "
    "tokenizer.json is copied beside the checkpoint. See docs/surgery.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead convert``."""
    parser.description = DESCRIPTION
    parser.add_argument("--to", required=True, metavar="KIND", help=f"target attention: {', '.join(TARGETS)}")
    parser.add_argument(
        "--num-kv-heads", type=int, required=True, metavar="G", help="key/value heads per layer, dividing H"
    )
    parser.add_argument("--method", default="mean", metavar="M", help=f"{' or '.join(METHODS)} (default mean)")
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="a GPT checkpoint, or the run directory of 'multihead train'",
    )  # fmt: skip
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the converted checkpoint and report.json")
    parser.add_argument(
        "--calibration-data", metavar="SOURCE",
        help="aligned or recovery: shakespeare or a UTF-8 text file (default: a run directory's data/train.bin)",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-batches", type=int, metavar="N",
        help=f"aligned or recovery: batches of {CALIBRATION_BATCH_SIZE} windows "
        f"(default {DEFAULT_CALIBRATION_BATCHES})",
    )  # fmt: skip
    add_recover_steps(parser)
    add_import_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``multihead convert``: check the options, load the checkpoint and the calibration data, then convert."""
    with checking():
        import_modules(args.imports)
        job = prepare(
            to=args.to, num_kv_heads=args.num_kv_heads, checkpoint=args.checkpoint, out=args.out,
            method=args.method, calibration_data=args.calibration_data,
            calibration_batches=args.calibration_batches, recover_steps=args.recover_steps,
        )  # fmt: skip
    convert(job)
    return 0


def _check_options(to: str, method: str, calibration_data: str | None, calibration_batches: int | None,
                   recover_steps: int) -> None:  # fmt: skip
    if to not in TARGETS:
        raise ValueError(f"--to {to}: unknown target; valid: {', '.join(TARGETS)}")
    if method not in METHODS:
        raise ValueError(f"--method {method}: unknown method; valid: {', '.join(METHODS)}")
    check_recover_steps(recover_steps)
    if method == "mean" and not recover_steps:
        given = [
            f
            for f, v in (("--calibration-data", calibration_data), ("--calibration-batches", calibration_batches))
            if v is not None
        ]
        if given:
            raise ValueError(f'{" and ".join(given)} only go with --method aligned or --recover-steps '
                             '("mean" uses no calibration)')
    if calibration_batches is not None and calibration_batches < 1:
        raise ValueError(f"--calibration-batches {calibration_batches}: give a number >= 1")


def _check_model(model, num_kv_heads: int, method: str) -> None:
    """The to_gqa refusals, worded with the command's flags."""
    from ..models.gpt import GPT

    if not isinstance(model, GPT):
        raise ValueError(f"the checkpoint holds a {type(model).__name__}, not a GPT")
    H = model.config.num_heads
    if not 1 <= num_kv_heads <= H:
        raise ValueError(f"--num-kv-heads {num_kv_heads} out of range: the model has {H} heads, so G is in 1..{H}")
    if H % num_kv_heads:
        raise ValueError(f"--num-kv-heads {num_kv_heads} does not divide the model's {H} heads")
    for i, block in enumerate(model.blocks):
        attn = block.attn
        kind = getattr(attn, "kind", type(attn).__name__)
        if kind not in _FAMILY:
            raise ValueError(
                f"layer {i} is attention kind {kind!r}, which has no key/value heads to merge; "
                f"convert takes {', '.join(_FAMILY)} layers"
            )
        if attn.num_kv_heads % num_kv_heads:
            raise ValueError(
                f"--num-kv-heads {num_kv_heads} does not divide layer {i}'s {attn.num_kv_heads} key/value heads"
            )
        if method == "aligned" and (attn.rope is not None or attn.qk_norm is not None):
            raise ValueError(
                f"--method aligned rotates keys, which does not commute with rope or qk_norm (layer {i} has "
                f"rope={attn.rope is not None}, qk_norm={attn.qk_norm is not None}): use --method mean"
            )


def _kv_bytes(model) -> int:
    """KV-cache bytes per token over all layers, at the model's dtype."""
    size = next(model.parameters()).element_size()
    return sum(block.attn.cost(1, bytes_per_element=size).kv_cache_bytes_per_token for block in model.blocks)


@dataclass
class Conversion:
    """What ``prepare`` checked and loaded for ``convert``."""

    model: nn.Module
    num_kv_heads: int
    method: str
    folder: Path
    source: str
    calibration: list | None
    validate: tuple | None  # (loss function of a model, description) on a run's validation batches
    recover_steps: int
    tokenizer_file: Path | None  # a BPE run's tokenizer.json, copied beside the converted checkpoint


def prepare(
    *,
    to: str,
    num_kv_heads: int,
    checkpoint: str,
    out: str,
    method: str = "mean",
    calibration_data: str | None = None,
    calibration_batches: int | None = None,
    recover_steps: int = 0,
) -> Conversion:
    """Check the options and --out, load the checkpoint and the calibration data.

    Args:
        to: the target kind ("gqa").
        num_kv_heads: G, the key/value heads of every converted layer.
        checkpoint: a GPT checkpoint or a ``multihead train`` run directory.
        out: the folder for config.json, model.safetensors, report.json
            (and tokenizer.json from a BPE run).
        method: "mean" or "aligned" (``to_gqa``).
        calibration_data: "shakespeare" or a text file ("aligned" and recovery).
        calibration_batches: batches for "aligned" and recovery (default
            ``DEFAULT_CALIBRATION_BATCHES``).
        recover_steps: steps of distillation towards the original after the
            conversion, on the calibration batches (``recovery_option``); 0: none.

    Raises:
        ValueError: see the module docstring; nothing is written.
    """
    _check_options(to, method, calibration_data, calibration_batches, recover_steps)
    folder = output_folder("--out", out, OUTPUT_FILES)
    model, run_dir, tokenizer, source = load_gpt(checkpoint)
    _check_model(model, num_kv_heads, method)
    run_tokenizer = tokenizer if tokenizer is not None and tokenizer.kind != "bytes" else None
    calibration = None
    if method == "aligned" or recover_steps:
        count = DEFAULT_CALIBRATION_BATCHES if calibration_batches is None else calibration_batches
        calibration = calibration_windows(model, run_dir, run_tokenizer, calibration_data, count)
    validate = validation(run_dir) if run_dir is not None else None
    tokenizer_file = tokenizer_json(checkpoint, run_dir) if run_tokenizer is not None else None
    return Conversion(model, num_kv_heads, method, folder, source, calibration, validate, recover_steps, tokenizer_file)


def convert(job: Conversion, echo: Callable[[str], None] = print) -> dict:
    """Convert, distil back when asked, save, print and return the report (as in report.json)."""
    from ..models.checkpoint import save_checkpoint
    from ..tools.convert_heads import to_gqa

    model, method, calibration, validate = job.model, job.method, job.calibration, job.validate
    new = to_gqa(model, job.num_kv_heads, method=method, calibration=calibration if method == "aligned" else None).eval()
    recovery = None
    if job.recover_steps:
        before = None if validate is None else validate[0](new)
        recovery = recover_model(new, model, calibration, "gpt", job.recover_steps)
        recovery["before"] = before
    report = {
        "source": job.source,
        "method": method,
        "attention": [model.config.attention, new.config.attention],
        "num_heads": model.config.num_heads,
        "num_kv_heads": [model.blocks[0].attn.num_kv_heads, new.blocks[0].attn.num_kv_heads],
        "parameters": [model.num_parameters(), new.num_parameters()],
        "kv_cache_bytes_per_token": [_kv_bytes(model), _kv_bytes(new)],
        "calibration_batches": None if calibration is None else len(calibration),
        "val_loss": None,
        "val_batches": None,
        "recovery": recovery,
    }
    if validate is not None:
        loss, where = validate
        report["val_loss"], report["val_batches"] = [loss(model), loss(new)], where
    write_outputs(job.folder, lambda f: save_checkpoint(new, f), report, job.tokenizer_file)
    _print(report, job.folder, job.tokenizer_file is not None, echo)
    return report


def _print(report: dict, folder: Path, has_tokenizer: bool, echo: Callable[[str], None]) -> None:
    (a0, a1), (g0, g1) = report["attention"], report["num_kv_heads"]
    echo(
        f"{report['source']}: {a0} ({g0} key/value heads) -> {a1} ({g1}), method {report['method']}, "
        f"{report['num_heads']} query heads"
    )
    rows = [("parameters", *report["parameters"]), ("KV-cache bytes/token", *report["kv_cache_bytes_per_token"])]
    if report["val_loss"] is not None:
        rows.append(("val loss (nats/token)", *(f"{v:.4f}" for v in report["val_loss"])))
    width = max(len(r[0]) for r in rows)
    echo(f"  {'':<{width}}  {'before':>12}  {'after':>12}")
    for name, before, after in rows:
        echo(f"  {name:<{width}}  {before!s:>12}  {after!s:>12}")
    if report["recovery"] is not None:
        echo(describe(report["recovery"]))
    if report["val_batches"] is not None:
        echo(f"  (validation: {report['val_batches']})")
    echo(
        f"wrote {folder.resolve()} (config.json, model.safetensors, report.json"
        f"{', tokenizer.json' if has_tokenizer else ''})"
    )
    echo(f'try: multihead generate --checkpoint {folder} "To be"')
