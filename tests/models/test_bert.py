"""BertEncoder and BertConfig: presets, validation, weight loading, parity with
a randomly initialised Hugging Face BertModel (no download: built from a config).

Pretrained parity (all-MiniLM-L6-v2) lives in test_minilm.py.
"""

from __future__ import annotations

import dataclasses
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported; nothing is downloaded
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import save_file
from support.paths import assert_paths_agree

from multihead import MultiHeadAttention
from multihead.models.bert import BERT_PRESETS, BertConfig, BertEncoder
from multihead.models.bert_weights import load_safetensors

TINY = dict(
    vocab_size=99, hidden_size=20, num_layers=2, num_heads=4, intermediate_size=37,
    max_position_embeddings=64, type_vocab_size=2, dropout=0.0, attention_dropout=0.0,
)  # fmt: skip  (D = 5: odd head size)


def tiny_config(**overrides) -> BertConfig:
    return BertConfig(**{**TINY, **overrides})


@pytest.fixture(scope="module")
def hf_tiny():
    """A random HF BertModel with the TINY sizes (float64, eval) and its state dict."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=99, hidden_size=20, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.BertModel(cfg).double().eval()
    return model, cfg


def padded_batch(seed: int = 0, B: int = 3, T: int = 11, vocab: int = 99):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, 7, 1])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T), 1 = real
    ids = ids.masked_fill(mask == 0, 0)
    types = (torch.arange(T)[None, :] >= 4).long().expand(B, T) * mask
    return ids, mask, types


# ------------------------------------------------------------------ config
def test_minilm_preset_sizes():
    c = BertConfig.from_preset("minilm-l6")
    assert (c.num_layers, c.num_heads, c.hidden_size, c.intermediate_size) == (6, 12, 384, 1536)
    assert (c.vocab_size, c.max_position_embeddings, c.type_vocab_size) == (30522, 512, 2)
    assert c.layer_norm_eps == 1e-12 and c.hidden_act == "gelu" and c.attention == "mha"
    assert c.head_dim == 32


def test_presets_are_exact_names():
    assert {"minilm-l6", "minilm-l12", "bert-tiny", "bert-base", "bert-large"} <= set(BERT_PRESETS)
    for name in BERT_PRESETS:
        assert isinstance(BertConfig.from_preset(name), BertConfig)
    with pytest.raises(ValueError, match=r"unknown BERT preset 'MiniLM-L6'; valid: \[.*'minilm-l6'.*\]"):
        BertConfig.from_preset("MiniLM-L6")
    with pytest.raises(ValueError, match="unknown BERT preset 'minilm'"):
        BertConfig.from_preset("minilm")


def test_preset_overrides():
    c = BertConfig.from_preset("minilm-l6", num_layers=2, dropout=0.0)
    assert c.num_layers == 2 and c.dropout == 0.0 and c.hidden_size == 384


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(hidden_size=21), ValueError, "hidden_size=21 is not divisible by num_heads=4"),
        (dict(num_layers=0), ValueError, "num_layers must be a positive int, got num_layers=0"),
        (dict(num_heads=2.0), TypeError, "num_heads must be a positive int"),
        (dict(hidden_act="swish"), ValueError, r"unknown hidden_act 'swish'; valid: \[.*'gelu'"),
        (dict(attention="flash"), ValueError, r"unknown attention kind 'flash'; known: \[.*'mha'"),
        (dict(dropout=1.0), ValueError, "dropout must be a float in"),
        (dict(layer_norm_eps=0.0), ValueError, "layer_norm_eps must be a positive finite float"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be a positive int"),
    ],
)
def test_config_validation(overrides, error, match):
    with pytest.raises(error, match=match):
        tiny_config(**overrides)


def test_from_hf_config_dict_and_errors(hf_tiny):
    _, cfg = hf_tiny
    ours = BertConfig.from_hf_config(cfg.to_dict())
    assert ours == tiny_config()
    d = cfg.to_dict()
    del d["num_hidden_layers"]
    with pytest.raises(ValueError, match=r"missing keys \['num_hidden_layers'\]"):
        BertConfig.from_hf_config(d)
    with pytest.raises(ValueError, match="only absolute position embeddings.*'relative_key'"):
        BertConfig.from_hf_config({**cfg.to_dict(), "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="model_type must be 'bert', got model_type='gpt2'"):
        BertConfig.from_hf_config({**cfg.to_dict(), "model_type": "gpt2"})
    with pytest.raises(TypeError, match="config must be a mapping or a path, got int"):
        BertConfig.from_hf_config(3)


def test_from_hf_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        BertConfig.from_hf_config(tmp_path / "config.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a valid JSON config"):
        BertConfig.from_hf_config(bad)


# ------------------------------------------------------------------ structure
def test_structure_and_attention_path():
    model = BertEncoder(tiny_config())
    assert len(model.layers) == 2
    for layer in model.layers:
        assert isinstance(layer.attention, MultiHeadAttention)
        assert layer.attention.num_heads == 4 and layer.attention.head_dim == 5
    with pytest.raises(TypeError, match="config must be a BertConfig, got dict"):
        BertEncoder(TINY)


# ------------------------------------------------------------------ parity with HF (random weights)
def test_matches_hf_bert_float64_every_layer(hf_tiny):
    hf, cfg = hf_tiny
    model = BertEncoder.from_hf_state_dict(hf.state_dict(), BertConfig.from_hf_config(cfg.to_dict())).double()
    assert not model.training
    ids, mask, types = padded_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        last, hidden = model(ids, mask, types, output_hidden_states=True)
    assert len(hidden) == len(ref.hidden_states) == 3
    real = mask.bool()
    for ours, theirs in zip(hidden, ref.hidden_states):
        torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(last[real], ref.last_hidden_state[real], rtol=0, atol=1e-10)


def test_bert_prefix_and_ignored_keys(hf_tiny):
    hf, _ = hf_tiny
    prefixed = {f"bert.{k}": v for k, v in hf.state_dict().items()}  # BertFor* checkpoints, pooler included
    prefixed["cls.predictions.bias"] = torch.zeros(99)
    prefixed["bert.embeddings.position_ids"] = torch.arange(64)[None]
    model = BertEncoder.from_hf_state_dict(prefixed, tiny_config()).double()
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        out = model(ids, mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-10)


def test_qkv_rows_are_query_key_value(hf_tiny):
    hf, _ = hf_tiny
    model = BertEncoder.from_hf_state_dict(hf.state_dict(), tiny_config())
    w = model.layers[1].attention.projection_weights()
    for letter, name in zip("qkv", ("query", "key", "value")):
        ref = hf.state_dict()[f"encoder.layer.1.attention.self.{name}.weight"].float()
        torch.testing.assert_close(w[letter][0], ref)
    out = hf.state_dict()["encoder.layer.1.attention.output.dense.weight"].float()
    torch.testing.assert_close(model.layers[1].attention.out_proj.weight, out)


# ------------------------------------------------------------------ forward semantics
def test_padding_does_not_change_real_tokens(seed):
    model = BertEncoder(tiny_config()).eval()
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        batched = model(ids, mask)
        alone = model(ids[1:2, :7])
        garbage = model(ids.masked_fill(mask == 0, 42), mask)  # pad ids do not matter
    torch.testing.assert_close(batched[1, :7], alone[0])
    torch.testing.assert_close(batched[mask.bool()], garbage[mask.bool()])


def test_mask_dtypes_agree(seed):
    model = BertEncoder(tiny_config()).eval()
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        outs = [model(ids, m) for m in (mask, mask.bool(), mask.float())]
    for out in outs[1:]:
        assert_paths_agree(out, outs[0])


def test_hidden_states_count_and_last(seed):
    model = BertEncoder(tiny_config(num_layers=3)).eval()
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        last, hidden = model(ids, mask, output_hidden_states=True)
        plain = model(ids, mask)
    assert len(hidden) == 4 and all(h.shape == (3, 11, 20) for h in hidden)
    assert hidden[-1] is last
    torch.testing.assert_close(plain, last, rtol=0, atol=0)  # the same operations: bitwise


@pytest.mark.parametrize("kind,kv", [("gqa", 2), ("gqa", 1), ("mqa", None)])
def test_grouped_attention_builds_and_runs(seed, kind, kv):
    model = BertEncoder(tiny_config(attention=kind, num_kv_heads=kv)).eval()
    assert model.layers[0].attention.num_kv_heads == (kv or 1)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        out = model(ids, mask)
        alone = model(ids[1:2, :7])
    assert out.shape == (3, 11, 20) and torch.isfinite(out).all()
    torch.testing.assert_close(out[1, :7], alone[0])


def test_gqa_cannot_take_mha_weights(hf_tiny):
    hf, _ = hf_tiny
    with pytest.raises(ValueError, match=r"wrong shapes.*attention\.self\.key\.weight: expected \(10, 20\), got \(20, 20\)"):
        BertEncoder.from_hf_state_dict(hf.state_dict(), tiny_config(attention="gqa", num_kv_heads=2))


def test_training_mode_dropout_changes_output(seed):
    model = BertEncoder(tiny_config(dropout=0.5)).train()
    ids, mask, _ = padded_batch()
    a, b = model(ids, mask), model(ids, mask)
    assert not torch.allclose(a, b)
    model.eval()
    torch.testing.assert_close(model(ids, mask), model(ids, mask), rtol=0, atol=0)  # the same call twice: bitwise


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda m: m(torch.zeros(2, 3)), TypeError, "input_ids must be an integer tensor, got dtype torch.float32"),
        (lambda m: m([[1, 2]]), TypeError, "input_ids must be a torch.Tensor, got list"),
        (lambda m: m(torch.zeros(3, dtype=torch.long)), ValueError, r"input_ids must be \[B, T\]"),
        (lambda m: m(torch.zeros(1, 65, dtype=torch.long)), ValueError, "T=65 exceeds max_position_embeddings=64"),
        (lambda m: m(torch.tensor([[1, 99]])), ValueError, r"input_ids must lie in \[0, 99\), got min 1 and max 99"),
        (lambda m: m(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4)), ValueError, r"attention_mask must be a tensor of shape \(2, 3\)"),
        (lambda m: m(torch.ones(2, 3, dtype=torch.long), token_type_ids=torch.full((2, 3), 2)), ValueError, r"token_type_ids must lie in \[0, 2\)"),
    ],
)  # fmt: skip
def test_forward_input_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(BertEncoder(tiny_config()))


# ------------------------------------------------------------------ loading errors
def test_missing_unexpected_and_misshaped_keys(hf_tiny):
    hf, _ = hf_tiny
    sd = dict(hf.state_dict())
    del sd["encoder.layer.1.output.dense.bias"]
    sd["encoder.layer.2.output.dense.bias"] = torch.zeros(20)
    sd["embeddings.word_embeddings.weight"] = torch.zeros(98, 20)
    with pytest.raises(ValueError) as info:
        BertEncoder.from_hf_state_dict(sd, tiny_config(), source="my.safetensors")
    msg = str(info.value)
    assert msg.startswith("my.safetensors does not match BertConfig")
    assert "missing keys (1): ['encoder.layer.1.output.dense.bias']" in msg
    assert "unexpected keys (1): ['encoder.layer.2.output.dense.bias']" in msg
    assert "embeddings.word_embeddings.weight: expected (99, 20), got (98, 20)" in msg


def test_state_dict_type_errors():
    model = BertEncoder(tiny_config())
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        model.load_hf_state_dict([("a", torch.zeros(1))])
    with pytest.raises(TypeError, match=r"must map str to torch.Tensor; bad keys \['x'\]"):
        model.load_hf_state_dict({"x": [1.0]})


def test_integer_weights_rejected(hf_tiny):
    hf, _ = hf_tiny
    sd = dict(hf.state_dict())
    sd["embeddings.LayerNorm.bias"] = torch.zeros(20, dtype=torch.long)
    with pytest.raises(ValueError, match="embeddings.LayerNorm.bias: dtype torch.int64 is not floating"):
        BertEncoder.from_hf_state_dict(sd, tiny_config())


def _save_tiny(hf, folder):
    folder.mkdir(exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in hf.state_dict().items()}, str(folder / "model.safetensors"))
    hf.config.to_json_file(str(folder / "config.json"))
    return folder / "model.safetensors"


def test_from_pretrained_folder_and_file(hf_tiny, tmp_path):
    hf, _ = hf_tiny
    weights = _save_tiny(hf, tmp_path / "tiny")
    from_dir = BertEncoder.from_pretrained(tmp_path / "tiny")
    from_file = BertEncoder.from_pretrained(weights, tiny_config())
    assert dataclasses.asdict(from_dir.config) == dataclasses.asdict(tiny_config())
    for (n, a), (_, b) in zip(from_dir.state_dict().items(), from_file.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    with pytest.raises(ValueError, match="is a file: pass config="):
        BertEncoder.from_pretrained(weights)


@pytest.mark.parametrize("keep", [0, 5, 100, "half"])
def test_truncated_safetensors_is_a_value_error(hf_tiny, tmp_path, keep):
    hf, _ = hf_tiny
    weights = _save_tiny(hf, tmp_path / "tiny")
    data = weights.read_bytes()
    n = len(data) // 2 if keep == "half" else keep
    weights.write_bytes(data[:n])
    with pytest.raises(ValueError, match=rf"{weights}: not a readable safetensors file"):
        load_safetensors(weights)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        BertEncoder.from_pretrained(tmp_path / "tiny")


def test_garbage_and_missing_weights_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="junk.safetensors: not a readable safetensors file"):
        load_safetensors(junk)
    with pytest.raises(FileNotFoundError, match="weights file not found: .*nothing.safetensors"):
        load_safetensors(tmp_path / "nothing.safetensors")
