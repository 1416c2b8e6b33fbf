"""Training tokenizers: bytes and byte-level BPE, round trips, save/load, errors."""

from __future__ import annotations

import json

import pytest

from multihead.train.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer_dir,
    train_tokenizer,
)

# a small training text with repeats (so merges exist) and non-ASCII characters
TRAIN_TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die: to sleep;\n"
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c \u2014 the end.\n"
) * 20

ODD_TEXTS = [
    "",
    "a",
    "To be, or not to be",
    "h\u00e9llo\r\n  w\u00f6rld \U0001f389\x00\ttabs\n\n\nend  ",
    "   leading and trailing spaces   ",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0 mixed with English and \u00e9\u00e8",
    "\ufeffbyte order mark, \u200bzero width, \ud7ff last before surrogates, \U0010ffff last code point",
]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_tokenizer("bpe", TRAIN_TEXT, vocab_size=300)


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_decode_of_a_cut_character_replaces_it():
    tok = ByteTokenizer()
    ids = tok.encode("h\u00e9!")  # [104, 195, 169, 33]
    assert tok.decode(ids[:2]) == "h\ufffd"
    assert tok.kind == "bytes" and tok.vocab_size == 256


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_bpe_round_trip_is_exact(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


def test_bpe_vocab_size_as_asked_and_merges_shorten_text(bpe):
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 300
    sample = TRAIN_TEXT[:500]
    # merges learned on this text make it shorter than its bytes
    assert len(bpe.encode(sample)) < len(sample.encode("utf-8"))


def test_bpe_training_is_deterministic(bpe):
    again = train_tokenizer("bpe", TRAIN_TEXT, vocab_size=300)
    assert again == bpe
    assert again.encode(TRAIN_TEXT[:300]) == bpe.encode(TRAIN_TEXT[:300])


def test_bpe_save_load(bpe, tmp_path):
    out = bpe.save(tmp_path / "tok")
    assert out == tmp_path / "tok"
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_meta.json"]
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    assert meta["kind"] == "bpe" and meta["vocab_size"] == 300
    loaded = load_tokenizer_dir(out)
    assert isinstance(loaded, BPETokenizer)
    assert loaded == bpe and loaded.vocab_size == 300
    for text in ODD_TEXTS + [TRAIN_TEXT]:
        assert loaded.encode(text) == bpe.encode(text)


def test_byte_save_load(tmp_path):
    out = ByteTokenizer().save(tmp_path)
    assert [p.name for p in out.iterdir()] == ["tokenizer_meta.json"]
    loaded = load_tokenizer_dir(tmp_path)
    assert isinstance(loaded, ByteTokenizer) and loaded.vocab_size == 256


def test_train_tokenizer_errors():
    with pytest.raises(ValueError, match="unknown tokenizer kind 'wordpiece'.*bytes, bpe"):
        train_tokenizer("wordpiece", "text")
    with pytest.raises(ValueError, match="needs a vocab_size"):
        train_tokenizer("bpe", TRAIN_TEXT)
    with pytest.raises(ValueError, match="vocab_size=256 is too small.*257"):
        train_tokenizer("bpe", TRAIN_TEXT, vocab_size=256)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        train_tokenizer("bpe", TRAIN_TEXT, vocab_size=300.0)
    with pytest.raises(ValueError, match="vocab_size 256, got vocab_size=512"):
        train_tokenizer("bytes", TRAIN_TEXT, vocab_size=512)
    # "ab" has one pair to merge: 256 byte symbols + 1 merge at most
    with pytest.raises(
        ValueError, match=r"vocab_size=300 is more than the training text \(2 characters\).*yields 257 tokens"
    ):
        train_tokenizer("bpe", "ab", vocab_size=300)
    assert train_tokenizer("bpe", "ab", vocab_size=257).vocab_size == 257


def test_encode_decode_refuse_bad_input(bpe):
    for tok in (ByteTokenizer(), bpe):
        with pytest.raises(TypeError, match="must be a str, got bytes"):
            tok.encode(b"abc")
        with pytest.raises(
            ValueError, match=rf"\[-1, {tok.vocab_size}\] are outside the vocabulary \[0, {tok.vocab_size}\)"
        ):
            tok.decode([1, -1, tok.vocab_size])


def test_load_refuses_what_save_did_not_write(bpe, tmp_path):
    with pytest.raises(ValueError, match="no tokenizer_meta.json"):
        load_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({"format": 1, "kind": "sentencepiece", "vocab_size": 9}))
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer_dir(tmp_path)
    bpe.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer.json"):
        load_tokenizer_dir(tmp_path)
    bpe.save(tmp_path)
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({"format": 1, "kind": "bpe", "vocab_size": 999}))
    with pytest.raises(ValueError, match="vocab_size 300, but .* says 999"):
        load_tokenizer_dir(tmp_path)
