"""The tokenizer and sentence-transformers files of an export (``hf.export``).

    tokenizer_file(given, vocab_size)   -> tokenizers.Tokenizer or None: the given one (a
                                           tokenizers.Tokenizer, a multihead.train tokenizer, a
                                           tokenizer.json path), bytes for a 256-token GPT
    byte_tokenizer()                    -> ids are the UTF-8 bytes (a byte-level BPE, no merges)
    special_tokens(family, tokenizer)   -> the ids config.json names, tokenizer_config.json's tokens
    sentence_files(encoder, width)      -> modules.json, sentence_bert_config.json, 1_Pooling/config.json
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["tokenizer_file", "byte_tokenizer", "special_tokens", "sentence_files"]

_BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                  "mask_token": "[MASK]"}  # fmt: skip
_GPT_EOS = "<|endoftext|>"
_BYTES = 256


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are the UTF-8 bytes of the text (0-255):
    a byte-level BPE without merges, so each byte is one token, decoding back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    tok = Tokenizer(models.BPE(vocab={symbols[b]: b for b in range(_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_symbols() -> list[str]:
    """The character the byte-level pre-tokenizer shows for each byte: printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, extra = [], 0
    for b in range(_BYTES):
        if b in kept:
            out.append(chr(b))
        else:
            out.append(chr(_BYTES + extra))
            extra += 1
    return out


def tokenizer_file(given: Any, vocab_size: int, *, byte_default: bool):
    """A fresh ``tokenizers.Tokenizer`` (no padding or truncation) to write, or None.

    Args:
        given: a ``tokenizers.Tokenizer``, a ``multihead.train`` tokenizer
            (bytes or BPE), a tokenizer.json path, or None.
        vocab_size: the model's vocabulary.
        byte_default: None gives the byte tokenizer when ``vocab_size`` is 256.

    Raises:
        TypeError: another type.
        ValueError: an unreadable tokenizer.json, or more tokens than ``vocab_size``.
    """
    from tokenizers import Tokenizer

    if given is None:
        return byte_tokenizer() if byte_default and vocab_size == _BYTES else None
    if isinstance(given, (str, os.PathLike)):
        from .folders import read_tokenizer

        tok = read_tokenizer(given)
    elif getattr(given, "kind", None) == "bytes":
        tok = byte_tokenizer()
    elif isinstance(given, Tokenizer) or hasattr(given, "to_str"):
        tok = Tokenizer.from_str(given.to_str())
    else:
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer, a multihead.train tokenizer or a tokenizer.json path, "
            f"got {type(given).__name__}"
        )
    tok.no_padding()
    tok.no_truncation()
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}")
    return tok


def special_tokens(family: str, tok) -> tuple[dict[str, int], dict[str, str]]:
    """(ids of the special tokens config.json names, tokenizer_config.json's special tokens).

    BERT: [CLS], [SEP], [PAD], [UNK], [MASK] where the vocabulary has them
    ([PAD]'s id is ``pad_token_id``); GPT-2: ``<|endoftext|>`` as bos and
    eos where the vocabulary has it.
    """
    if tok is None:
        return {}, {}
    if family == "bert":
        named = {k: v for k, v in _BERT_SPECIALS.items() if tok.token_to_id(v) is not None}
        return ({"pad": tok.token_to_id(named["pad_token"])} if "pad_token" in named else {}), named
    eos = tok.token_to_id(_GPT_EOS)
    if eos is None:
        return {}, {}
    return {"eos": eos}, {"bos_token": _GPT_EOS, "eos_token": _GPT_EOS}


def sentence_files(sentence, width: int) -> dict[str, Any]:
    """sentence-transformers' modules.json, sentence_bert_config.json and 1_Pooling/config.json
    (name -> JSON value) for a ``SentenceEncoder``: its pooling, normalisation and max_seq_length."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if sentence.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling = {"word_embedding_dimension": width, "pooling_mode_cls_token": sentence.pooling == "cls",
               "pooling_mode_mean_tokens": sentence.pooling == "mean", "pooling_mode_max_tokens": sentence.pooling == "max",
               "pooling_mode_mean_sqrt_len_tokens": False}  # fmt: skip
    return {"modules.json": modules,
            "sentence_bert_config.json": {"max_seq_length": sentence.max_seq_length, "do_lower_case": False},
            "1_Pooling/config.json": pooling}  # fmt: skip
