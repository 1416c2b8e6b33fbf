"""Local Hugging Face model folders, read into multihead's models or run on multihead attention.

    DIR/config.json          the model's configuration ("model_type")
    DIR/model.safetensors    the weights (one safetensors file)
    DIR/tokenizer.json       a ``tokenizers`` file: text -> ids

    folder = model_folder(path, ("config.json", "tokenizer.json"))   # checked, before any weights are read
    encoder, pooling = load_sentence_encoder_folder(folder)          # model_type "bert" -> SentenceEncoder
    gpt, tokenizer = load_gpt2_folder(folder)                        # model_type "gpt2" -> GPT
    model = load_transformers_folder(folder)                         # any architecture, multihead attention

The first two need no transformers: the weights go into multihead's own
``BertEncoder`` and ``GPT`` (whose heads can be removed). The third loads
the folder with transformers (``load_hf``), quietly, and says in one
ValueError why a folder transformers cannot load was refused. Nothing is
downloaded. Every error names the folder as ``label`` (default the path
itself; a command passes its flag, ``"--hf DIR"``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from torch import nn

__all__ = ["FILES", "model_folder", "read_config", "read_tokenizer", "load_sentence_encoder_folder",
           "load_gpt2_folder", "load_transformers_folder"]  # fmt: skip

# What each file of a folder holds, for messages.
FILES = {
    "config.json": "the model's configuration",
    "tokenizer.json": "its tokenizers file",
    "model.safetensors": "the weights, in one safetensors file",
}
_ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")


def model_folder(path: str | Path, files: Iterable[str] = ("config.json",), *, label: str | None = None) -> Path:
    """``path`` as a Path, checked to be a folder holding ``files``.

    Raises:
        ValueError: no such folder, or one of ``files`` missing (the message
            says what the file holds).
    """
    label = str(path) if label is None else label
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{label}: no such folder (expected a Hugging Face model folder)")
    for name in files:
        if not (folder / name).is_file():
            raise ValueError(f"{label}: no {name} in it ({FILES.get(name, 'needed')})")
    return folder


def read_config(folder: str | Path, *, label: str | None = None) -> dict:
    """The folder's config.json as a dict.

    Raises:
        ValueError: not UTF-8 JSON, or not a JSON object.
    """
    label = str(folder) if label is None else label
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{label}: config.json holds a {type(config).__name__}, not a JSON object")
    return config


def read_tokenizer(file: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json.

    Raises:
        ValueError: a file ``tokenizers`` cannot read (the message names the file).
    """
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file}: not a readable tokenizer.json ({reason})") from None


def load_sentence_encoder_folder(folder: str | Path) -> tuple[nn.Module, str]:
    """(SentenceEncoder in eval mode, how it pools) for a BERT folder.

    A sentence-transformers folder (modules.json, sentence_bert_config.json,
    1_Pooling/config.json) is read with ``SentenceEncoder.from_folder``,
    which honours its pooling and normalisation; any other BERT folder gets
    mean pooling over real tokens, L2-normalised, inputs truncated to
    ``min(512, max_position_embeddings)`` tokens.
    """
    from ..models.bert import BertEncoder
    from ..models.minilm import SentenceEncoder

    folder = Path(folder)
    if all((folder / name).is_file() for name in _ST_FILES):
        model = SentenceEncoder.from_folder(folder)
        norm = ", L2-normalised" if model.normalize else ""
        return model, f"{model.pooling} pooling{norm} (the folder's sentence-transformers 1_Pooling/config.json)"
    encoder = BertEncoder.from_pretrained(folder)
    length = min(512, encoder.config.max_position_embeddings)
    model = SentenceEncoder(encoder, read_tokenizer(folder / "tokenizer.json"), max_seq_length=length,
                            pooling="mean", normalize=True).eval()  # fmt: skip
    return model, "mean pooling over real tokens, L2-normalised (no sentence-transformers pooling in the folder)"


def load_gpt2_folder(folder: str | Path):
    """(GPT in eval mode, tokenizers.Tokenizer without truncation or padding) for a GPT-2 folder
    (config.json, model.safetensors, tokenizer.json); the tokenizer is None without a tokenizer.json."""
    from ..convert.hf_gpt2 import gpt_from_hf_state_dict
    from ..models.bert_weights import load_safetensors
    from ..models.gpt import GPTConfig

    folder = Path(folder)
    config = GPTConfig.from_hf_config(read_config(folder))
    model = gpt_from_hf_state_dict(load_safetensors(folder / "model.safetensors"), config).eval()
    if not (folder / "tokenizer.json").is_file():
        return model, None
    tokenizer = read_tokenizer(folder / "tokenizer.json")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return model, tokenizer


def load_transformers_folder(folder: str | Path, *, label: str | None = None, model_class: type | None = None) -> nn.Module:
    """``load_hf(folder, model_class)`` (default transformers' ``AutoModel``; on multihead attention,
    eval mode) without transformers' loading bar.

    Raises:
        ValueError: whatever transformers raised for a folder it cannot load
            (it raises many types: ValueError, OSError, KeyError, ...), as
            ``"{label}: not a transformers model folder (reason)"``.
    """
    from transformers.utils import logging as hf_logging

    from .bridge import load_hf

    label = str(folder) if label is None else label
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the terminal shows the command's output, not a loading bar
    try:
        return load_hf(folder, model_class)
    except Exception as e:  # transformers raises many types for a foreign folder
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{label}: not a transformers model folder ({reason})") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
