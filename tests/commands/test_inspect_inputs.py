"""What ``multihead inspect`` feeds a model (``commands.tokens``) and the folder checks (``multihead.paths``)."""

from __future__ import annotations

import pytest

from multihead.commands.tokens import encode_bytes, encode_text, notices
from multihead.paths import input_file, output_folder


@pytest.fixture(scope="module")
def minilm():
    from multihead.models.minilm import load_minilm

    return load_minilm()


def test_truncation_keeps_what_the_models_own_tokenizer_keeps(minilm):
    """Reference: SentenceEncoder.tokenize, i.e. the tokenizers library's truncation at max_seq_length."""
    text = "The law will never be perfect, but its application should be just. " * 30
    enc = encode_text(minilm.tokenizer, text, minilm.max_seq_length, model="m", truncate=True)
    reference = minilm.tokenize(text)
    assert enc.ids == reference.input_ids[0].tolist() and enc.tokens == reference.tokens[0]
    assert len(enc.ids) == minilm.max_seq_length == 256 and enc.total > 256 and enc.truncated
    assert text.startswith(enc.analysed) and enc.analysed.endswith(enc.tokens[-2])  # the last word kept, before [SEP]
    assert minilm.tokenizer.truncation["max_length"] == 256  # the model's tokenizer is left as it was
    with pytest.raises(ValueError, match=rf"the text is {enc.total} tokens, more than m's maximum of 256"):
        encode_text(minilm.tokenizer, text, 256, model="m")
    short = encode_text(minilm.tokenizer, "Its application", 256, model="m")
    assert short.ids == minilm.tokenize("Its application").input_ids[0].tolist() and not short.truncated
    assert notices(short, model="m") == []


def test_text_with_special_tokens_only_is_refused(minilm):
    with pytest.raises(ValueError, match="encodes to no tokens besides special ones"):
        encode_text(minilm.tokenizer, "\u200b", 256, model="m")  # a zero-width space: no word at all


def test_bytes_truncate_and_leave_out_a_character_cut_in_half():
    text = "d\u00e9j\u00e0 vu " * 3  # 10 bytes each: d, e-acute (2 bytes), j, a-grave (2 bytes), " vu "
    enc = encode_bytes(text, 12, model="m", truncate=True)  # byte 12 is the first half of the second e-acute
    assert enc.ids == list(text.encode())[:12] and enc.total == 30 and enc.truncated
    assert enc.analysed == "d\u00e9j\u00e0 vu d"
    with pytest.raises(ValueError, match="the text is 30 bytes, more than m's maximum of 12"):
        encode_bytes(text, 12, model="m")
    with pytest.raises(ValueError, match=r"the text '\\n ' is empty or only whitespace"):
        encode_bytes("\n ", 10, model="m")


def test_folder_checks_create_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert output_folder("--out", target) == target
    assert list(tmp_path.iterdir()) == []  # the probe folder is gone, nothing was made
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*/f/x: .*/f is not a folder, so no folder can be made under it"):
        output_folder("--out", tmp_path / "f" / "x")
    with pytest.raises(ValueError, match=r"--tokenizer .*/nope: no such file \(expected a tokenizer\)"):
        input_file("--tokenizer", tmp_path / "nope", "a tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
