"""``multihead prune``: remove the least important attention heads for good, save and report.

    multihead prune --model minilm-l6 --method ablation --keep 0.5 --out minilm-half
    multihead prune --checkpoint runs/mini --method gradient --keep 0.75 --out runs/mini-pruned
    multihead prune --hf path/to/bert-or-gpt2 --method gradient --keep 0.5 --out pruned

Scores every head with ``tools.importance.head_importance`` on calibration
data, removes the lowest ``L*H - keep`` of them with ``tools.prune.prune_heads``
(``keep = max(L, round(FRACTION * N))`` of the model's N heads; one ranking over all layers,
skipping a head whose removal would leave its layer empty:
``tools.fidelity.keep_heads``), saves the pruned model into ``--out``
(the folder whole: ``staged_output``) and prints a report, also written to
``--out/report.json``.

``--model minilm-l6`` (the pretrained all-MiniLM-L6-v2), or a ``--checkpoint``
folder holding a sentence encoder (what prune and convert write for MiniLM
or a BERT; ``model_sources``): Shakespeare's works
sorted by title, even positions for calibration and odd ones held out
(``encoder_inputs``). Calibration: ``--calibration-lines`` pairs (line,
next line) drawn with seed ``SEED``; "gradient" scores the in-batch next-line contrastive
loss (cross-entropy of 20 * cos, padding excluded, rows normalised per
layer), "ablation" the drift 1 - cos to the unpruned embeddings of the
pairs' first lines. Fidelity: mean cosine and top-10 neighbour agreement on
``--heldout-lines`` (default ``HELDOUT_LINES``) held-out lines. Saved with
``save_sentence_encoder``.

``--hf DIR`` (a local Hugging Face folder, ``prune_hf``): model_type "bert"
is pruned as MiniLM (the same lines, losses and fidelity; the folder's
sentence-transformers pooling, else mean pooling) and saved the same way;
model_type "gpt2" is loaded as a multihead ``GPT`` and pruned as a
checkpoint, on windows of Shakespeare's text through the folder's
tokenizer.json (training part: calibration; validation part: the loss
before and after, ``prune_hf.VAL_WINDOWS`` windows). Either is saved in
multihead's format (a Hugging Face config cannot hold per-layer head
counts) with the tokenizer.json beside it; any other model_type is refused.

``--checkpoint`` (a GPT checkpoint or a ``multihead train`` run directory):
the language-model loss on ``--calibration-lines`` // 16 (at least 1)
batches of 16 windows of the run's data/train.bin (or of the bytes of the
Shakespeare training text for a byte checkpoint that is not a run), seed
``CALIBRATION_SEED`` as ``multihead convert``. Fidelity (run directory
only): the loss on the run's fixed validation batches before and after.

The losses of each method per model family (including "gates": gates
trained at ``--gate-penalties`` to keep the unpruned model's outputs) are
in ``tools.objectives``. ``--recover-steps N`` then distils the pruned model
towards the unpruned one on the calibration data (``recovery_option``); the
report gives the fidelity before and after.

Speed-up: ``tools.timing.measure_speedup`` of one forward pass of the
unpruned and the pruned model on the same held-out batch, ``TIMED_PASSES``
alternating rounds: the median per-round ratio with its minimum and
maximum, or "below measurement noise" where that range holds 1.0. The
report also gives the KV-cache bytes per token before and after
(``tools.flops.kv_cache_size``, at the model's dtype) and, for a model with
local layers, one sequence's bytes at its context (``surgery_report``).

The folder is written whole (``staged_output``: a staging folder, moved
into place at the end); Ctrl-C or SIGTERM leaves no part
of it, prints one line and exits with 130 or 143. Whatever it holds opens
with ``--checkpoint`` in every command and with
``multihead.models.load_model``.

Mistakes are refused before anything is written: FRACTION outside (0, 1],
an unknown method, not exactly one of --model, --checkpoint and --hf, an
attention kind whose heads cannot be removed alone (moh, dcmha, ...), an
--out that cannot be written: ``prepare`` checks the options and loads the
model and its data, then ``prune`` does the work. ``--import MODULE`` is
imported first (a checkpoint of a kind from the user's own package).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..paths import output_folder
from ..tools.objectives import (
    GATE_PENALTIES,
    GATE_STEPS,
    METHODS,
    anchor_batches,
    encoder_scores,
    gate_training,
    gpt_scores,
)
from .checking import checking
from .encoder_inputs import HELDOUT_LINES, SEED, check_heldout_lines, shakespeare_lines
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
from .recovery_option import add_recover_steps, check_recover_steps, recover_model
from .staged_output import interruptible
from .surgery_report import echo_measurements, kv_cache_entries, kv_cache_rows

__all__ = [
    "add_arguments", "run", "Pruning", "prepare", "prune", "MODELS", "METHODS", "SEED", "HELDOUT_LINES",
    "DEFAULT_CALIBRATION_LINES", "TIMED_PASSES",
]  # fmt: skip

DEFAULT_CALIBRATION_LINES = 256
TIMED_PASSES = 7
BATCH_SIZE = 64
DESCRIPTION = (
    "Score every attention head on calibration data, remove the lowest-scoring ones (one ranking over "
    "all layers, at least one head left per layer), save the pruned model into --out and report the "
    f"heads removed, parameters, fidelity (MiniLM, BERT: {HELDOUT_LINES} held-out Shakespeare lines; a run: "
    "its validation loss; GPT-2: the loss on Shakespeare's validation text) and the measured forward "
    "speed-up with its spread. The folder is written whole or not at all, in multihead's own format "
    "(per-layer head counts) with its tokenizer.json: every command's --checkpoint opens it, and "
    "multihead.models.load_model in Python. See docs/surgery.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead prune``."""
    parser.description = DESCRIPTION
    parser.add_argument("--model", metavar="NAME", help=f"a pretrained model: {', '.join(MODELS)}")
    add_source_arguments(parser, hf_help=HF_FOLDER)
    parser.add_argument("--method", required=True, metavar="M", help=f"importance scores: {' or '.join(METHODS)}")
    parser.add_argument("--keep", required=True, type=float, metavar="FRACTION", help="share of heads kept, in (0, 1]")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the pruned model and report.json")
    parser.add_argument(
        "--calibration-lines", type=int, default=DEFAULT_CALIBRATION_LINES, metavar="N",
        help=f"encoders: calibration line pairs; GPT: windows, 16 per batch (default {DEFAULT_CALIBRATION_LINES})",
    )  # fmt: skip
    parser.add_argument(
        "--heldout-lines", type=int, metavar="N",
        help=f"encoders (MiniLM, BERT): held-out lines of the fidelity (default {HELDOUT_LINES})",
    )  # fmt: skip
    parser.add_argument(
        "--gate-penalties", type=_floats, metavar="P,P,...",
        help="--method gates: L0 penalties, one gate training each (default: "
        + "; ".join(f"{family} {','.join(map(str, p))}" for family, p in GATE_PENALTIES.items()) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--gate-steps", type=int, metavar="N", help=f"--method gates: Adam steps per penalty (default {GATE_STEPS})"
    )
    add_recover_steps(parser)
    add_import_argument(parser)


def _floats(text: str) -> tuple[float, ...]:
    """'0.1,0.3' -> (0.1, 0.3)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give comma-separated numbers such as 0.1,0.3, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """``multihead prune``: check the options, load the model and its data, then score, prune and report."""

    def body() -> int:
        with checking():
            import_modules(args.imports)
            job = prepare(
                method=args.method, keep=args.keep, out=args.out, model=args.model, checkpoint=args.checkpoint,
                hf=args.hf, calibration_lines=args.calibration_lines, heldout_lines=args.heldout_lines,
                gate_penalties=args.gate_penalties, gate_steps=args.gate_steps, recover_steps=args.recover_steps,
            )  # fmt: skip
        prune(job)
        return 0

    return interruptible("multihead prune", args.out, body)


def _check_options(method: str, keep: float, lines: int, heldout: int | None) -> None:
    if method not in METHODS:
        raise ValueError(f"--method {method}: unknown method; valid: {', '.join(METHODS)}")
    if not 0 < keep <= 1:
        raise ValueError(f"--keep {keep}: give the fraction of heads to keep, in (0, 1]")
    if lines < 2:
        raise ValueError(f"--calibration-lines {lines}: give a number >= 2")
    check_heldout_lines(heldout)


def _check_gates(method: str, penalties: tuple[float, ...] | None, steps: int | None) -> None:
    """Refuse --gate-penalties / --gate-steps without --method gates, or with bad values."""
    from ..tools.gate_importance import GateTraining

    if method != "gates" and (penalties is not None or steps is not None):
        raise ValueError(f"--gate-penalties and --gate-steps are for --method gates, not --method {method}")
    try:
        GateTraining(penalties=(0.0,) if penalties is None else penalties, steps=1 if steps is None else steps)
    except ValueError as err:
        raise ValueError(f"--gate-penalties / --gate-steps: {err}") from None


def _gates(method: str, family: str, penalties, steps):
    return gate_training(family, penalties, steps) if method == "gates" else None


def _target(model):
    """The GPT or BertEncoder whose heads are pruned, refused where heads mix."""
    from ..modules.registry import attention_class

    inner = getattr(model, "encoder", model)
    kind = inner.config.attention
    cls = attention_class(kind)
    if not cls.independent_heads:
        raise ValueError(f"attention kind {kind!r} cannot lose one head alone: {cls.head_independence}")
    return inner


# ------------------------------------------------------------------ measuring
def _count(model) -> int:
    return model.num_parameters() if hasattr(model, "num_parameters") else sum(p.numel() for p in model.parameters())


@dataclass
class Pruning:
    """What ``prepare`` checked and loaded for ``prune``.

    ``pairs`` and ``heldout`` are an encoder's calibration pairs and held-out
    lines; ``batches`` a GPT's calibration windows [B, T]; ``validate`` a
    GPT's (loss function of a model, description) when it has validation data.
    """

    net: nn.Module
    encoder: bool
    source: str
    method: str
    keep: float
    folder: Path
    gates: object | None
    recover_steps: int
    pooling: str | None = None
    pairs: list | None = None
    heldout: list | None = None
    batches: list | None = None
    validate: tuple | None = None
    tokenizer_file: Path | None = None


def prepare(
    *,
    method: str,
    keep: float,
    out: str,
    model: str | None = None,
    checkpoint: str | None = None,
    hf: str | None = None,
    calibration_lines: int = DEFAULT_CALIBRATION_LINES,
    heldout_lines: int | None = None,
    gate_penalties: tuple[float, ...] | None = None,
    gate_steps: int | None = None,
    recover_steps: int = 0,
) -> Pruning:
    """Check the options and --out, load the model and its calibration and fidelity data.

    Args:
        method: "gradient", "ablation" or "gates".
        keep: the fraction of heads to keep, in (0, 1].
        out: the folder for the pruned model and report.json.
        model: "minilm-l6"; exactly one of ``model``, ``checkpoint``, ``hf``.
        checkpoint: a GPT checkpoint or a ``multihead train`` run directory.
        hf: a local Hugging Face BERT or GPT-2 folder.
        calibration_lines: encoders: line pairs; GPT: windows (in batches of 16).
        heldout_lines: encoders: held-out lines of the fidelity (None:
            ``HELDOUT_LINES``).
        gate_penalties, gate_steps: "gates": the L0 penalties (one training
            each) and Adam steps per penalty (None: ``tools.objectives``'
            defaults for the model family).
        recover_steps: steps of distillation towards the unpruned model
            after pruning (``recovery_option``); 0: none.

    Raises:
        ValueError: see the module docstring; nothing is written.
    """
    check_sources(model, checkpoint, hf)
    _check_options(method, keep, calibration_lines, heldout_lines)
    _check_gates(method, gate_penalties, gate_steps)
    check_recover_steps(recover_steps)
    folder = output_folder("--out", out, OUTPUT_FILES)
    if family(model, checkpoint, hf, command="prune")[0] == "gpt" and heldout_lines is not None:
        from .prune_hf import VAL_WINDOWS

        measured = (f"the GPT-2 --hf {hf} is measured on {VAL_WINDOWS} windows of the Shakespeare validation text"
                    if hf is not None else "a GPT checkpoint is measured on its run's validation batches")  # fmt: skip
        raise ValueError(f"--heldout-lines {heldout_lines} is for encoders (--model, a BERT --hf, a sentence-encoder "
                         f"--checkpoint); {measured}")  # fmt: skip
    loaded = load_source(model, checkpoint, hf, command="prune")
    net = loaded.net
    _target(net)
    if loaded.encoder:
        pairs, heldout = shakespeare_lines(net, calibration_lines, HELDOUT_LINES if heldout_lines is None else heldout_lines)
        gates = _gates(method, "encoder", gate_penalties, gate_steps)
        return Pruning(net, True, loaded.source, method, keep, folder, gates, recover_steps, loaded.pooling, pairs,
                       heldout)  # fmt: skip
    count = max(1, calibration_lines // CALIBRATION_BATCH_SIZE)
    if loaded.hf_tokenizer is not None:
        from . import prune_hf

        batches = prune_hf.gpt2_calibration(net, loaded.hf_tokenizer, count, CALIBRATION_BATCH_SIZE, CALIBRATION_SEED, hf)
        validate = prune_hf.gpt2_validation(net, loaded.hf_tokenizer, CALIBRATION_BATCH_SIZE, hf)
    else:
        data = None if loaded.run_dir is not None else "shakespeare"
        batches = calibration_windows(net, loaded.run_dir, loaded.tokenizer, data, count)
        validate = validation(loaded.run_dir) if loaded.run_dir is not None else None
    gates = _gates(method, "gpt", gate_penalties, gate_steps)
    return Pruning(net, False, loaded.source, method, keep, folder, gates, recover_steps, batches=batches,
                   validate=validate, tokenizer_file=loaded.tokenizer_file)  # fmt: skip


def prune(job: Pruning, echo: Callable[[str], None] = print) -> dict:
    """Score the heads, remove them, measure, save, print and return the report (as in report.json)."""
    import torch

    from ..tools.fidelity import fidelity, keep_heads
    from ..tools.prune import prune_heads
    from ..tools.timing import measure_speedup

    net, encoder, gates, pairs, heldout, batches, validate = (
        job.net, job.encoder, job.gates, job.pairs, job.heldout, job.batches, job.validate
    )
    if encoder:
        scores = encoder_scores(net, job.method, pairs, gates)
    else:
        scores = gpt_scores(net, job.method, batches, gates)
    L = scores.shape[0]
    counts = (~scores.isnan()).sum(dim=1).tolist()  # heads per layer (fewer in a model pruned before)
    total = sum(counts)
    kept = max(L, round(job.keep * total))
    table = keep_heads(scores, kept)
    unpruned = _copy(net)
    params_before = _count(net)
    prune_heads(net, table)
    net.eval()
    report = {
        "source": job.source,
        "method": job.method,
        "keep": job.keep,
        "heads": [total, kept],
        "removed": {str(i): sorted(table.get(i, [])) for i in range(L)},
        "layer_heads": [counts[i] - len(table.get(i, [])) for i in range(L)],
        "parameters": [params_before, _count(net)],
        **kv_cache_entries(unpruned, net),
        "pooling": job.pooling,
        "gates": None if gates is None else {"penalties": list(gates.penalties), "steps": gates.steps, "lr": gates.lr},
        "calibration": None,
        "fidelity": None,
        "val_loss": None,
        "val_batches": None,
        "recovery": None,
        "seconds": None,
        "speedup": None,
    }
    if encoder:
        report["calibration"] = f"{len(pairs)} line pairs of the even-numbered works"
        reference = unpruned.encode(heldout, batch_size=BATCH_SIZE)  # (N, C)

        def measure(m) -> dict:
            cos, agree = fidelity(reference, m.encode(heldout, batch_size=BATCH_SIZE))
            return {"lines": len(heldout), "mean_cosine": cos, "neighbours_top10": agree}

        tok = net.tokenize(heldout[:BATCH_SIZE])

        def timed(m):
            return lambda: m(tok.input_ids, tok.attention_mask, tok.token_type_ids)
    else:
        report["calibration"] = f"{len(batches)} batches x {CALIBRATION_BATCH_SIZE} windows"
        x = batches[0]
        measure = None if validate is None else validate[0]

        def timed(m):
            return lambda: m(x)

    if job.recover_steps:
        before = None if measure is None else measure(net)
        data = anchor_batches(net, pairs) if encoder else batches
        report["recovery"] = recover_model(net, unpruned, data, "encoder" if encoder else "gpt", job.recover_steps)
        report["recovery"]["before"] = before
    if encoder:
        report["fidelity"] = measure(net)
    elif measure is not None:
        report["val_loss"], report["val_batches"] = [measure(unpruned), measure(net)], validate[1]
    with torch.no_grad():
        speed = measure_speedup(timed(unpruned), timed(net), TIMED_PASSES)
    report["seconds"], report["speedup"] = list(speed.seconds), speed.to_dict()
    write_outputs(job.folder, lambda f: _save(net, f), report, job.tokenizer_file)
    _print(report, job.folder, echo)
    return report


def _copy(model):
    import copy

    return copy.deepcopy(model).eval()


def _save(model, folder: Path) -> None:
    from ..models.checkpoint import save_checkpoint
    from ..models.gpt import GPT
    from ..models.minilm import save_sentence_encoder

    if isinstance(model, GPT):
        save_checkpoint(model, folder)
    else:
        save_sentence_encoder(model, folder)


def speedup_text(entry: dict) -> str:
    """The report's "speedup" entry in words (``tools.timing.Speedup``'s)."""
    from ..tools.timing import Speedup

    return str(Speedup(entry["median"], entry["min"], entry["max"], entry["rounds"], (0.0, 0.0), entry["below_noise"]))


def _print(report: dict, folder: Path, echo: Callable[[str], None]) -> None:
    total, kept = report["heads"]
    echo(f"{report['source']}: kept {kept} of {total} heads, method {report['method']} ({report['calibration']})")
    if report["gates"] is not None:
        g = report["gates"]
        echo(f"  gates trained at penalties {g['penalties']}, {g['steps']} steps each (lr {g['lr']})")
    for layer, heads in report["removed"].items():
        echo(f"  layer {layer}: removed {heads if heads else 'none'}, {report['layer_heads'][int(layer)]} left")
    rows = [("parameters", *report["parameters"]), *kv_cache_rows(report)]
    if report["val_loss"] is not None:
        rows.append(("val loss (nats/token)", *(f"{v:.4f}" for v in report["val_loss"])))
    rows.append(("forward (ms, median)", *(f"{1000 * s:.2f}" for s in report["seconds"])))
    width = max(len(r[0]) for r in rows)
    echo(f"  {'':<{width}}  {'before':>12}  {'after':>12}")
    for name, before, after in rows:
        echo(f"  {name:<{width}}  {before!s:>12}  {after!s:>12}")
    echo(f"  speed-up: {speedup_text(report['speedup'])}, same batch")
    echo_measurements(report, echo)
    echo(f"wrote {folder.resolve()} ({', '.join(n for n in OUTPUT_FILES if (folder / n).is_file())})")
    echo(f"  (multihead's own format, per-layer head counts in config.json: open it with --checkpoint {folder} "
         f"or multihead.models.load_model)")  # fmt: skip
