"""Token strings as people read them: spaces, line ends and byte-level markers made visible.

    readable_tokens(["Ġthe", "Ġcat", "Ċ"])      # ['␣the', '␣cat', '↵']
    readable_tokens(["[CLS]", "the", "##s"])    # unchanged: WordPiece has no markers to undo

Byte-level BPE (GPT-2, RoBERTa, Llama 3) writes every byte as a printable
character: a space is ``Ġ`` (U+0120), a newline ``Ċ``, a tab ``ĉ``, and the
bytes of "é" are ``Ã©``. A token list is read as byte-level when no token
holds a raw space and some token holds ``Ġ`` or ``Ċ`` and every character of
every token is one of the 256 byte characters; its tokens are then turned
back into their bytes and decoded as UTF-8 (a token that ends inside a
character keeps the undecodable bytes as ``\\xNN``). Every token, byte-level
or not, then shows its leading and trailing spaces as ``␣``, newlines as
``↵``, tabs as ``⇥``, carriage returns as ``␍``, and the empty token as
``∅``; spaces inside a token stay spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

__all__ = ["readable_tokens", "is_byte_level"]

_SHOWN = {"\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}


@cache
def _byte_of() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (printable bytes stand for themselves,
    the others are shifted to U+0100 and up in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def is_byte_level(tokens: Sequence[str]) -> bool:
    """True when ``tokens`` look like byte-level BPE (see the module docstring)."""
    table = _byte_of()
    marked = any("\u0120" in t or "\u010a" in t for t in tokens)
    return marked and all(ch in table for t in tokens for ch in t)


def _decode(token: str) -> str:
    table = _byte_of()
    return bytes(table[ch] for ch in token).decode("utf-8", errors="backslashreplace")


def _visible(token: str) -> str:
    if token == "":
        return "\u2205"
    core = token.strip(" ")
    lead = len(token) - len(token.lstrip(" "))
    trail = len(token) - len(token.rstrip(" ")) if core else 0
    text = "\u2423" * lead + core + "\u2423" * trail
    return "".join(_SHOWN.get(ch, ch) for ch in text)


def readable_tokens(tokens: Sequence[str]) -> list[str]:
    """Each token as it should be shown (see the module docstring); the list keeps its length."""
    tokens = list(tokens)
    if is_byte_level(tokens):
        tokens = [_decode(t) for t in tokens]
    return [_visible(t) for t in tokens]
