"""Readable tokens: byte-level BPE checked against the tokenizers library's own byte-level pre-tokenizer."""

from __future__ import annotations

import pytest

from multihead.tools.token_text import is_byte_level, readable_tokens


def test_byte_level_tokens_read_back_as_the_text():
    pre = pytest.importorskip("tokenizers").pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = "The café's law\n\tis  just!"
    tokens = [piece for piece, _ in pre.pre_tokenize_str(text)]  # GPT-2's byte characters: Ġ, Ċ, Ã©, ...
    assert is_byte_level(tokens) and any(t.startswith("\u0120") for t in tokens)
    shown = readable_tokens(tokens)
    back = "".join(shown).replace("\u2423", " ").replace("\u21b5", "\n").replace("\u21e5", "\t")
    assert back == text and "\u0120" not in "".join(shown) and "caf\u00e9" in "".join(shown)


def test_other_tokens_only_get_visible_edges():
    tokens = ["[CLS]", "the", "##s", " sat", "a b", "", "\n", "\u0120"]  # a raw space: not byte-level
    assert not is_byte_level(tokens)
    assert readable_tokens(tokens) == ["[CLS]", "the", "##s", "\u2423sat", "a b", "\u2205", "\u21b5", "\u0120"]
    assert readable_tokens(["<|endoftext|>", "Hi"]) == ["<|endoftext|>", "Hi"]  # no marker: nothing to undo


def test_a_token_that_ends_inside_a_character_keeps_its_bytes():
    assert readable_tokens(["\u0120caf", "\u00c3"]) == ["\u2423caf", "\\xc3"]  # "é" split after its first byte
