"""``multihead.models.load_model`` opens what either writer saved and refuses anything else in one
line; a checkpoint that lost a tensor names it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.encoders import LINES, tiny_encoder
from support.paths import assert_paths_agree

from multihead.models import GPT, GPTConfig, SentenceEncoder, load_model, save_checkpoint, saved_kind
from multihead.models.minilm import load_sentence_encoder, save_sentence_encoder


def test_each_writer_s_folder_comes_back_as_its_model(tmp_path):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_preset("tiny", context_length=16)).eval()
    save_checkpoint(gpt, tmp_path / "gpt")
    save_checkpoint(gpt, tmp_path / "pair.safetensors")
    encoder = tiny_encoder()
    save_sentence_encoder(encoder, tmp_path / "enc")
    x = torch.randint(0, 256, (1, 8))
    for path in (tmp_path / "gpt", tmp_path / "pair.safetensors"):
        got = load_model(path)
        assert isinstance(got, GPT) and not got.training and saved_kind(path) == "gpt"
        assert_paths_agree(got(x), gpt(x))  # the same weights
    got = load_model(tmp_path / "enc")
    assert isinstance(got, SentenceEncoder) and saved_kind(tmp_path / "enc") == "sentence_encoder"
    assert_paths_agree(got.encode(LINES[:3]), encoder.encode(LINES[:3]))


def test_other_folders_are_refused_saying_what_they_are(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"is a Hugging Face folder \(model_type 'bert'\).*load_sentence_encoder_folder"):
        load_model(hf)
    (hf / "config.json").write_text(json.dumps({"format": "something.else"}))
    with pytest.raises(ValueError, match="has format 'something.else'"):
        load_model(hf)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_model(tmp_path / "none")


def drop_tensor(weights, name: str) -> None:
    """Rewrite a safetensors file without tensor ``name``, keeping its header metadata (checksums included)."""
    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != name}
    save_file(tensors, str(weights), metadata=metadata)


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=16)), tmp_path / "gpt")
    drop_tensor(tmp_path / "gpt" / "model.safetensors", "blocks.1.attn.out_proj.weight")
    with pytest.raises(ValueError, match=r"is missing tensor\(s\) 'blocks.1.attn.out_proj.weight' that were written"):
        load_model(tmp_path / "gpt")


def test_a_sentence_encoder_missing_a_tensor_names_it(tmp_path):
    folder = save_sentence_encoder(tiny_encoder(), tmp_path / "enc")
    drop_tensor(folder / "model.safetensors", "layers.0.attention.out_proj.bias")
    with pytest.raises(ValueError, match=r"missing \['layers.0.attention.out_proj.bias'\]"):
        load_sentence_encoder(folder)
    (folder / "config.json").write_text(json.dumps({"format": "multihead.sentence_encoder", "bert": {"sizes": 1}}))
    with pytest.raises(ValueError, match="invalid multihead.sentence_encoder config"):
        load_sentence_encoder(folder)
