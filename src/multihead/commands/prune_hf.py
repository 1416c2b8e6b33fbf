"""``multihead prune --hf DIR``: a local Hugging Face folder read into multihead's own models.

    DIR/config.json         model_type "bert"  ->  SentenceEncoder (BertEncoder + pooling)
    DIR/model.safetensors   model_type "gpt2"  ->  GPT (weights via convert.hf_gpt2)
    DIR/tokenizer.json      the text -> ids of calibration and fidelity

Only architectures multihead can load into its own modules are pruned here
(``SUPPORTED``): heads are removed from multihead's modules, and the pruned
model is saved in multihead's format, because a Hugging Face config holds one
head count for all layers. Masking heads of any transformers model, without
removing them, is ``multihead.hf.head_mask``.

BERT: a sentence-transformers folder (``modules.json``,
``sentence_bert_config.json`` and ``1_Pooling/config.json``) is read with
``SentenceEncoder.from_folder``, which honours its pooling and normalisation;
any other BERT folder gets mean pooling over real tokens, L2-normalised,
inputs truncated to ``min(512, max_position_embeddings)`` tokens.

GPT-2: token ids of Shakespeare's text (``train.corpus.load_corpus``: the
training part for calibration, the validation part for fidelity) through the
folder's tokenizer.json, special tokens not added, encoded in pieces of
``PIECE_LINES`` lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["SUPPORTED", "PIECE_LINES", "VAL_WINDOWS", "VAL_SEED", "check_folder", "load_encoder", "load_gpt2",
           "shakespeare_tokens", "gpt2_calibration", "gpt2_validation"]  # fmt: skip

SUPPORTED = ("bert", "gpt2")
PIECE_LINES = 1000
VAL_WINDOWS = 64  # held-out windows of the context length for the GPT-2 fidelity
VAL_SEED = 1234
_ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")


def check_folder(hf: str) -> tuple[Path, str]:
    """(folder, model_type) of ``--hf``, refused before any weights are read.

    Raises:
        ValueError: no such folder; no config.json, tokenizer.json or
            model.safetensors in it; an unreadable config.json; a model_type
            prune does not take (the message names the supported ones and
            ``multihead.hf.head_mask``).
    """
    folder = Path(hf)
    if not folder.is_dir():
        raise ValueError(f"--hf {hf}: no such folder (expected a Hugging Face model folder)")
    for name, what in (("config.json", "the model's configuration"), ("tokenizer.json", "its tokenizers file"),
                       ("model.safetensors", "the weights, in one safetensors file")):  # fmt: skip
        if not (folder / name).is_file():
            raise ValueError(f"--hf {hf}: no {name} in it ({what})")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf {hf}: config.json is not valid JSON ({e})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED:
        raise ValueError(
            f"--hf {hf}: model_type {model_type!r} cannot be pruned: prune removes heads from the models multihead "
            f"loads itself (model_type {', '.join(map(repr, SUPPORTED))}); to mask heads of any transformers model "
            "without removing them use multihead.hf.head_mask"
        )
    return folder, model_type


def _read_tokenizer(file: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file}: not a readable tokenizer.json ({reason})") from None


def load_encoder(folder: Path):
    """(SentenceEncoder in eval mode, how it pools) for a BERT folder."""
    from ..models.bert import BertEncoder
    from ..models.minilm import SentenceEncoder

    if all((folder / name).is_file() for name in _ST_FILES):
        model = SentenceEncoder.from_folder(folder)
        norm = ", L2-normalised" if model.normalize else ""
        return model, f"{model.pooling} pooling{norm} (the folder's sentence-transformers 1_Pooling/config.json)"
    encoder = BertEncoder.from_pretrained(folder)
    length = min(512, encoder.config.max_position_embeddings)
    model = SentenceEncoder(encoder, _read_tokenizer(folder / "tokenizer.json"), max_seq_length=length,
                            pooling="mean", normalize=True).eval()  # fmt: skip
    return model, "mean pooling over real tokens, L2-normalised (no sentence-transformers pooling in the folder)"


def load_gpt2(folder: Path):
    """(GPT in eval mode, tokenizers.Tokenizer) for a GPT-2 folder."""
    from ..convert.hf_gpt2 import gpt_from_hf_state_dict
    from ..models.bert import load_safetensors
    from ..models.gpt import GPTConfig

    config = GPTConfig.from_hf_config(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    model = gpt_from_hf_state_dict(load_safetensors(folder / "model.safetensors"), config).eval()
    tokenizer = _read_tokenizer(folder / "tokenizer.json")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return model, tokenizer


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
