"""``init_from`` (``--init-from DIR``): fine-tuning a Hugging Face GPT-2 folder.

    DIR/config.json          GPT2Config: the model's sizes and context length
    DIR/model.safetensors    the weights (``convert.hf_gpt2.gpt_from_hf_state_dict``)
    DIR/tokenizer.json       its byte-level BPE tokenizer (``tokenizers``)

A fresh run takes all three: the model is the folder's (its vocabulary and
context length; ``--dropout`` applies), the run's tokenizer is a copy of the
folder's, and the first step starts from its weights. A resumed run reads
none of them (the checkpoint holds the model, the run directory the
tokenizer), so the folder may be gone by then.
"""

from __future__ import annotations

from pathlib import Path

from ..models.gpt import GPT, GPTConfig
from .tokenizer import BPETokenizer

__all__ = ["FOLDER_FILES", "folder_model_config", "folder_tokenizer", "check_folder", "load_folder_weights"]

FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _folders():
    """``multihead.hf.folders``, imported when a folder is read: importing ``multihead.hf``
    registers the transformers bridge, which ``import multihead.train`` must not pay for."""
    from ..hf import folders

    return folders


def _folder(path: str) -> Path:
    return _folders().model_folder(path, FOLDER_FILES, label=f"init_from {path}")


def folder_model_config(path: str) -> GPTConfig:
    """The GPTConfig of the folder's GPT-2 (``GPTConfig.from_hf_config``).

    Raises:
        ValueError: not a folder with the three files, a config that is not
            GPT-2's or that this GPT does not implement.
    """
    folder = _folder(path)
    values = _folders().read_config(folder, label=f"init_from {path}")
    if values.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"init_from {path}: a {values.get('model_type')!r} model, not GPT-2 (model_type 'gpt2')")
    try:
        return GPTConfig.from_hf_config(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"init_from {path}: {e}") from None


def folder_tokenizer(path: str) -> BPETokenizer:
    """The folder's tokenizer.json as the run's BPE tokenizer (no truncation, no padding).

    Raises:
        ValueError: an unreadable file, or a tokenizer that is not BPE.
    """
    tokenizer = _folders().read_tokenizer(_folder(path) / "tokenizer.json")
    if type(tokenizer.model).__name__ != "BPE":
        raise ValueError(f"init_from {path}: a {type(tokenizer.model).__name__} tokenizer, not byte-level BPE")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return BPETokenizer(tokenizer)


def check_folder(path: str, context_length: int) -> GPTConfig:
    """Everything about the folder that can be known before a run writes anything;
    returns its GPTConfig.

    Raises:
        ValueError: see :func:`folder_model_config` and :func:`folder_tokenizer`;
            a tokenizer with more ids than the model's vocabulary; a
            ``context_length`` longer than the model's.
    """
    config = folder_model_config(path)
    vocab = folder_tokenizer(path).vocab_size
    if vocab > config.vocab_size:
        raise ValueError(
            f"init_from {path}: its tokenizer has {vocab} ids, more than the model's vocab_size={config.vocab_size}"
        )
    if context_length > config.context_length:
        raise ValueError(
            f"context_length={context_length} is longer than the init_from model allows "
            f"(n_positions={config.context_length} in {path}/config.json)"
        )
    return config


def load_folder_weights(model: GPT, path: str) -> None:
    """Copy the folder's weights into ``model`` (built from :func:`folder_model_config`).

    Raises:
        ValueError: missing, unexpected or mis-shaped tensors (naming the file).
    """
    import torch

    from ..convert.hf_gpt2 import gpt_from_hf_state_dict
    from ..models.bert_weights import load_safetensors

    weights = _folder(path) / "model.safetensors"
    try:
        loaded = gpt_from_hf_state_dict(load_safetensors(weights), model.config)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict())
