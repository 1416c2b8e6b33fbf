"""``multihead train``: train a GPT on a text corpus into a run directory.

Every flag sets the ``TrainConfig`` field of the same name (``--batch-size``
-> ``batch_size``); a flag that is not given leaves the field at the
dataclass's own default, so the numbers live in one place
(``multihead.train.config``)::

    multihead train --preset tiny --attention gqa --attention-option num_kv_heads=2
        -> TrainConfig(preset="tiny", attention="gqa", attention_options={"num_kv_heads": 2})

``--attention-option K=V`` reads V as JSON when it parses as JSON (``16``,
``0.5``, ``true``, ``null``, ``"16"``, ``[1, 2]``) and as a plain string
otherwise (``mode=fast``); the flag repeats, one option each time.
``--layer-attention-options JSON`` gives blocks options of their own over
those: a JSON list of dicts, one per block or a shorter list that repeats
(``'[{"window": 64}, {}]'``: local and global layers alternating).

With ``--resume`` the fields not given on the command line come from the
run's latest checkpoint instead (the config it was trained with, which
``config.json`` repeats), so ``multihead train --out runs/x --resume
--max-steps 2000`` continues run x with its settings and a longer schedule; a
flag that changes what a step computes (``--lr``, ``--preset``, ...) is
refused by the loop, which compares the config with the checkpoint's, and a
``--max-steps`` below the checkpoint's step is refused here. A longer
``--max-steps`` stretches the cosine schedule: the loop prints the learning
rate of the next step before and after.

Ctrl-C (SIGINT) or SIGTERM: the loop finishes its step and writes a
checkpoint; the command prints one line with the command that resumes and
exits with 130 (SIGINT) or 143 (SIGTERM). A NaN or infinite loss stops the
run at that step with nothing of it written (``multihead.train.divergence``):
one line names the step, the loss and the last good checkpoint; exit status 3.

Everything a user can get wrong is checked before anything is written: the
configuration (``TrainConfig`` validates itself), the data file, the
``--out`` folder and, with ``--resume``, that ``--out`` holds a checkpoint.
Under ``torchrun`` every process runs the same command; only rank 0 prints
the summary and the one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..paths import input_file, output_folder
from ..train.config import DEFAULT_CONTEXT, DEFAULT_WARMUP, TrainConfig
from .checking import checking
from .imports import add_import_argument, import_modules

__all__ = [
    "FLAGS", "OTHER_FIELDS", "add_arguments", "parse_attention_options", "parse_layer_options", "config_values",
    "resume_values",
    "check_config", "run", "summary", "is_rank_zero", "resume_command",
]  # fmt: skip

BUILTIN_DATA = "shakespeare"
TRY_PROMPT = "To be"
DESCRIPTION = (
    "Train a GPT preset with the chosen attention kind on Shakespeare's plays (downloaded once) "
    "or a UTF-8 text file, tokenized as bytes or BPE: AdamW, linear warm-up then cosine decay, "
    "validation loss every --eval-every steps. The run directory (--out) gets config.json, the "
    "tokenizer, the token files, metrics.jsonl and crash-safe checkpoints; --resume continues "
    "from the latest one with the same config; Ctrl-C or SIGTERM stops after the current step with a "
    "checkpoint and prints the command that resumes. --init-from DIR fine-tunes a Hugging Face GPT-2 "
    "folder with its tokenizer. --track-heads scores every head's causal roles (induction, ...) at each "
    "evaluation; 'multihead heads RUN_DIR' plots them. Each flag sets the TrainConfig field of the same "
    "name; a flag left out keeps TrainConfig's default. --import MODULE brings the attention kinds "
    "of your own package. Under torchrun every process runs this "
    "command (data parallel, the same global --batch-size; --shard: FSDP2). See docs/training.md."
)


def parse_layer_options(text: str) -> list[dict[str, Any]]:
    """``'[{"window": 64}, {}]'`` -> ``[{"window": 64}, {}]`` (``--layer-attention-options``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not a non-empty list of dicts
            (the message names the text; the parser prints it as one line).
    """
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, list) or not value or not all(isinstance(d, dict) for d in value):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a JSON list of dicts of option name -> value, one per block or a pattern that "
            """repeats, e.g. '[{"window": 64}, {}]'"""
        )
    return value


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag and the ``TrainConfig`` field it sets.

    A ``bool`` field becomes a pair ``--name`` / ``--no-name`` (True / False),
    so a resumed run can also switch it off; neither keeps the default.
    """

    field: str
    type: Callable[[str], Any]
    metavar: str
    help: str
    when_none: str = ""  # what a None default means, for the help

    @property
    def name(self) -> str:
        return "--" + self.field.replace("_", "-")


FLAGS: tuple[Flag, ...] = (
    Flag("data", str, "shakespeare|PATH", "'shakespeare' (the plays, split by play) or a UTF-8 text file"),
    Flag("tokenizer", str, "bytes|bpe", "UTF-8 bytes (vocab 256) or byte-level BPE learned from the training text",
         "bytes; with --init-from the folder's"),
    Flag("vocab_size", int, "N", "BPE vocabulary size (>= 257)", "the tokenizer's own"),
    Flag("preset", str, "NAME", "GPT preset (model size)", "mini; with --init-from the folder's model"),
    Flag("init_from", str, "DIR", "fine-tune a Hugging Face GPT-2 folder (config.json, model.safetensors, "
         "tokenizer.json): its model, weights, tokenizer and context length", "a fresh model"),
    Flag("attention", str, "KIND", "attention kind of every block"),
    Flag("layer_attention_options", parse_layer_options, "JSON",
         """options per block over --attention-option, a JSON list of dicts; a shorter list repeats """
         """('[{"window": 64}, {}]': local and global layers)""", "every block alike"),
    Flag("positions", str, "learned|rope|alibi|none",
         "token positions: GPT-2's learned table, or no table with rope or ALiBi in every block, or nothing "
         "(without a table, 'multihead generate --streaming' runs past the context)"),
    Flag("context_length", int, "T", "tokens per sequence (at most the model's)",
         f"{DEFAULT_CONTEXT}, at most the preset's; with --init-from the folder's"),
    Flag("batch_size", int, "B", "sequences per optimizer step, over all processes and micro-batches"),
    Flag("grad_accum", int, "N", "micro-batches per optimizer step"),
    Flag("max_steps", int, "N", "optimizer steps"),
    Flag("lr", float, "LR", "peak learning rate (after warmup)"),
    Flag("min_lr", float, "LR", "learning rate at the end of the cosine decay"),
    Flag("warmup", int, "N", "steps of linear warmup", f"min({DEFAULT_WARMUP}, max_steps // 10)"),
    Flag("weight_decay", float, "W", "AdamW weight decay (matrices only)"),
    Flag("grad_clip", float, "C", "clip the gradient norm to C (0 = no clipping)"),
    Flag("beta1", float, "B1", "AdamW beta1"),
    Flag("beta2", float, "B2", "AdamW beta2"),
    Flag("dropout", float, "P", "dropout probability"),
    Flag("mlp_dim", int, "M", "MLP hidden width", "4 x the preset's width"),
    Flag("eval_every", int, "N", "validation loss every N steps"),
    Flag("eval_batches", int, "N", "validation batches per evaluation"),
    Flag("log_every", int, "N", "a metrics line every N steps"),
    Flag("checkpoint_every", int, "N", "a checkpoint every N steps (and at the end)"),
    Flag("sample_every", int, "N", "print a short greedy sample every N steps (and at the end)", "never"),
    Flag("seed", int, "S", "seed of the weights, the batches and dropout"),
    Flag("dtype", str, "float32|bfloat16", "compute dtype (bfloat16: autocast, float32 master weights)"),
    Flag("out", str, "DIR", "run directory", "runs/<preset>-<attention>"),
    Flag("threads", int, "N", "CPU threads per process", "the machine's cores shared by its processes"),
    Flag("device", str, "auto|cpu|cuda", "where to train (auto: CUDA when available)"),
    Flag("shard", bool, "", "under torchrun, shard the model over the processes with FSDP2 instead of DDP"),
    Flag("tensor_parallel", int, "N", "under torchrun, split every layer's heads over N processes (the rest: data parallel)"),
    Flag("track_heads", bool, "", "at each evaluation, score every head's causal roles (induction, ...) into "
         "metrics.jsonl; 'multihead heads RUN_DIR' plots them"),
)

# Fields set by flags of another shape: --attention-option K=V (repeated).
OTHER_FIELDS = ("attention_options",)


def _default_text(config_type: type, flag: Flag) -> str:
    """The dataclass default of ``flag.field`` for the help (never repeated here)."""
    for f in dataclasses.fields(config_type):
        if f.name == flag.field:
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                return "required"
            return f"default {flag.when_none or 'derived'}" if value is None else f"default {value}"
    return "not a TrainConfig field"


def add_arguments(parser) -> None:
    """The description and flags of ``multihead train`` (``parser``: an ``argparse.ArgumentParser``).

    Every flag defaults to None, which means "TrainConfig's default"; the help
    shows that default, read from the dataclass.
    """
    parser.description = DESCRIPTION
    for flag in FLAGS:
        help = f"{flag.help} ({_default_text(TrainConfig, flag)})"
        if flag.type is bool:  # --name / --no-name, None when neither is given
            parser.add_argument(flag.name, dest=flag.field, action=argparse.BooleanOptionalAction, help=help)
            continue
        parser.add_argument(flag.name, dest=flag.field, type=flag.type, metavar=flag.metavar, help=help)
    parser.add_argument(
        "--attention-option",
        dest="attention_option",
        action="append",
        metavar="K=V",
        help="option of the attention kind, V read as JSON when it parses (16, 0.5, true), else a string; repeat for more",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint (same config)"
    )
    add_import_argument(parser)


def parse_attention_options(items: list[str] | None) -> dict[str, Any]:
    """``["window=16", "mode=fast"]`` -> ``{"window": 16, "mode": "fast"}``.

    Raises:
        ValueError: an item without ``=``, with an empty or non-identifier
            key, or a key given twice.
    """
    options: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--attention-option {item!r}: expected K=V (e.g. num_kv_heads=2)")
        if not key.isidentifier():
            raise ValueError(f"--attention-option {item!r}: the option name {key!r} is not a valid name")
        if key in options:
            raise ValueError(f"--attention-option {key} is given twice ({key}={options[key]!r} and {item!r})")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        options[key] = value
    return options


def config_values(args) -> dict[str, Any]:
    """The ``TrainConfig`` fields the command line sets (an ``argparse.Namespace`` in).

    Raises:
        ValueError: a malformed ``--attention-option``.
    """
    values = {f.field: getattr(args, f.field) for f in FLAGS if getattr(args, f.field, None) is not None}
    options = getattr(args, "attention_option", None)
    if options:
        values["attention_options"] = parse_attention_options(options)
    return values


def is_rank_zero() -> bool:
    """True in a plain process and in rank 0 of a ``torchrun`` launch."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover - torch without distributed support
        pass
    try:
        return int(os.environ.get("RANK", "0") or "0") == 0
    except ValueError:  # a malformed RANK: speak, so the loop's refusal of it is seen
        return True


def _check_inputs(config, *, resume: bool) -> None:
    """Refuse a missing or empty data file, an unwritable --out, a --resume with nothing to resume."""
    if config.data != BUILTIN_DATA:
        path = input_file("--data", config.data, f"'{BUILTIN_DATA}' or a UTF-8 text file")
        if path.stat().st_size == 0:
            raise ValueError(f"--data {config.data}: the file is empty")
    out = output_folder("--out", config.out)
    if resume:
        latest = out / "checkpoints" / "latest"
        if not latest.is_file():
            raise ValueError(f"--resume: --out {config.out} holds no checkpoint ({latest} does not exist)")


def resume_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` over the config of the latest checkpoint of the run they point
    to (``--resume``).

    The run directory is ``values["out"]``, or TrainConfig's default ``out``
    for the given preset and attention kind. Without a checkpoint there,
    ``values`` as they are (the missing checkpoint is refused later, naming
    the folder).

    Raises:
        ValueError: a ``--max-steps`` below the checkpoint's step; an
            unreadable checkpoint pointer or state header.
    """
    from ..models.run_dirs import latest_checkpoint
    from ..train.checkpoint import checkpoint_config

    out = values.get("out")
    if out is None:  # the default run directory depends on the preset and the attention kind only
        out = TrainConfig(**{k: values[k] for k in ("preset", "attention", "init_from") if k in values}).out
    latest = latest_checkpoint(out) if Path(out).is_dir() else None
    if latest is None:
        return dict(values)
    try:
        step, saved = checkpoint_config(latest)
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: cannot read the checkpoint {latest}: {e}") from None
    max_steps = values.get("max_steps", saved.max_steps)
    if max_steps < step:
        raise ValueError(
            f"--max-steps {max_steps} is below step {step} of the checkpoint in {out}: a resumed run goes on "
            f"from there (give --max-steps {step} or more)"
        )
    return {**saved.to_dict(), **values, "out": out}


def _check_warmup(given: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Name ``--warmup`` when the one ``given`` on the command line is not shorter
    than the run (``values``: the fields the config is built from)."""
    if given.get("warmup") is None:
        return
    max_steps = values.get("max_steps", TrainConfig.max_steps)
    if isinstance(max_steps, int) and given["warmup"] >= max_steps:
        raise ValueError(
            f"--warmup {given['warmup']} must be shorter than the run's {max_steps} steps (--max-steps); "
            f"left out, the warm-up is min({DEFAULT_WARMUP}, max_steps // 10)"
        )


def summary(result, config) -> list[str]:
    """The lines printed after training: run dir, final validation loss, speed (when a step was timed), what to try next."""
    run_dir = str(result.run_dir)
    loss = float(result.val_loss)
    lines = [f"run: {run_dir}"]
    if config.tokenizer == "bytes":  # one token is one byte: bits/byte = nats/token / ln 2
        lines.append(
            f"final val loss: {loss:.4f} nats/token = {loss / math.log(2):.4f} bits/byte (step {result.steps})"
        )
    else:
        lines.append(f"final val loss: {loss:.4f} nats/token (step {result.steps})")
    if result.steps > result.start:
        lines.append(f"speed: {result.tokens_per_s:,.0f} tokens/s (training steps, all processes)")
    else:
        lines.append(f"speed: no step trained (the checkpoint was already at step {result.steps})")
    lines.append(f"try: multihead generate --checkpoint {shlex.quote(run_dir)} {shlex.quote(TRY_PROMPT)}")
    return lines


def check_config(config: TrainConfig, *, resume: bool) -> None:
    """Everything ``train`` would refuse that can be known before anything is written:
    the data file, ``--out``, ``--resume`` with nothing to resume, and for a
    fresh run the model the options build (the attention kind and its options,
    or the ``--init-from`` folder; built on the meta device, so no memory is
    used; a resumed run builds its checkpoint's).

    Raises:
        ValueError, TypeError, OSError: the user's mistake, naming the value.
    """
    from ..train.loop import check_model

    _check_inputs(config, resume=resume)
    if not resume:  # a resumed run builds its checkpoint's model (init_from's folder may be gone)
        check_model(config)


def resume_command(run_dir: str, imports: list[str]) -> str:
    """The command line that resumes ``run_dir`` (under torchrun: the same launch)."""
    command = shlex.join(["multihead", "train", "--out", str(run_dir), "--resume",
                          *(a for name in imports for a in ("--import", name))])  # fmt: skip
    world, local = int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if world <= 1:
        return command
    if world == local:
        return f"torchrun --nproc-per-node {local} -m {command}"
    return f"{command} (in the same torchrun launch, {world} processes)"


def run(args: argparse.Namespace, *, echo: Callable[[str], None] = print, progress: bool | None = None) -> int:
    """``multihead train``: check everything, train, and ``echo`` the summary (rank 0 only).

    Args:
        args: the parsed command line (``add_arguments``).
        echo: where the summary goes (stdout).
        progress: passed to ``train`` (None: the loop decides).

    Returns:
        The exit status: 0, or 128 + the signal's number (130: SIGINT,
        143: SIGTERM) when a signal stopped the run; then one line on
        stderr says whether the step was checkpointed and gives the
        command that resumes. 3 when a loss diverged (NaN or infinite):
        one line names the step and the loss, and the latest checkpoint
        is the last good one.

    Raises:
        UsageError: a user mistake (the CLI prints one line and exits with
            status 2); everything but the loop's own refusals (a checkpoint
            of another config, a split too short for a batch) is checked
            before anything is written.
    """
    from ..train.divergence import LossDiverged
    from ..train.interrupt import TrainingInterrupted
    from ..train.loop import train

    with checking():
        import_modules(args.imports)
        given = config_values(args)
        values = resume_values(given) if args.resume else given
        _check_warmup(given, values)
        config = TrainConfig(**values)
        check_config(config, resume=args.resume)
    try:
        result = train(config, resume=args.resume, progress=progress)
    except (TrainingInterrupted, KeyboardInterrupt) as e:
        return _interrupted(e, config, args.imports)
    except LossDiverged as e:  # every rank stops after the same step
        sys.stdout.flush()
        if is_rank_zero():
            print(f"multihead train: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    if is_rank_zero():
        for line in summary(result, config):
            echo(line)
    sys.stdout.flush()
    return 0


def _interrupted(error: BaseException, config: TrainConfig, imports: list[str]) -> int:
    """One line on stderr (rank 0) after a signal stopped ``train``; the exit status."""
    from ..models.run_dirs import latest_checkpoint
    from ..train.interrupt import TrainingInterrupted

    sys.stdout.flush()
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C while no step runs (preparing, or after the last)
        text, status = "SIGINT outside the training steps: stopped", 130
    else:
        text, status = str(error), error.exit_status
    if isinstance(error, TrainingInterrupted) and error.checkpointed:
        text += f"; resume with: {resume_command(str(config.out), imports)}"
    else:
        try:
            latest = latest_checkpoint(config.out)
        except ValueError:
            latest = None
        resume = resume_command(str(config.out), imports)
        text += f"; resume from {latest.name} with: {resume}" if latest is not None else "; no checkpoint to resume"
    if is_rank_zero():
        print(f"multihead train: {text}", file=sys.stderr, flush=True)
    return status
