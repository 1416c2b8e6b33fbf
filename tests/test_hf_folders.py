"""multihead.hf.folders: local Hugging Face folders checked, then read into multihead's own
GPT (parity with transformers' GPT2LMHeadModel on the same weights, float32 tolerances:
different operations) or loaded with transformers on multihead attention."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.hf_gpt2 import hf_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from multihead.hf import (  # noqa: E402
    load_gpt2_folder,
    load_transformers_folder,
    model_folder,
    read_config,
    read_tokenizer,
)


def word_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    hf = hf_model()
    hf.save_pretrained(folder)
    word_tokenizer(hf.config.vocab_size).save(str(folder / "tokenizer.json"))
    return folder, hf


def test_a_folder_is_checked_before_anything_is_read(tmp_path):
    with pytest.raises(ValueError, match="--hf nope: no such folder"):
        model_folder(tmp_path / "nope", label="--hf nope")
    with pytest.raises(ValueError, match=r"no config.json in it \(the model's configuration\)"):
        model_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no tokenizer.json in it \(its tokenizers file\)"):
        model_folder(tmp_path, ("config.json", "tokenizer.json"))
    assert model_folder(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("text, message", [("{", "config.json is not valid JSON"), ("[1]", "holds a list, not a JSON object")])
def test_a_bad_config_is_refused(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_config(tmp_path, label="--hf x")


def test_a_bad_tokenizer_file_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer.json"):
        read_tokenizer(tmp_path / "tokenizer.json")


def test_gpt2_folder_loads_as_multiheads_gpt(gpt2_folder):
    folder, hf = gpt2_folder
    assert read_config(folder)["model_type"] == "gpt2"
    gpt, tokenizer = load_gpt2_folder(folder)
    assert not gpt.training and tokenizer.get_vocab_size() == hf.config.vocab_size
    ids = torch.randint(0, hf.config.vocab_size, (2, 11))  # (B, T)
    with torch.no_grad():
        torch.testing.assert_close(gpt(ids), hf(ids).logits)


def test_transformers_folder_runs_on_multihead_attention(gpt2_folder, tmp_path):
    folder, _ = gpt2_folder
    model = load_transformers_folder(folder)
    assert not model.training and model.config._attn_implementation == "multihead"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ValueError, match="--hf x: not a transformers model folder"):
        load_transformers_folder(tmp_path, label="--hf x")


def test_the_folder_readers_need_no_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # an import of transformers fails, as when not installed
        "import multihead.hf.folders as f; print(f.load_gpt2_folder.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "load_gpt2_folder", done.stderr
