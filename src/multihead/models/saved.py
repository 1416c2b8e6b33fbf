"""One loader for every model folder multihead writes: it reads what the folder holds.

    load_model("runs/mini-pruned")    -> GPT               (save_checkpoint: multihead train,
                                                            prune and convert of a GPT)
    load_model("minilm-half")         -> SentenceEncoder   (save_sentence_encoder: prune and
                                                            convert of MiniLM or a BERT)

The kind is read from the ``format`` the writers put in the weights'
safetensors header (``__metadata__``) and in ``config.json``::

    "multihead.gpt"                 GPT checkpoint       models.checkpoint.load_checkpoint
    "multihead.sentence_encoder"    sentence encoder     models.minilm.load_sentence_encoder

``saved_kind`` answers without reading any weights (the header and a
small JSON file only), so commands can choose their path before loading.
A Hugging Face folder (``model_type`` in its config.json) is named as such
in the refusal: ``multihead.hf`` reads those.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..io import read_json_file, read_safetensors_header
from .checkpoint import FORMAT as GPT_FORMAT
from .checkpoint import checkpoint_paths, load_checkpoint
from .minilm import SENTENCE_FORMAT, load_sentence_encoder

__all__ = ["KINDS", "saved_kind", "load_model"]

KINDS = {GPT_FORMAT: "gpt", SENTENCE_FORMAT: "sentence_encoder"}


def _header_format(weights: Path) -> str | None:
    try:
        with open(weights, "rb") as f:
            return read_safetensors_header(f, weights).metadata.get("format")
    except (OSError, ValueError):
        return None  # the loader itself gives the precise refusal


def saved_kind(path: str | os.PathLike) -> str:
    """"gpt" or "sentence_encoder": what the multihead folder (or file pair) at ``path`` holds.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: neither kind (a Hugging Face folder, another format); the
            message says what was found.
    """
    config_path, weights_path = checkpoint_paths(path)
    if weights_path.is_file():
        found = KINDS.get(_header_format(weights_path))
        if found is not None:
            return found
    if not config_path.is_file():
        if not Path(path).exists():
            raise FileNotFoundError(f"{path}: no such file or folder")
        raise FileNotFoundError(f"{path}: no {config_path.name} or {weights_path.name} of a multihead model in it")
    data = read_json_file(config_path)
    found = KINDS.get(data.get("format"))
    if found is not None:
        return found
    if "model_type" in data:
        raise ValueError(
            f"{path} is a Hugging Face folder (model_type {data['model_type']!r}), not a multihead model folder: "
            "read it with multihead.hf.load_gpt2_folder or load_sentence_encoder_folder (--hf on the command line)"
        )
    raise ValueError(
        f"{config_path} has format {data.get('format')!r}; a multihead model folder has one of {sorted(KINDS)}"
    )


def load_model(path: str | os.PathLike):
    """The model saved at ``path``, whichever multihead writer saved it, in eval mode.

    Args:
        path: a folder written by ``save_checkpoint`` or ``save_sentence_encoder``
            (what ``multihead prune`` and ``multihead convert`` write), or a
            ``name.safetensors`` / ``name.json`` checkpoint pair.

    Returns:
        a ``GPT`` or a ``SentenceEncoder`` (per-layer head counts and
        key/value heads as saved).

    Raises:
        FileNotFoundError: a missing folder or file.
        ValueError: a folder of neither kind, or a corrupt or mismatched file
            (as the two loaders refuse them).
    """
    if saved_kind(path) == "gpt":
        return load_checkpoint(path).eval()
    return load_sentence_encoder(path)
