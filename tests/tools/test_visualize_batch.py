"""The views of one item of a padded Hugging Face batch: its own tokens and weights, no padding.

The reference weights are transformers' own eager attention (``output_attentions=True``)
on the same model: a different implementation, compared with float tolerances.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

import multihead.hf  # noqa: E402
from multihead.tools import AttentionRecord, LayerAttention, classify_heads, write_html, write_json  # noqa: E402

WORDS = "the cat sat on mat a dog ran to park and . ,".split()
SENTENCES = ["the cat sat .", "a dog ran to the park and sat on the mat ."]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A tiny random BERT folder, its tokenizer, and a padded batch of two sentences of different lengths."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(specials + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(specials) + len(WORDS), hidden_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=40, max_position_embeddings=32)  # fmt: skip
    folder = tmp_path_factory.mktemp("bert")
    transformers.BertModel(config).save_pretrained(folder)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # item 0 is padded
    return folder, tokenizer, batch


def embedded(path) -> dict:
    found = re.search(r'<script type="application/json" id="mh-data">(.*?)</script>', path.read_text("utf-8"), re.S)
    return json.loads(found.group(1))


def test_each_item_shows_its_own_tokens_and_weights_without_padding(padded, tmp_path):
    folder, tokenizer, batch = padded
    model = multihead.hf.load_hf(folder)
    with torch.no_grad(), multihead.hf.capture(model) as record:
        model(**batch)
    record.query_tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in batch["input_ids"]]
    assert torch.equal(record.attention_mask, batch["attention_mask"].bool())  # capture found the padding

    eager = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = eager(**batch, output_attentions=True).attentions  # L x (B, H, T, T)
    for item, sentence in enumerate(SENTENCES):
        real = batch["attention_mask"][item].bool()
        tokens = ["[CLS]", *sentence.split(), "[SEP]"]
        data = embedded(write_html(record, tmp_path / f"item{item}.html", batch=item))
        assert data["query_tokens"] == data["key_tokens"] == tokens and data["batch"] == item
        for layer, want in zip(data["layers"], reference):
            got = torch.tensor(layer["weights"], dtype=torch.float64)  # (H, n, n): padding left out
            expected = want[item][:, real][:, :, real].double()
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)  # the page rounds to 4 digits
        saved = json.loads(write_json(record, tmp_path / f"item{item}.json", batch=item).read_text("utf-8"))
        assert saved["query_tokens"] == tokens and len(saved["layers"][0]["weights"][0]) == len(tokens)
        roles = classify_heads(record, batch=item)
        assert all(link.query in tokens and link.key in tokens for r in roles for link in r.links)
        assert all(link.query != "[PAD]" and link.key != "[PAD]" for r in roles for link in r.links)


def test_one_token_list_for_items_padded_differently_is_refused(padded, tmp_path):
    folder, tokenizer, batch = padded
    model = multihead.hf.load_hf(folder)
    with torch.no_grad(), multihead.hf.capture(model) as record:
        model(**batch)
    record.query_tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])  # item 0's tokens only
    with pytest.raises(ValueError, match="query_tokens is one token list for 2 batch items whose padding differs"):
        write_html(record, tmp_path / "h.html", batch=1)
    record.query_tokens = [record.query_tokens]
    with pytest.raises(ValueError, match="query_tokens has 1 token lists but the weights have B=2 batch items"):
        write_html(record, tmp_path / "h.html", batch=1)
    assert not (tmp_path / "h.html").exists()


def test_a_batch_without_padding_keeps_every_token_and_shared_tokens():
    weights = torch.rand(2, 1, 3, 3).softmax(-1)
    record = AttentionRecord([LayerAttention(0, "a", "mha", weights)], query_tokens=["x", "y", "z"])
    one = record.item(1)
    assert one.query_tokens == ["x", "y", "z"] and torch.equal(one.layers[0].weights[0], weights[1])
    record.attention_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    record.query_tokens = [["x", "y", "[PAD]"], ["x", "y", "z"]]
    assert record.item(0).query_tokens == ["x", "y"] and record.item(0).layers[0].weights.shape == (1, 1, 2, 2)
    record.query_tokens = [["x", "y"], ["x", "y", "z"]]  # already without the padding
    assert record.item(0).query_tokens == ["x", "y"]
    record.attention_mask = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"attention_mask is \[2, 4\] but the weights have B=2 and key lengths \[3\]"):
        record.item(0)


@pytest.mark.parametrize("write", ["html", "png", "json"])
def test_writing_into_a_missing_folder_names_it(tmp_path, write):
    import multihead.tools.visualize as views

    record = AttentionRecord([LayerAttention(0, "a", "mha", torch.full((1, 1, 2, 2), 0.5))], query_tokens=["a", "b"])
    missing = tmp_path / "no" / "such"
    if write == "png":
        pytest.importorskip("matplotlib")
    with pytest.raises(FileNotFoundError, match=f"cannot write .*heads.{write}: the folder {missing} does not exist"):
        getattr(views, f"write_{write}")(record, missing / f"heads.{write}")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        getattr(views, f"write_{write}")(record, tmp_path / "file" / f"heads.{write}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_native_capture_records_a_key_masks_padding(tmp_path):
    from multihead import MultiHeadAttention
    from multihead.tools import capture

    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).eval()
    keep = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])  # item 0 padded
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), capture(layer) as record:
        layer(x, key_mask=keep)
    assert torch.equal(record.attention_mask, keep)
    record.query_tokens = [["a", "b", "c", "<pad>", "<pad>"], ["v", "w", "x", "y", "z"]]
    data = embedded(write_html(record, tmp_path / "h.html", batch=0))
    assert data["query_tokens"] == ["a", "b", "c"]
    with torch.no_grad():  # the reference: item 0 alone, unpadded, through the same layer
        alone = layer(x[:1, :3], return_weights=True)[1]  # (1, H, 3, 3)
    got = torch.tensor(data["layers"][0]["weights"], dtype=torch.float64)
    torch.testing.assert_close(got, alone[0].double(), atol=2e-4, rtol=0)
    with torch.no_grad(), capture(layer) as whole:
        layer(x)  # no padding: nothing recorded
    assert whole.attention_mask is None
