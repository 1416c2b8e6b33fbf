"""The tokens ``multihead inspect`` feeds a model, with what was cut or not understood.

A text is encoded whole first (no truncation), so its full length is known.
When it is longer than the model's maximum the command refuses it, or, with
``--truncate``, keeps the first tokens and the closing special tokens, as the
Hugging Face tokenizers do for one sequence (strategy ``longest_first``)::

    [CLS] w0 w1 ... w300 [SEP]   limit 256  ->  [CLS] w0 ... w253 [SEP]

``Encoded.analysed`` is the part of the text the kept tokens cover, and the
words the tokenizer could only map to its unknown token are counted, so the
command can say when the model did not understand most of the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..paths import input_file

__all__ = ["Encoded", "check_text", "encode_text", "encode_bytes", "notices", "load_tokenizer"]

UNKNOWN_SHARE = 0.25  # a notice when more than this share of the words became the unknown token


@dataclass
class Encoded:
    """The token ids a model reads for one text.

    Attributes:
        ids: the ids fed to the model, at most ``limit``.
        tokens: their strings.
        analysed: the part of the text the kept tokens cover.
        total: tokens of the whole text (special tokens included).
        limit: the model's maximum number of tokens.
        words: words in ``analysed`` (as the tokenizer splits them).
        unknown_words: of these, the words mapped to ``unk_token``.
        unk_token: the tokenizer's unknown token, None when it has none.
    """

    ids: list[int]
    tokens: list[str]
    analysed: str
    total: int
    limit: int
    words: int = 0
    unknown_words: int = 0
    unk_token: str | None = None

    @property
    def truncated(self) -> bool:
        return self.total > len(self.ids)


def check_text(text: str) -> None:
    """ValueError for a text with nothing to analyse (empty or only whitespace)."""
    if not isinstance(text, str):
        raise TypeError(f"the text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"the text {text!r} is empty or only whitespace: give a sentence to inspect")


def _too_long(total: int, limit: int, model: str, unit: str) -> ValueError:
    return ValueError(
        f"the text is {total} {unit}, more than {model}'s maximum of {limit}: shorten it, "
        f"or pass --truncate to analyse only the first {limit}"
    )


def encode_text(tokenizer, text: str, limit: int, *, model: str, truncate: bool = False) -> Encoded:
    """Encode ``text`` with a ``tokenizers.Tokenizer`` (its own truncation and padding ignored).

    Args:
        tokenizer: a Hugging Face ``tokenizers.Tokenizer``; not modified.
        text: the input.
        limit: the model's maximum number of tokens.
        model: the model's name for messages.
        truncate: keep the first tokens instead of refusing a long text.

    Raises:
        ValueError: empty text, a text that encodes to special tokens only,
            or, without ``truncate``, more than ``limit`` tokens.
    """
    from tokenizers import Tokenizer

    check_text(text)
    whole = Tokenizer.from_str(tokenizer.to_str())  # a copy, so the caller's settings stay
    whole.no_truncation()
    whole.no_padding()
    enc = whole.encode(text)
    ids, tokens, special = list(enc.ids), list(enc.tokens), list(enc.special_tokens_mask)
    if all(special):
        raise ValueError(f"the text {text!r} encodes to no tokens besides special ones {tokens}: nothing to inspect")
    total = len(ids)
    keep = list(range(total))
    if total > limit:
        if not truncate:
            raise _too_long(total, limit, model, "tokens")
        closing = 0  # special tokens at the end ([SEP]) stay, as HF truncation keeps them
        while closing < min(total, limit - 1) and special[total - 1 - closing]:
            closing += 1
        keep = list(range(limit - closing)) + list(range(total - closing, total))
    kept_text = [i for i in keep if not special[i]]
    if not kept_text:
        raise ValueError(f"{model}'s maximum of {limit} tokens leaves no room for the text beside its special tokens")
    end = max(enc.offsets[i][1] for i in kept_text)
    unk = getattr(whole.model, "unk_token", None)
    words = {enc.word_ids[i] for i in kept_text if enc.word_ids[i] is not None}
    unknown = {enc.word_ids[i] for i in kept_text if enc.word_ids[i] is not None and tokens[i] == unk}
    return Encoded(
        ids=[ids[i] for i in keep],
        tokens=[tokens[i] for i in keep],
        analysed=text[:end],
        total=total,
        limit=limit,
        words=len(words),
        unknown_words=len(unknown),
        unk_token=unk,
    )


def _byte_token(b: int) -> str:
    """A readable label for one byte of a byte-level model."""
    return chr(b) if 32 <= b < 127 else f"\\x{b:02x}"


def encode_bytes(text: str, limit: int, *, model: str, truncate: bool = False) -> Encoded:
    """Encode ``text`` as UTF-8 bytes (a byte-level model, vocabulary 256).

    Raises:
        ValueError: empty text or, without ``truncate``, more than ``limit`` bytes.
    """
    check_text(text)
    ids = list(text.encode("utf-8"))
    total = len(ids)
    if total > limit and not truncate:
        raise _too_long(total, limit, model, "bytes")
    ids = ids[:limit]
    analysed = bytes(ids).decode("utf-8", errors="ignore")  # a character cut in half is left out
    return Encoded(ids, [_byte_token(b) for b in ids], analysed, total, limit, words=len(analysed.split()))


def notices(encoded: Encoded, *, model: str, language_note: str = "") -> list[str]:
    """Plain-text notices about ``encoded``: what was cut, what was not understood."""
    out = []
    if encoded.truncated:
        tail = encoded.analysed[-40:].lstrip()
        out.append(
            f"the text is {encoded.total} tokens, more than {model}'s maximum of {encoded.limit}: "
            f"only the first {len(encoded.ids)} were analysed, up to \"...{tail}\" (--truncate)"
        )
    if encoded.words and encoded.unknown_words > UNKNOWN_SHARE * encoded.words:
        out.append(
            f"{encoded.unknown_words} of {encoded.words} words became {encoded.unk_token} "
            f"(unknown to the tokenizer){language_note}: roles and links on this text say little"
        )
    return out


def load_tokenizer(path: str):
    """A Hugging Face ``tokenizer.json`` given with ``--tokenizer``.

    Raises:
        ValueError: the file is missing, not a file, or not a readable tokenizer.
    """
    from tokenizers import Tokenizer


    input_file("--tokenizer", path, "a Hugging Face tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type for bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--tokenizer {path}: not a readable tokenizer.json ({reason})") from None
