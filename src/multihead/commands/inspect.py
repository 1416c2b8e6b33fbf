"""``multihead inspect "TEXT"``: what every head of a real model attends to.

Loads the pretrained MiniLM encoder (default), a GPT checkpoint (or the
run directory of ``multihead train``, with its own tokenizer), a sentence
encoder saved by ``multihead prune`` or ``convert`` (``--checkpoint``) or any local
Hugging Face model folder (``hf``: config.json, weights and tokenizer.json,
run on multihead attention through ``multihead.hf``), runs the
text through it while capturing every head's exact weights (``tools.capture``:
MHA/GQA keep the fused kernel for the output and rebuild the weights from its
log-sum-exp; ``--layer`` observes that layer alone), scores each head
for the documented roles (``tools.roles``), prints a short summary (the
strongest heads of each role and the top token links, ``inspect_report``;
with ``verbose`` a table of every head with its roles, the legend of its
columns and each head's strongest links), and writes three files:

    heads.html   head view, model view and role table (one self-contained page)
    heads.png    layers x heads grid of heatmaps
    heads.json   the record (weights and tokens) plus the roles

A causal model (a GPT checkpoint or run, a Hugging Face model whose heads
hide later tokens) also gets the standard causal head scores on repeated
random tokens (``inspect_causal``: induction, previous-token,
duplicate-token, and the copying score of each head's OV circuit, the
tokenizer's special ids never drawn); the printout, heads.html and
heads.json lead with them. An encoder has none, and no such section.

With ``corpus`` (``--corpus FILE``, one text per line) the roles come from
every line instead (``inspect_corpus``: each score's mean, spread and
evidence over the lines, ``tools.corpus_roles``); the views still show the
text, or the file's first line. ``Captured`` keeps the loaded model and its
encoder of further texts for that.

With ``importance`` every head also gets an ablation score
(``head_scores``: the loss increase when the head alone is masked), a
column of the printed table and ``"importance"`` among its scores in
heads.json and heads.html.

A pruned GPT or encoder (``multihead prune``: layers with fewer heads than
``num_heads``) is shown with every head it had (``tools.head_slots``): the
removed heads as "pruned" rows and grey cells, the kept ones with their
index before pruning, read from the report.json beside the checkpoint when
it matches the checkpoint's ``layer_heads`` (otherwise the removed heads
follow the kept ones, indices unknown).

Mistakes are refused before any work: an output folder that cannot be
written, a missing tokenizer file, options that contradict each other, an
empty text; a text longer than the model's maximum is refused unless
``truncate`` is set, and then the terminal and the page say what was cut.
``capture_text`` checks the options, loads the model, encodes the text and
runs it once (capturing the weights); ``analyse`` then scores the heads.
``--import MODULE`` is imported first (a checkpoint of a kind from the
user's own package).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch

from ..paths import input_file, output_folder
from ..tools.capture import AttentionRecord, attention_modules, capture
from ..tools.causal_roles import CausalScores
from ..tools.head_slots import HeadSlots
from ..tools.objectives import encoder_importance, gpt_importance
from ..tools.roles import classify_heads
from .checking import checking
from .imports import add_import_argument, import_modules
from .inspect_causal import is_causal, score_causal
from .inspect_corpus import (
    add_corpus_arguments,
    check_corpus,
    corpus_notices,
    encode_corpus,
    report_corpus,
    run_corpus,
)
from .inspect_report import Inspection, report
from .model_sources import add_source_arguments
from .run_dir import is_sentence_encoder, run_checkpoint
from .tokens import Encoded, check_text, encode_bytes, encode_text, load_tokenizer, notices

__all__ = [
    "DEFAULT_TEXT", "MODELS", "OUTPUT_FILES", "Captured", "capture_text", "analyse", "inspect_text",
    "add_arguments", "run",
]  # fmt: skip

DEFAULT_TEXT = "The law will never be perfect, but its application should be just."
MODELS = ("minilm-l6",)
OUTPUT_FILES = ("heads.html", "heads.png", "heads.json")
_MINILM = "all-MiniLM-L6-v2"
DESCRIPTION = (
    "Run TEXT through a pretrained model (all-MiniLM-L6-v2 by default, offline) or a GPT "
    "checkpoint, capture every head's exact attention weights, score each head for documented "
    "roles (previous/next token, self, [CLS], [SEP], punctuation, broad, rare token), print the "
    "strongest heads of each role and the top token links (--verbose: every head's scores, the legend "
    "of the columns and each head's strongest links), and write heads.html (head view, model view, role table; opens from disk), heads.png and "
    "heads.json into --out. A causal model (a GPT --checkpoint or run, a causal --hf model) is first scored "
    "for the causal roles on repeated random tokens (induction, previous-token, duplicate-token heads and "
    "the copying score of each head's OV circuit), which the printout and the page show first. --hf DIR does the same for any local Hugging Face model folder "
    "(config.json, safetensors weights, tokenizer.json), run on multihead attention. --importance "
    "adds each head's ablation score: the loss increase when that head alone is masked (a GPT's LM "
    "loss on the text; for an encoder 1 - cosine between the masked and the whole text's mean-pooled "
    "embedding). A text longer than the model's maximum (256 tokens for MiniLM) is "
    "refused unless --truncate is given. A checkpoint of an attention kind from your own package "
    "needs --import. --corpus FILE scores the roles over every line of FILE (mean ± sd over the lines, with the "
    "evidence each role needs); the views then show TEXT, or the file's first line."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead inspect``."""
    parser.description = DESCRIPTION
    parser.add_argument(
        "text", nargs="?", help=f"the input text (default: the first line of --corpus, else {DEFAULT_TEXT!r})"
    )
    parser.add_argument("--model", choices=MODELS, help=f"packaged model (default {MODELS[0]} unless --checkpoint)")
    add_source_arguments(
        parser, hf_help="a local Hugging Face model folder (config.json, weights, tokenizer.json) instead of --model"
    )
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="tokenizer.json for a --checkpoint whose vocabulary is not bytes"
    )
    parser.add_argument(
        "--importance", action="store_true",
        help="score each head by ablation (loss increase when it alone is masked; one pass per head)",
    )  # fmt: skip
    parser.add_argument("--layer", type=int, metavar="L", help="only this layer")
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="analyse the first tokens of a text longer than the model's maximum (with a notice) instead of refusing it",
    )
    add_corpus_arguments(parser)
    parser.add_argument("--out", default="out", metavar="DIR", help="folder for heads.html/png/json (default out)")
    parser.add_argument(
        "--verbose", action="store_true",
        help="print every head's scores, the legend of the columns and each head's strongest links",
    )  # fmt: skip
    add_import_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``multihead inspect``: check, load and capture, then score the heads, print and write the files."""
    with checking():
        import_modules(args.imports)
        folder = _check_out(args.out)
        lines = check_corpus(args)
        text = args.text if args.text is not None else lines[0][1] if lines else DEFAULT_TEXT
        captured = capture_text(
            text, model=args.model, checkpoint=args.checkpoint, tokenizer=args.tokenizer, layer=args.layer,
            truncate=args.truncate, hf=args.hf, importance=args.importance,
        )  # fmt: skip
        encoded = encode_corpus(args.corpus, lines, captured.encode) if lines else None
    if encoded is not None:
        found = run_corpus(captured, encoded, batch_size=args.batch_size, layer=args.layer)
        notes = corpus_notices(args.corpus, lines, encoded)
        report_corpus(analyse(captured), found, args.corpus, folder, verbose=args.verbose, notices=notes)
        return 0
    report(analyse(captured, importance=args.importance), folder, importance=args.importance, verbose=args.verbose)
    return 0


def _check_out(out: str) -> Path:
    """The --out folder, checked (and matplotlib, which heads.png needs) before anything is loaded."""
    if find_spec("matplotlib") is None:  # heads.png needs it: refuse before writing the other two
        raise ImportError("multihead inspect draws heads.png with matplotlib, which is not installed: "
                          "pip install 'multihead[viz]'")
    return output_folder("--out", out, OUTPUT_FILES)


def _captured(model, layer: int | None):
    """``capture(model)`` of every layer, or of the attention module ``layer`` only (the others record nothing)."""
    if layer is None:
        return capture(model)
    count = len(attention_modules(model))
    if layer >= count:
        raise ValueError(f"--layer {layer} out of range: the model has layers 0..{count - 1}")
    return capture(model, layers=[layer])


def _run_minilm(text: str, truncate: bool, folder: str | None = None, tokenizer: str | None = None, layer=None):
    """The packaged MiniLM, or the sentence encoder saved in ``folder`` (what prune and convert write)."""
    from ..models.minilm import load_minilm, load_sentence_encoder

    if folder is None:
        model, name, slots, extra = load_minilm(), _MINILM, None, []
    else:
        if tokenizer is not None:
            raise ValueError(f"--checkpoint {folder} is a sentence encoder with its own tokenizer.json; "
                             f"--tokenizer {tokenizer} cannot replace it")  # fmt: skip
        model, name = load_sentence_encoder(folder), f"sentence encoder {Path(folder).name}"
        slots, extra = _pruned_slots(model.encoder.config, Path(folder) / "report.json")
    def encode(line: str) -> Encoded:
        return encode_text(model.tokenizer, line, model.max_seq_length, model=name, truncate=truncate)

    enc = encode(text)
    ids = torch.tensor([enc.ids])  # (1, T)
    with torch.no_grad(), _captured(model.encoder, layer) as record:
        model.encoder(ids, attention_mask=torch.ones_like(ids))
    record.source = name
    note = f"; {_MINILM} is an English, uncased model" if folder is None else ""
    found = [*notices(enc, model=name, language_note=note), *extra]
    return record, enc, found, lambda: encoder_importance(model, ids), slots, None, (model, encode)


def _run_gpt(text: str, checkpoint: str, tokenizer: str | None, truncate: bool, layer: int | None = None):
    from ..models.checkpoint import checkpoint_paths, load_checkpoint

    tok = load_tokenizer(tokenizer) if tokenizer is not None else None  # cheap: before the model
    found = run_checkpoint(checkpoint)  # a `multihead train` run directory brings its own tokenizer
    if found is not None:
        step_dir, run_tok, step = found
        if tok is not None and step is not None:
            raise ValueError(
                f"--checkpoint {checkpoint} is a training run with its own tokenizer; "
                f"--tokenizer {tokenizer} cannot replace it"
            )
        model, folder = load_checkpoint(step_dir).eval(), step_dir
        if tok is None:  # beside a checkpoint folder: --tokenizer, when given, is used
            tok = None if run_tok.kind == "bytes" else run_tok  # a BPE run's tokenizer, as tokenizers.Tokenizer JSON
        source = f"GPT run {Path(checkpoint).name}, step {step}" if step is not None else f"GPT checkpoint {Path(checkpoint).name}"
    else:
        model, folder = load_checkpoint(checkpoint).eval(), checkpoint_paths(checkpoint)[0].parent
        source = f"GPT checkpoint {Path(checkpoint).name}"
    vocab, limit, name = model.config.vocab_size, model.config.context_length, f"the checkpoint {checkpoint}"
    if tok is None and vocab != 256:
        raise ValueError(
            f"the checkpoint's vocabulary has {vocab} tokens, not 256 bytes: pass --tokenizer tokenizer.json"
        )

    def encode(line: str) -> Encoded:
        if tok is None:
            return encode_bytes(line, limit, model=name, truncate=truncate)
        found = encode_text(tok, line, limit, model=name, truncate=truncate)
        if max(found.ids) >= vocab:
            raise ValueError(f"--tokenizer {tokenizer} produced id {max(found.ids)}, but the checkpoint's vocab_size is {vocab}")
        return found

    enc = encode(text)
    ids = torch.tensor([enc.ids])  # (1, T)
    with torch.no_grad(), _captured(model, layer) as record:
        model(ids)
    record.source = source
    slots, notes = _pruned_slots(model.config, folder / "report.json")
    causal, more = score_causal(model, vocab_size=vocab, context=limit, tokenizer=tok)
    return record, enc, [*notices(enc, model=name), *notes, *more], lambda: gpt_importance(model, ids), slots, causal, (model, encode)


def _pruned_slots(config, report_path: Path) -> tuple[HeadSlots | None, list[str]]:
    """(the heads before pruning, notices) of a checkpoint whose layers have fewer than ``num_heads`` heads.

    The indices of the removed heads come from prune's report.json at
    ``report_path`` when its ``layer_heads`` is the config's; else they are unknown.
    """
    counts = config.layer_heads
    if counts is None or all(h == config.num_heads for h in counts):
        return None, []
    if not report_path.is_file():
        return HeadSlots.from_counts(config.num_heads, counts), []
    try:
        if report_path.stat().st_size > 1 << 20:  # prune writes a few kilobytes
            raise ValueError(f"{report_path.stat().st_size} bytes, more than a report")
        report = json.loads(report_path.read_text(encoding="utf-8"))
        if not isinstance(report, dict) or "layer_heads" not in report:
            raise ValueError("it lists no layer_heads")
        if report["layer_heads"] != list(counts):
            raise ValueError(f"its layer_heads {report['layer_heads']} are not the checkpoint's {list(counts)}")
        removed = report.get("removed")
        if not isinstance(removed, dict):
            raise ValueError("it has no 'removed' table")
        table = {int(layer): [int(h) for h in heads] for layer, heads in removed.items()}
        return HeadSlots.from_counts(config.num_heads, counts, table), []
    except (ValueError, TypeError, OSError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        note = f"{report_path} does not describe this checkpoint ({e}); the pruned heads' former indices are unknown"
        return HeadSlots.from_counts(config.num_heads, counts), [note]


def _run_hf(text: str, hf: str, truncate: bool):
    from ..hf import capture as hf_capture  # imports transformers: only for --hf
    from ..hf import encoder_importance as hf_importance
    from ..hf.folders import load_transformers_folder, model_folder

    folder = model_folder(hf, ("config.json", "tokenizer.json"), label=f"--hf {hf}")
    tok = load_tokenizer(str(folder / "tokenizer.json"))
    model = load_transformers_folder(folder, label=f"--hf {hf}")
    config = model.config
    sizes = [getattr(config, n, None) for n in ("max_position_embeddings", "n_positions")]
    limit = next((v for v in sizes if isinstance(v, int)), None)  # None: no positional limit
    name = f"{config.model_type} model {hf}"

    def encode(line: str) -> Encoded:
        found = encode_text(tok, line, limit or 1 << 30, model=name, truncate=truncate)
        if max(found.ids) >= config.vocab_size:
            raise ValueError(f"--hf {hf}: tokenizer.json produced id {max(found.ids)}, but vocab_size is {config.vocab_size}")
        return found

    enc = encode(text)
    ids = torch.tensor([enc.ids])  # (1, T)
    with torch.no_grad(), hf_capture(model) as record:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    record.source = name
    L, H = record.num_layers, record.layers[0].num_heads
    causal, more = None, []
    if is_causal(model, hf=True, vocab_size=config.vocab_size):
        causal, more = score_causal(model, vocab_size=config.vocab_size, context=limit, tokenizer=tok)
    return record, enc, [*notices(enc, model=name), *more], lambda: hf_importance(model, ids, L, H), None, causal, (model, encode)


def _visible(record: AttentionRecord, T: int) -> torch.Tensor:
    """[T, T] bool: causal when every head gives exactly zero weight above the diagonal
    (masked keys get exact zeros on multihead attention; a softmax over visible keys never does)."""
    above = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, S)
    causal = all(bool((entry.weights[..., above] == 0).all()) for entry in record.layers)
    full = torch.ones(T, T, dtype=torch.bool)
    return full.tril() if causal else full


@dataclass
class Captured:
    """What ``capture_text`` loaded and recorded: the weights of one forward pass over the text.

    Attributes:
        record: the captured weights (only ``layer`` when one was asked for),
            with the query tokens and the source.
        encoded: the text's tokens.
        notices: what the reader must know (text cut, words not understood).
        visible: [T, T] bool, the keys each query was allowed to see.
        scorer: () -> [L, H] ablation scores of every head (``--importance``).
        slots: a pruned model's heads before pruning (None: nothing pruned).
        causal: a causal model's head scores on repeated random tokens
            (``inspect_causal``; None for an encoder).
        model: the loaded model (what ``tools.corpus_roles`` runs for ``--corpus``).
        encode: another text -> its ``Encoded`` tokens, with the same tokenizer,
            maximum and ``truncate`` as the text.
    """

    record: AttentionRecord
    encoded: Encoded
    notices: list[str]
    visible: torch.Tensor
    scorer: Callable[[], torch.Tensor]
    slots: HeadSlots | None = None
    causal: CausalScores | None = None
    model: torch.nn.Module | None = None
    encode: Callable[[str], Encoded] | None = None


def capture_text(
    text: str,
    *,
    model: str | None = None,
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    layer: int | None = None,
    truncate: bool = False,
    hf: str | None = None,
    importance: bool = False,
) -> Captured:
    """Check the options, load the model, encode ``text`` and capture every head's weights on it.

    Args:
        text: the input sentence.
        model: a packaged pretrained model name (``MODELS``); the default
            when no ``checkpoint`` is given.
        checkpoint: a GPT checkpoint (``multihead.models.save_checkpoint``)
            or a ``multihead train`` run directory (its latest checkpoint and
            its tokenizer); not together with ``model``.
        tokenizer: a tokenizer.json for a checkpoint whose vocabulary is not bytes.
        layer: capture only this layer (only its attention module is
            observed, so the others keep their fast path and store nothing).
        truncate: analyse the first tokens of a text longer than the model's
            maximum (with a notice) instead of refusing it.
        hf: a local Hugging Face model folder (config.json, weights,
            tokenizer.json); not with ``model``, ``checkpoint`` or ``tokenizer``.
        importance: the heads will be scored (a GPT then needs 2 tokens).

    Raises:
        ValueError: contradicting options, unknown model, a missing or bad
            tokenizer file, empty or too long text, layer out of range, an
            ``hf`` folder without config.json or tokenizer.json or that
            transformers cannot load, a one-token text to score on a GPT.
    """
    if hf is not None:
        given = [f"{flag} {value}" for flag, value in (("--model", model), ("--checkpoint", checkpoint),
                                                       ("--tokenizer", tokenizer)) if value is not None]  # fmt: skip
        if given:
            raise ValueError(f"--hf {hf} brings its model and tokenizer; it cannot go with {' '.join(given)}")
    if checkpoint is not None and model is not None:
        raise ValueError(f"give --model or --checkpoint, not both (got --model {model} --checkpoint {checkpoint})")
    if tokenizer is not None and checkpoint is None:
        raise ValueError(
            f"--tokenizer {tokenizer} is for a --checkpoint; {model or MODELS[0]} has its own tokenizer"
        )
    if model is not None and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; packaged models: {list(MODELS)} (or pass --checkpoint)")
    if layer is not None and layer < 0:
        raise ValueError(f"--layer {layer} is negative: layers count from 0")
    check_text(text)
    if tokenizer is not None:
        input_file("--tokenizer", tokenizer, "a Hugging Face tokenizer.json")
    if hf is not None:
        record, enc, notes, scorer, slots, causal, source = _run_hf(text, hf, truncate)
        visible = _visible(record, len(enc.ids))
    elif checkpoint is not None and not is_sentence_encoder(checkpoint):
        record, enc, notes, scorer, slots, causal, source = _run_gpt(text, checkpoint, tokenizer, truncate, layer)
        visible = torch.ones(len(enc.ids), len(enc.ids), dtype=torch.bool).tril()  # causal
        if importance and len(enc.ids) < 2:
            raise ValueError(
                f"--importance on a GPT measures the LM loss of predicting the text's next tokens: "
                f"the text has {len(enc.ids)} token, give at least 2"
            )
    else:  # the packaged MiniLM, or a sentence encoder that prune or convert wrote
        record, enc, notes, scorer, slots, causal, source = _run_minilm(text, truncate, checkpoint, tokenizer, layer)
        visible = torch.ones(len(enc.ids), len(enc.ids), dtype=torch.bool)  # one sentence, no padding
    record.query_tokens = list(enc.tokens)
    if layer is not None and hf is not None:  # multihead.hf.capture records every layer
        if layer >= record.num_layers:
            raise ValueError(f"--layer {layer} out of range: the model has layers 0..{record.num_layers - 1}")
        record.layers = [record.layers[layer]]
    return Captured(record, enc, notes, visible, scorer, slots, causal, *source)


def analyse(captured: Captured, *, importance: bool = False) -> Inspection:
    """Classify every captured head; with ``importance`` add each head's ablation score as
    ``"importance"`` to its role scores (``tools.objectives``, ``hf.encoder_importance``)."""
    record, enc = captured.record, captured.encoded
    roles = classify_heads(record, token_ids=enc.ids, mask=captured.visible)
    if importance:
        scores = captured.scorer()  # (L, H) in model layer order, as the record's layer numbers; NaN past a layer's heads
        for r in roles:
            r.scores["importance"] = float(scores[r.layer, r.head])
    return Inspection(record, enc.ids, roles, captured.visible, enc.analysed, enc.total, captured.notices,
                      captured.slots, captured.causal)  # fmt: skip


def inspect_text(text: str, *, importance: bool = False, **options) -> Inspection:
    """Capture and classify every head on ``text``: ``analyse(capture_text(text, **options))``.

    Takes the arguments of ``capture_text``; ``importance`` adds each head's
    ablation score as ``"importance"`` to its role scores (``head_scores``).

    Raises:
        ValueError: as ``capture_text``.
    """
    return analyse(capture_text(text, importance=importance, **options), importance=importance)
