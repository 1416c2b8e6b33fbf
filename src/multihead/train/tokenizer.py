"""Tokenizers for training: raw UTF-8 bytes, or byte-level BPE learned from the corpus.

Both kinds map any text to ids and back, and both round-trip exactly
(``decode(encode(text)) == text``) for every str; a list of ids that cuts a
multi-byte character in two decodes with U+FFFD in its place::

    "hé!"   --bytes-->  [104, 195, 169, 33]             vocab_size 256
    "hé!"   --bpe---->  [ids of byte pieces and merges]  vocab_size as asked (>= 257)

The BPE kind is the GPT-2 scheme, trained with Hugging Face ``tokenizers``:
a ByteLevel pre-tokenizer (the GPT-2 split, no prefix space) over the 256
byte symbols, then ``vocab_size - 256`` merges learned from the training text.
It has no special tokens.

Saved form (JSON only, read back by :func:`load_tokenizer_dir`)::

    directory/
      tokenizer_meta.json    {"format": 1, "kind": "bytes" | "bpe", "vocab_size": N}
      tokenizer.json         the BPE kind only: the ``tokenizers`` file
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from multihead.io import read_json_file, write_text_atomic

__all__ = [
    "TOKENIZER_KINDS",
    "ByteTokenizer",
    "BPETokenizer",
    "train_tokenizer",
    "load_tokenizer_dir",
]

TOKENIZER_KINDS = ("bytes", "bpe")
META_FILE = "tokenizer_meta.json"
BPE_FILE = "tokenizer.json"
_FORMAT = 1
_BYTES = 256


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"the text must be a str, got {type(text).__name__}")


def _check_ids(ids: object, vocab_size: int) -> list[int]:
    try:
        out = [int(i) for i in ids]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise TypeError(f"ids must be a sequence of integers, got {type(ids).__name__}") from None
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return out


def _write_meta(directory: Path, kind: str, vocab_size: int) -> None:
    meta = {"format": _FORMAT, "kind": kind, "vocab_size": vocab_size}
    write_text_atomic(directory / META_FILE, json.dumps(meta, indent=2) + "\n")


class ByteTokenizer:
    """Each UTF-8 byte of the text is one token (ids 0..255).

    Attributes:
        kind: ``"bytes"``.
        vocab_size: 256.
    """

    kind = "bytes"
    vocab_size = _BYTES

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, [len(text.encode("utf-8"))]."""
        _check_text(text)
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text of ``ids`` [N]; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(_check_ids(ids, _BYTES)).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer_meta.json`` into ``directory`` (created if missing); return it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _write_meta(directory, self.kind, self.vocab_size)
        return directory

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(self.kind)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) around a Hugging Face ``tokenizers.Tokenizer``.

    Build one with :meth:`train` (or :func:`train_tokenizer`) or load one
    with :func:`load_tokenizer_dir`.

    Args:
        tokenizer: a byte-level BPE ``tokenizers.Tokenizer`` without special tokens.

    Attributes:
        kind: ``"bpe"``.
        vocab_size: number of ids, 256 byte symbols plus the learned merges.
    """

    kind = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size())

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn ``vocab_size - 256`` merges from ``text``.

        Args:
            text: the training text.
            vocab_size: the number of ids wanted, at least 257.

        Raises:
            ValueError: ``vocab_size`` below 257, or more than ``text`` can give
                (a short text has few distinct adjacent pairs to merge).
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        _check_text(text)
        _check_vocab_size(vocab_size)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=0,
            show_progress=False,
            special_tokens=[],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator([text], trainer=trainer)
        got = tokenizer.get_vocab_size()
        if got != vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is more than the training text ({len(text)} characters) "
                f"gives: it yields {got} tokens; ask for at most {got} or train on more text"
            )
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, [N]."""
        _check_text(text)
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids) -> str:
        """The text of ``ids`` [N]; a cut multi-byte character becomes U+FFFD."""
        return self._tokenizer.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_meta.json`` into ``directory``; return it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(directory / BPE_FILE, self._tokenizer.to_str())
        _write_meta(directory, self.kind, self.vocab_size)
        return directory

    def to_str(self) -> str:
        """The ``tokenizer.json`` text."""
        return self._tokenizer.to_str()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and self.to_str() == other.to_str()

    def __hash__(self) -> int:
        return hash((self.kind, self.vocab_size))

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _check_vocab_size(vocab_size: object) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < _BYTES + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE: at least {_BYTES + 1}")


def train_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> ByteTokenizer | BPETokenizer:
    """A tokenizer of ``kind`` for ``text``.

    Args:
        kind: ``"bytes"`` or ``"bpe"``.
        text: the training text (unused by ``"bytes"``).
        vocab_size: ``"bpe"``: required, at least 257. ``"bytes"``: None or 256.

    Raises:
        ValueError: unknown kind, or a vocab_size the kind cannot have.
    """
    if kind == "bytes":
        if vocab_size is not None and vocab_size != _BYTES:
            raise ValueError(f"the bytes tokenizer has vocab_size 256, got vocab_size={vocab_size!r}")
        return ByteTokenizer()
    if kind == "bpe":
        if vocab_size is None:
            raise ValueError("the bpe tokenizer needs a vocab_size (at least 257), got None")
        return BPETokenizer.train(text, vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")


def load_tokenizer_dir(directory: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """The tokenizer that ``save(directory)`` wrote.

    Raises:
        ValueError: a missing or unreadable ``tokenizer_meta.json``, an unknown
            kind, or a ``tokenizer.json`` that is unreadable or whose size
            differs from the metadata.
    """
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{directory}: no {META_FILE} (not a directory written by a tokenizer's save)")
    meta = read_json_file(meta_path)
    kind, vocab_size = meta.get("kind"), meta.get("vocab_size")
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, this version reads format {_FORMAT}")
    if kind == "bytes":
        if vocab_size != _BYTES:
            raise ValueError(f"{meta_path}: the bytes tokenizer has vocab_size 256, the file says {vocab_size!r}")
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"{meta_path}: unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")
    from tokenizers import Tokenizer

    bpe_path = directory / BPE_FILE
    try:
        tokenizer = Tokenizer.from_file(str(bpe_path))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{bpe_path}: not a readable tokenizer.json ({reason})") from None
    if type(tokenizer.model).__name__ != "BPE":
        raise ValueError(f"{bpe_path}: a {type(tokenizer.model).__name__} tokenizer, not byte-level BPE")
    out = BPETokenizer(tokenizer)
    if out.vocab_size != vocab_size:
        raise ValueError(f"{bpe_path}: vocab_size {out.vocab_size}, but {meta_path} says {vocab_size!r}")
    return out
