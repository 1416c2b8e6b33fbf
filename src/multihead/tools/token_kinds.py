"""Which tokens are special, punctuation or rare: the keys the head roles score.

    is_special("[SEP]"), is_special("<|endoftext|>")     # True, True
    is_punctuation("Ġ,")                                 # True: after the byte-level space
    rare_tokens(["the", "cat", "the", "dog"], k=2)       # ['cat', 'dog']

Tokens are read by their strings, as tokenizers print them: a leading
WordPiece "##", GPT-2 byte-level "Ġ" or SentencePiece "▁" is not part of
the word. ``tools.roles`` scores the cls/sep/punct/rare roles on these sets.
"""

from __future__ import annotations

import numbers
import re
import string
import unicodedata
from collections.abc import Mapping, Sequence

from .._checks import positive_int

__all__ = ["CLS_TOKENS", "SEP_TOKENS", "is_special", "is_punctuation", "rare_tokens"]

#: Tokens that open a sequence (BERT, RoBERTa/T5-style, Llama-style).
CLS_TOKENS = frozenset({"[CLS]", "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>"})
#: Tokens that separate or end a sequence. GPT-2's ``<|endoftext|>`` is here by
#: its name, also when a prompt starts with it.
SEP_TOKENS = frozenset({"[SEP]", "</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>"})
_SPECIAL = CLS_TOKENS | SEP_TOKENS | {"[PAD]", "[UNK]", "[MASK]", "<pad>", "<unk>", "<mask>"}
_SPECIAL_PATTERN = re.compile(r"<\|[^|]*\|>|\[unused\d+\]")
_MARKER = re.compile(r"^(##|Ġ|▁)")  # WordPiece continuation, GPT-2 byte-level space, SentencePiece space


def is_special(token: str) -> bool:
    """True for special tokens recognised by their string ([CLS], </s>, <|...|>, ...)."""
    return token in _SPECIAL or bool(_SPECIAL_PATTERN.fullmatch(token))


def _strip_marker(token: str) -> str:
    return _MARKER.sub("", token, count=1)


def is_punctuation(token: str) -> bool:
    """True when every character (after a leading "##", "Ġ" or "▁") is in
    ``string.punctuation`` or a unicode P* category (Clark et al. 2019 track
    attention to periods and commas beside [CLS] and [SEP])."""
    text = _strip_marker(token)
    return (
        bool(text)
        and not is_special(token)
        and all(ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in text)
    )


def rare_tokens(
    tokens: Sequence[str],
    *,
    k: int = 1,
    token_frequencies: Mapping[str, float] | None = None,
    token_ids: Sequence[int] | None = None,
) -> list[str]:
    """The ``k`` least frequent distinct tokens of ``tokens``, rarest first.

    Special tokens and punctuation are never candidates. Frequencies come from
    ``token_frequencies`` (e.g. corpus counts; a token missing from it counts
    as 0, the rarest) or else from the counts inside ``tokens``. Ties are
    broken, in order, by: the larger vocabulary id (``token_ids``, aligned
    with ``tokens``) -- a heuristic that holds only for roughly
    frequency-ordered vocabularies such as BERT's WordPiece or GPT-2's BPE
    merges; the longer string without its "##"/"Ġ" marker -- Zipf's law of
    abbreviation, again a heuristic; and finally the earlier first position.

    Raises:
        TypeError: ``k`` not an int, a frequency that is not a number.
        ValueError: ``k`` < 1, ``token_ids`` of another length than ``tokens``.
    """
    k = positive_int("k", k)
    tokens = list(tokens)
    if token_ids is not None and len(token_ids) != len(tokens):
        raise ValueError(f"token_ids has {len(token_ids)} entries but there are {len(tokens)} tokens")
    first: dict[str, int] = {}
    counts: dict[str, int] = {}
    ids: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if is_special(tok) or is_punctuation(tok):
            continue
        first.setdefault(tok, i)
        counts[tok] = counts.get(tok, 0) + 1
        if token_ids is not None:
            ids[tok] = max(ids.get(tok, int(token_ids[i])), int(token_ids[i]))

    def frequency(tok: str) -> float:
        if token_frequencies is None:
            return float(counts[tok])
        value = token_frequencies.get(tok, 0.0)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"token_frequencies[{tok!r}] must be a number, got {value!r}")
        return float(value)

    order = sorted(first, key=lambda t: (frequency(t), -ids.get(t, 0), -len(_strip_marker(t)), first[t]))
    return order[:k]
