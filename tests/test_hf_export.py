"""``multihead.hf.export_hf``: folders that transformers' own classes load, compared with the multihead model.

The reference is transformers itself (GPT2LMHeadModel, BertModel, AutoTokenizer) reading the folder;
different operations on the two sides, so float32 tolerances (``assert_paths_agree``).
"""

from __future__ import annotations

import json

import pytest
import torch
from support.paths import assert_paths_agree

transformers = pytest.importorskip("transformers")

from multihead.hf.export import check_hf_export, export_hf  # noqa: E402
from multihead.hf.export_files import byte_tokenizer  # noqa: E402
from multihead.models.bert import BertConfig, BertEncoder  # noqa: E402
from multihead.models.gpt import GPT, GPTConfig  # noqa: E402
from multihead.tools.prune import prune_heads  # noqa: E402

TINY = dict(vocab_size=256, context_length=32, embed_dim=32, num_layers=2, num_heads=4)


def gpt(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> GPT:
    """A random tiny GPT whose biases and LayerNorms are perturbed, so every parameter matters."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **overrides}), dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(folder, idx: torch.Tensor) -> torch.Tensor:
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(idx).logits


@pytest.mark.parametrize(
    "overrides", [{}, {"tie_embeddings": False, "mlp_dim": 48}, {"qkv_bias": False}],
    ids=["tied", "untied-mlp48", "no-qkv-bias"],
)  # fmt: skip
def test_gpt_loads_as_gpt2_with_the_same_logits(overrides, tmp_path):
    model = gpt(**overrides)
    folder = export_hf(model, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    idx = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_paths_agree(hf_logits(folder, idx), model(idx))


def test_a_float64_gpt_is_written_and_loaded_in_float64(tmp_path):
    model = gpt(dtype=torch.float64)
    folder = export_hf(model, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float64"
    idx = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = hf_logits(folder, idx)
        assert logits.dtype == torch.float64
        assert_paths_agree(logits, model(idx))


def test_byte_gpt_gets_a_byte_tokenizer_that_autotokenizer_reads(tmp_path):
    folder = export_hf(gpt(), tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "héllo, wörld!\n\ttabs € 🙂"
    assert tok(text).input_ids == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert byte_tokenizer().encode(text).ids == list(text.encode("utf-8"))


def test_pruned_gpt_is_refused_then_written_with_zero_heads(tmp_path):
    model = prune_heads(gpt(), {0: [1], 1: [0, 3]}).eval()
    with pytest.raises(ValueError, match=r"one head count for every layer .* keeps \[3, 2\] of 4 heads of size 8"):
        export_hf(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    folder = export_hf(model, tmp_path / "hf", zero_heads=True)
    idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_paths_agree(hf_logits(folder, idx), model(idx))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"attention": "gqa", "num_kv_heads": 2}, r"attention is 'gqa' with 2 key/value heads for 4 query heads"),
        ({"attention": "mqa"}, r"attention is 'mqa'"),
        ({"attention": "moh"}, r"attention is 'moh'"),
        ({"attention_options": {"rope": True}}, r"rope \(GPT-2 has learned absolute positions"),
        ({"attention_options": {"qk_norm": True}}, r"qk_norm \(GPT-2 does not normalise"),
    ],
    ids=["gqa", "mqa", "moh", "rope", "qk_norm"],
)
def test_what_gpt2_cannot_hold_is_refused_with_the_reason(overrides, reason, tmp_path):
    model = GPT(GPTConfig(**{**TINY, **overrides}))
    with pytest.raises(ValueError, match=reason):
        check_hf_export(model)
    with pytest.raises(ValueError, match=reason):
        export_hf(model, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a staging folder


def tiny_bert(seed: int = 0, **overrides) -> BertEncoder:
    torch.manual_seed(seed)
    config = BertConfig(**{**dict(vocab_size=50, hidden_size=24, num_layers=2, num_heads=4, intermediate_size=40,
                                  max_position_embeddings=32, hidden_act="gelu"), **overrides})  # fmt: skip
    model = BertEncoder(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("pruned", [False, True], ids=["all-heads", "pruned-zero-heads"])
def test_bert_encoder_loads_as_bertmodel_with_the_same_hidden_states(pruned, tmp_path):
    model = tiny_bert()
    if pruned:
        prune_heads(model, {0: [0, 2], 1: [3]}).eval()
    folder = export_hf(model, tmp_path / "hf", zero_heads=pruned)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # no tokenizer given
    hf = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    ids, types = torch.randint(0, 50, (2, 7), generator=g), torch.randint(0, 2, (2, 7), generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = model(ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    assert_paths_agree(got[real], want[real])  # padded positions are meaningless on both sides


def test_a_gqa_bert_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match=r"BertModel has plain multi-head attention .* 'gqa' with 2 key/value heads"):
        export_hf(tiny_bert(attention="gqa", num_kv_heads=2), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_previous_export_is_replaced_whole_and_other_folders_are_refused(tmp_path, monkeypatch):
    import multihead.hf.export as export_module

    folder = export_hf(gpt(seed=0), tmp_path / "hf")
    first = (folder / "model.safetensors").read_bytes()
    export_hf(gpt(seed=1), folder)  # a previous export is replaced
    second = (folder / "model.safetensors").read_bytes()
    assert second != first

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_module.export_hf(gpt(seed=2), folder)
    assert (folder / "model.safetensors").read_bytes() == second  # the old export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds \['notes.txt'\], which an export would remove"):
        export_hf(gpt(), folder)
    with pytest.raises(TypeError, match="takes a multihead GPT, BertEncoder or SentenceEncoder, got Linear"):
        export_hf(torch.nn.Linear(2, 2), tmp_path / "x")
