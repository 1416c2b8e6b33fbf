"""``multihead prune --hf DIR``: which local Hugging Face folders prune takes, and their data.

    DIR/config.json         model_type "bert"  ->  SentenceEncoder (BertEncoder + pooling)
    DIR/model.safetensors   model_type "gpt2"  ->  GPT (weights via convert.hf_gpt2)
    DIR/tokenizer.json      the text -> ids of calibration and fidelity

Only architectures multihead can load into its own modules are pruned here
(``SUPPORTED``; read by ``multihead.hf.load_sentence_encoder_folder`` and
``load_gpt2_folder``): heads are removed from multihead's modules, and the
pruned model is saved in multihead's format, because a Hugging Face config
holds one head count for all layers. Masking heads of any transformers
model, without removing them, is ``multihead.hf.head_mask``.

GPT-2: token ids of Shakespeare's text (``train.corpus.load_corpus``: the
training part for calibration, the validation part for fidelity) through the
folder's tokenizer.json, special tokens not added, encoded in pieces of
``PIECE_LINES`` lines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["SUPPORTED", "PIECE_LINES", "VAL_WINDOWS", "VAL_SEED", "check_folder", "shakespeare_tokens",
           "gpt2_calibration", "gpt2_validation"]  # fmt: skip

SUPPORTED = ("bert", "gpt2")
PIECE_LINES = 1000
VAL_WINDOWS = 64  # held-out windows of the context length for the GPT-2 fidelity
VAL_SEED = 1234


def check_folder(hf: str, command: str) -> tuple[Path, str]:
    """(folder, model_type) of ``--hf`` for ``multihead {command}``, refused before any weights are read.

    Raises:
        ValueError: no such folder; no config.json, tokenizer.json or
            model.safetensors in it; an unreadable config.json; a model_type
            the commands loading into multihead's own modules do not take (the
            message names ``command``, the supported types and
            ``multihead.hf.head_mask``).
    """
    from ..hf.folders import model_folder, read_config  # imports transformers when installed: only for --hf

    label = f"--hf {hf}"
    folder = model_folder(hf, ("config.json", "tokenizer.json", "model.safetensors"), label=label)
    model_type = read_config(folder, label=label).get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"--hf {hf}: model_type {model_type!r}: multihead {command} takes only the models multihead loads into "
            f"its own modules (model_type {', '.join(map(repr, SUPPORTED))}); to mask heads of any transformers "
            "model use multihead.hf.head_mask"
        )
    return folder, model_type


def shakespeare_tokens(tokenizer, vocab_size: int, part: str, hf: str) -> np.ndarray:
    """[N] int64 ids of the "train" or "val" part of Shakespeare's text.

    Raises:
        ValueError: an id outside the model's vocabulary.
    """
    from ..train.corpus import load_corpus

    corpus = load_corpus("shakespeare")
    lines = getattr(corpus, part).splitlines(keepends=True)
    pieces = ["".join(lines[i : i + PIECE_LINES]) for i in range(0, len(lines), PIECE_LINES)]
    ids = [i for enc in tokenizer.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
    tokens = np.asarray(ids, dtype=np.int64)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(f"--hf {hf}: tokenizer.json produced id {int(tokens.max())}, but vocab_size is {vocab_size}")
    return tokens


def gpt2_calibration(model, tokenizer, count: int, batch_size: int, seed: int, hf: str) -> list[torch.Tensor]:
    """``count`` batches [batch_size, T] of windows of the Shakespeare training text."""
    from ..train.batches import Batches

    tokens = shakespeare_tokens(tokenizer, model.config.vocab_size, "train", hf)
    batches = Batches(tokens, batch_size=batch_size, context_length=model.config.context_length, seed=seed)
    return [batches.get(i)[0] for i in range(count)]  # x of each (x, y): (B, T)


def gpt2_validation(model, tokenizer, batch_size: int, hf: str):
    """(loss function of a model, description): the LM loss on fixed held-out windows."""
    import torch.nn.functional as F

    from ..train.batches import val_batches

    T = model.config.context_length
    tokens = shakespeare_tokens(tokenizer, model.config.vocab_size, "val", hf)
    count = max(1, VAL_WINDOWS // batch_size)
    sets = val_batches(tokens, batch_size=batch_size, context_length=T, num_batches=count, seed=VAL_SEED)

    @torch.no_grad()
    def loss(net) -> float:
        total = sum(float(F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum")) for x, y in sets)
        return total / sum(y.numel() for _, y in sets)

    return loss, f"{count} batches x {batch_size} x {T} tokens of the Shakespeare validation text"
