"""The texts of ``corpus_roles`` as token ids, and one padded batch of them run under capture.

Texts are strings, encoded with a ``tokenizers.Tokenizer`` (its own
truncation and padding ignored) or, without one, as UTF-8 bytes (a
byte-level GPT); or ``(ids, tokens)`` pairs already encoded. A text longer
than ``max_length`` is refused, or with ``truncate`` cut to its first tokens
(a tokenizer's closing special tokens, such as [SEP], kept).

Models (``model_runner``):

    SentenceEncoder (load_minilm)   its .encoder(ids, attention_mask=mask), tools.capture
    a module with multihead attention (GPT, BertEncoder, ...)
                                    model(ids, attention_mask=mask), tools.capture
    a transformers model running attn_implementation="multihead"
                                    model(input_ids=ids, attention_mask=mask), hf.capture

A batch is padded on the right with id 0 to its longest text; ``mask`` [B, T]
is True on real tokens. Every model above leaves padded keys out of each
real query, and ``AttentionRecord.item`` leaves the padding out of the scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn

from .capture import AttentionRecord, attention_modules, capture

__all__ = ["encode_texts", "model_limit", "model_vocab", "model_runner", "run_batch"]


def _byte_token(b: int) -> str:
    return chr(b) if 32 <= b < 127 else f"\\x{b:02x}"


def model_limit(model: nn.Module) -> int | None:
    """The longest input ``model`` takes: a sentence encoder's ``max_seq_length``, a GPT's
    ``context_length``, a transformers config's ``max_position_embeddings``/``n_positions``; else None."""
    if isinstance(getattr(model, "max_seq_length", None), int):
        return model.max_seq_length
    config = getattr(model, "config", None)
    for name in ("context_length", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def model_vocab(model: nn.Module) -> int | None:
    """The number of token ids ``model`` (or a sentence encoder's ``.encoder``) knows; None when it says none."""
    for m in (model, getattr(model, "encoder", None)):
        value = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _cut(ids: list[int], tokens: list[str], special: list[bool], limit: int) -> tuple[list[int], list[str]]:
    """The first tokens and the closing special ones, ``limit`` in all."""
    closing = 0
    while closing < min(len(ids), limit - 1) and special[len(ids) - 1 - closing]:
        closing += 1
    keep = list(range(limit - closing)) + list(range(len(ids) - closing, len(ids)))
    return [ids[i] for i in keep], [tokens[i] for i in keep]


def encode_texts(
    texts: Sequence,
    tokenizer=None,
    *,
    max_length: int | None = None,
    truncate: bool = False,
    vocab_size: int | None = None,
) -> list[tuple[list[int], list[str]]]:
    """(ids, tokens) of every text (see the module docstring); ``vocab_size``: the model's, when known.

    Raises:
        TypeError: texts not a list, an item that is neither a str nor an (ids, tokens) pair.
        ValueError: no texts, an empty text, ids and tokens of different lengths,
            a text longer than ``max_length`` without ``truncate``, an id the
            model does not have, a string without a tokenizer for a model
            whose vocabulary is not 256 bytes.
    """
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a list of str (or of (ids, tokens) pairs), got {type(texts).__name__}")
    if not texts:
        raise ValueError("texts is empty: give at least one text")
    whole = None
    if tokenizer is not None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        whole = Tokenizer.from_str(tokenizer.to_str())  # a copy: the caller's truncation and padding stay
        whole.no_truncation()
        whole.no_padding()
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if not text.strip():
                raise ValueError(f"texts[{i}] {text!r} is empty or only whitespace")
            if whole is None:
                if vocab_size not in (None, 256):
                    raise ValueError(f"texts[{i}] is a string but there is no tokenizer, and the model's vocabulary "
                                     f"has {vocab_size} tokens, not 256 bytes: pass tokenizer=")  # fmt: skip
                ids = list(text.encode("utf-8"))
                tokens, special = [_byte_token(b) for b in ids], [False] * len(ids)
            else:
                enc = whole.encode(text)
                ids, tokens, special = list(enc.ids), list(enc.tokens), [bool(s) for s in enc.special_tokens_mask]
        elif isinstance(text, (tuple, list)) and len(text) == 2:
            ids, tokens = [int(t) for t in text[0]], [str(t) for t in text[1]]
            if len(ids) != len(tokens) or not ids:
                raise ValueError(f"texts[{i}] has {len(ids)} ids and {len(tokens)} tokens: give as many of each, at least one")
            special = [False] * len(ids)
        else:
            raise TypeError(f"texts[{i}] must be a str or an (ids, tokens) pair, got {type(text).__name__}")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"texts[{i}] has token id {max(ids)}, but the model's vocab_size is {vocab_size}")
        if max_length is not None and len(ids) > max_length:
            if not truncate:
                raise ValueError(f"texts[{i}] is {len(ids)} tokens, more than the model's maximum of {max_length}: "
                                 "shorten it or pass truncate=True")  # fmt: skip
            ids, tokens = _cut(ids, tokens, special, max_length)
        out.append((ids, tokens))
    return out


def model_runner(model: nn.Module, layers: Sequence[int] | None = None):
    """(module, forward(ids, mask), capturing()) for ``model`` (see the module docstring);
    ``layers`` keeps those attention calls only (``capture(layers=)`` on multihead modules)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    module = model.encoder if hasattr(model, "encoder") and hasattr(model, "max_seq_length") else model
    if attention_modules(module):
        count = len(attention_modules(module))
        for layer in layers or ():
            if not 0 <= layer < count:
                raise ValueError(f"layer {layer} out of range: the model has layers 0..{count - 1}")

        def forward(ids: torch.Tensor, mask: torch.Tensor) -> None:
            module(ids, attention_mask=mask)

        return module, forward, lambda: capture(module, layers=None if layers is None else list(layers))
    from ..hf.scopes import capture as hf_capture  # raises for a model without multihead attention

    def forward_hf(ids: torch.Tensor, mask: torch.Tensor) -> None:
        module(input_ids=ids, attention_mask=mask)

    return module, forward_hf, lambda: hf_capture(module)


def run_batch(
    runner: tuple[nn.Module, Callable, Callable[[], AbstractContextManager]],
    batch: Sequence[tuple[list[int], list[str]]],
    layers: Sequence[int] | None = None,
) -> AttentionRecord:
    """Capture one padded batch: weights [B, H, T, T], one token list per item, ``attention_mask`` [B, T]."""
    module, forward, capturing = runner
    T = max(len(ids) for ids, _ in batch)
    device = next(module.parameters()).device if any(True for _ in module.parameters()) else torch.device("cpu")
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, (item, _) in enumerate(batch):
        ids[b, : len(item)] = torch.tensor(item)
        mask[b, : len(item)] = True
    with torch.no_grad(), capturing() as record:
        forward(ids.to(device), mask.to(device))
    if layers is not None and not attention_modules(module):  # hf.capture records every call
        count = record.num_layers
        for layer in layers:
            if not 0 <= layer < count:
                raise ValueError(f"layer {layer} out of range: the model has layers 0..{count - 1}")
        record.layers = [record.layers[layer] for layer in layers]
    record.query_tokens = [list(tokens) for _, tokens in batch]
    record.attention_mask = mask
    return record
