"""The model sources of ``multihead inspect``: load a model, encode the text and capture its weights.

    record, enc, notices, scorer, slots, causal, (model, encode) = run_minilm(text, truncate, folder, tokenizer, layer)
    ... = run_gpt(text, checkpoint, tokenizer, truncate, layer)     # a GPT checkpoint or a train run
    ... = run_hf(text, hf, truncate)                                 # a local Hugging Face folder
    slots, notices = pruned_slots(config, report_path)               # a pruned model's heads before pruning

Each loader returns the captured ``AttentionRecord`` of one forward pass
over the text (``tools.capture``; ``layer``: that attention module only),
the text's ``Encoded`` tokens, the notices the reader must see, a scorer
() -> [L, H] ablation scores (``tools.objectives``, ``hf.encoder_importance``),
the ``HeadSlots`` of a pruned model (None: nothing pruned), a causal model's
``CausalScores`` (``inspect_causal``; None for an encoder) and (the loaded
model, an encoder of further texts with the same tokenizer, maximum and
``truncate``). The mistakes they refuse (ValueError, one line) are listed in
``inspect.capture_text``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..tools.capture import attention_modules, capture
from ..tools.head_slots import HeadSlots
from ..tools.objectives import encoder_importance, gpt_importance
from ..train.head_tracking import unseen_ids_of_run
from .inspect_causal import is_causal, score_causal
from .run_dir import run_checkpoint
from .tokens import Encoded, encode_bytes, encode_text, load_tokenizer, notices

__all__ = ["captured_layers", "run_minilm", "run_gpt", "run_hf", "pruned_slots"]

_MINILM = "all-MiniLM-L6-v2"


def captured_layers(model, layer: int | None):
    """``capture(model)`` of every layer, or of the attention module ``layer`` only (the others record nothing)."""
    if layer is None:
        return capture(model)
    count = len(attention_modules(model))
    if layer >= count:
        raise ValueError(f"--layer {layer} out of range: the model has layers 0..{count - 1}")
    return capture(model, layers=[layer])


def run_minilm(text: str, truncate: bool, folder: str | None = None, tokenizer: str | None = None, layer=None):
    """The packaged MiniLM, or the sentence encoder saved in ``folder`` (what prune and convert write)."""
    from ..models.minilm import load_minilm, load_sentence_encoder

    if folder is None:
        model, name, slots, extra = load_minilm(), _MINILM, None, []
    else:
        if tokenizer is not None:
            raise ValueError(f"--checkpoint {folder} is a sentence encoder with its own tokenizer.json; "
                             f"--tokenizer {tokenizer} cannot replace it")  # fmt: skip
        model, name = load_sentence_encoder(folder), f"sentence encoder {Path(folder).name}"
        slots, extra = pruned_slots(model.encoder.config, Path(folder) / "report.json")
    def encode(line: str) -> Encoded:
        return encode_text(model.tokenizer, line, model.max_seq_length, model=name, truncate=truncate)

    enc = encode(text)
    ids = torch.tensor([enc.ids])  # (1, T)
    with torch.no_grad(), captured_layers(model.encoder, layer) as record:
        model.encoder(ids, attention_mask=torch.ones_like(ids))
    record.source = name
    note = f"; {_MINILM} is an English, uncased model" if folder is None else ""
    found = [*notices(enc, model=name, language_note=note), *extra]
    return record, enc, found, lambda: encoder_importance(model, ids), slots, None, (model, encode)


def run_gpt(text: str, checkpoint: str, tokenizer: str | None, truncate: bool, layer: int | None = None):
    from ..models.checkpoint import checkpoint_paths, load_checkpoint

    tok = load_tokenizer(tokenizer) if tokenizer is not None else None  # cheap: before the model
    found = run_checkpoint(checkpoint)  # a `multihead train` run directory brings its own tokenizer
    unseen: list[int] = []
    if found is not None:
        step_dir, run_tok, step = found
        if tok is not None and step is not None:
            raise ValueError(
                f"--checkpoint {checkpoint} is a training run with its own tokenizer; "
                f"--tokenizer {tokenizer} cannot replace it"
            )
        model, folder = load_checkpoint(step_dir).eval(), step_dir
        if step is not None:  # the run's own training ids, as --track-heads draws them
            unseen = unseen_ids_of_run(checkpoint, model.config.vocab_size)
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
    with torch.no_grad(), captured_layers(model, layer) as record:
        model(ids)
    record.source = source
    slots, notes = pruned_slots(model.config, folder / "report.json")
    causal, more = score_causal(model, vocab_size=vocab, context=limit, tokenizer=tok, unseen=unseen)
    return record, enc, [*notices(enc, model=name), *notes, *more], lambda: gpt_importance(model, ids), slots, causal, (model, encode)


def pruned_slots(config, report_path: Path) -> tuple[HeadSlots | None, list[str]]:
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


def run_hf(text: str, hf: str, truncate: bool):
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
