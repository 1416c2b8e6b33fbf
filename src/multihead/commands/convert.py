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

The output folder of a BPE run also gets the run's ``tokenizer.json``:
``multihead generate --checkpoint OUT --tokenizer OUT/tokenizer.json``
(a byte-level model needs no tokenizer). The run's ``tokenizer/`` folder is
not copied as a folder: a folder with ``tokenizer/`` is read as a training
run by ``--checkpoint``.

Mistakes are refused before anything is written: an --out that cannot be
written, G outside [1, H] or not dividing the key/value heads, an unknown
method, "aligned" on a model with rope or qk_norm, calibration options
with "mean", a checkpoint that is not a GPT or whose layers are not
mha/gqa/mqa.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from .paths import output_folder
from .run_dir import run_checkpoint

__all__ = ["run", "TARGETS", "CALIBRATION_BATCH_SIZE", "CALIBRATION_SEED", "DEFAULT_CALIBRATION_BATCHES"]

TARGETS = ("gqa",)
CALIBRATION_BATCH_SIZE = 16
CALIBRATION_SEED = 99
DEFAULT_CALIBRATION_BATCHES = 8
OUTPUT_FILES = ("config.json", "model.safetensors", "report.json", "tokenizer.json")
_FAMILY = ("mha", "gqa", "mqa")


def _check_options(to: str, method: str, calibration_data: str | None, calibration_batches: int | None) -> None:
    from ..tools.convert_heads import METHODS

    if to not in TARGETS:
        raise ValueError(f"--to {to}: unknown target; valid: {', '.join(TARGETS)}")
    if method not in METHODS:
        raise ValueError(f"--method {method}: unknown method; valid: {', '.join(METHODS)}")
    if method == "mean":
        given = [
            f
            for f, v in (("--calibration-data", calibration_data), ("--calibration-batches", calibration_batches))
            if v is not None
        ]
        if given:
            raise ValueError(f'{" and ".join(given)} only go with --method aligned ("mean" uses no calibration)')
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


def _load(checkpoint: str):
    """(model, run directory or None, run tokenizer or None, description)."""
    from ..models.checkpoint import load_checkpoint

    found = run_checkpoint(checkpoint)
    if found is None:
        return load_checkpoint(checkpoint).eval(), None, None, f"checkpoint {checkpoint}"
    step_dir, tokenizer, step = found
    return load_checkpoint(step_dir).eval(), Path(checkpoint), tokenizer, f"run {checkpoint}, step {step}"


def _encode(text: str, model, tokenizer, source: str) -> list[int]:
    if tokenizer is not None:
        return list(tokenizer.encode(text))
    if model.config.vocab_size == 256:
        return list(text.encode("utf-8"))
    raise ValueError(
        f"--calibration-data {source}: the checkpoint's vocabulary has {model.config.vocab_size} tokens, not 256 "
        "bytes, and only a training run brings a tokenizer to encode text with"
    )


def _calibration(model, run_dir: Path | None, tokenizer, data: str | None, count: int) -> list[torch.Tensor]:
    """``count`` token batches [CALIBRATION_BATCH_SIZE, T] of training data."""
    import numpy as np

    from ..train.batches import Batches, read_tokens

    if data is not None:
        from ..train.corpus import load_corpus

        tokens = np.asarray(_encode(load_corpus(data).train, model, tokenizer, data), dtype=np.int64)
        where = f"--calibration-data {data}"
    elif run_dir is not None:
        tokens, where = read_tokens(run_dir / "data" / "train.bin"), f"{run_dir / 'data' / 'train.bin'}"
    else:
        raise ValueError(
            "--method aligned needs calibration text: give --calibration-data shakespeare|FILE "
            "(or --checkpoint a training run, whose data/train.bin is used)"
        )
    T = model.config.context_length
    if tokens.size < T + 1:
        raise ValueError(f"{where}: {tokens.size} tokens, fewer than the context {T} + 1 a calibration window needs")
    batches = Batches(tokens, batch_size=CALIBRATION_BATCH_SIZE, context_length=T, seed=CALIBRATION_SEED)
    return [batches.get(i)[0] for i in range(count)]  # x of each (x, y): (B, T)


def _validation(run_dir: Path):
    """(loss function of a model, description) on the run's fixed validation batches."""
    from ..models.safe_files import read_json_file
    from ..train.batches import read_tokens, val_batches
    from ..train.config import TrainConfig
    from ..train.loop import VAL_SEED, validation_loss
    from ..train.world import World

    config = TrainConfig.from_dict(read_json_file(run_dir / "config.json"))
    sets = val_batches(
        read_tokens(run_dir / "data" / "val.bin"),
        batch_size=config.batch_size,
        context_length=config.context_length,
        num_batches=config.eval_batches,
        seed=VAL_SEED,
    )

    def loss(model) -> float:
        device = next(model.parameters()).device
        value = validation_loss(model, sets, config, World(), device, contextlib.nullcontext)
        model.eval()  # validation_loss leaves the model in training mode
        return value

    where = f"{config.eval_batches} batches x {config.batch_size} x {config.context_length} tokens of data/val.bin"
    return loss, where


def _kv_bytes(model) -> int:
    """KV-cache bytes per token over all layers, at the model's dtype."""
    size = next(model.parameters()).element_size()
    return sum(block.attn.cost(1, bytes_per_element=size).kv_cache_bytes_per_token for block in model.blocks)


def run(
    *,
    to: str,
    num_kv_heads: int,
    checkpoint: str,
    out: str,
    method: str = "mean",
    calibration_data: str | None = None,
    calibration_batches: int | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    """The CLI command: convert, save, report.

    Args:
        to: the target kind ("gqa").
        num_kv_heads: G, the key/value heads of every converted layer.
        checkpoint: a GPT checkpoint or a ``multihead train`` run directory.
        out: the folder for config.json, model.safetensors, report.json
            (and tokenizer.json from a BPE run).
        method: "mean" or "aligned" (``to_gqa``).
        calibration_data: "shakespeare" or a text file ("aligned" only).
        calibration_batches: batches for "aligned" (default
            ``DEFAULT_CALIBRATION_BATCHES``).
        echo: where the report lines go.

    Returns:
        the report (as in report.json).

    Raises:
        ValueError: see the module docstring; nothing is written then.
    """
    from ..models.checkpoint import save_checkpoint
    from ..models.safe_files import write_text_atomic
    from ..tools.convert_heads import to_gqa

    _check_options(to, method, calibration_data, calibration_batches)
    folder = output_folder("--out", out, OUTPUT_FILES)
    model, run_dir, tokenizer, source = _load(checkpoint)
    _check_model(model, num_kv_heads, method)
    run_tokenizer = tokenizer if tokenizer is not None and tokenizer.kind != "bytes" else None
    calibration = None
    if method == "aligned":
        count = DEFAULT_CALIBRATION_BATCHES if calibration_batches is None else calibration_batches
        calibration = _calibration(model, run_dir, run_tokenizer, calibration_data, count)
    validate = _validation(run_dir) if run_dir is not None else None
    new = to_gqa(model, num_kv_heads, method=method, calibration=calibration).eval()
    report = {
        "source": source,
        "method": method,
        "attention": [model.config.attention, new.config.attention],
        "num_heads": model.config.num_heads,
        "num_kv_heads": [model.blocks[0].attn.num_kv_heads, new.blocks[0].attn.num_kv_heads],
        "parameters": [model.num_parameters(), new.num_parameters()],
        "kv_cache_bytes_per_token": [_kv_bytes(model), _kv_bytes(new)],
        "calibration_batches": None if calibration is None else len(calibration),
        "val_loss": None,
        "val_batches": None,
    }
    if validate is not None:
        loss, where = validate
        report["val_loss"], report["val_batches"] = [loss(model), loss(new)], where
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(new, folder)
    if run_tokenizer is not None:
        text = (run_dir / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8")
        write_text_atomic(folder / "tokenizer.json", text)
    write_text_atomic(folder / "report.json", json.dumps(report, indent=2) + "\n")
    _print(report, folder, run_tokenizer is not None, echo)
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
    if report["val_batches"] is not None:
        echo(f"  (validation: {report['val_batches']})")
    echo(
        f"wrote {folder.resolve()} (config.json, model.safetensors, report.json"
        f"{', tokenizer.json' if has_tokenizer else ''})"
    )
    extra = f" --tokenizer {folder / 'tokenizer.json'}" if has_tokenizer else ""
    echo(f'try: multihead generate --checkpoint {folder}{extra} "To be"')
