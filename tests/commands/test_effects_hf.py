"""``multihead effects --hf`` on a causal transformers folder other than GPT-2 (a tiny GQA Llama).

The folder is written with ``save_pretrained`` and a word-level
tokenizer.json built here whose post-processor adds a BOS token (as
Llama's does): prompts are encoded with it, answers without it. The map in
effects.json is checked against ``head_effects`` on the same folder loaded
with ``multihead.hf.load_hf`` and the same ids (``head_effects`` itself is
checked against edits of ``o_proj``'s input in
tests/tools/test_head_effects_hf.py), and "zero" against
transformers' SDPA attention with head h's ``o_proj`` columns zeroed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from support.cli import quietly  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

import multihead.hf  # noqa: E402
from multihead.tools import head_effects, logit_difference  # noqa: E402

V = 40
CLEAN, CORRUPTED = "w5 w9 w11 w5 w9", "w5 w9 w12 w5 w9"
ARGS = ["--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "w11", "--wrong", "w12"]


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("effects", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead effects: error: "), err
    return err.strip()


def tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel({"<s>": 0, **{f"w{i}": i for i in range(1, V)}}, unk_token="<s>"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger head outputs, so each head's effect stands out of float32 noise
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(4.0)
    folder = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(folder)
    tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def ids(text: str) -> torch.Tensor:
    return torch.tensor([[0] + [int(w[1:]) for w in text.split()]])  # BOS, then each word's id


@pytest.mark.parametrize("method", ["patch", "restore", "mean"])
def test_the_written_map_is_head_effects_on_the_transformers_model(llama, tmp_path, method):
    out = tmp_path / "out"
    rc, stdout, err = quietly("effects", "--hf", str(llama), *ARGS, "--method", method, "--out", str(out))
    assert rc == 0, err
    data = json.loads((out / "effects.json").read_text())
    model = multihead.hf.load_hf(llama, transformers.LlamaForCausalLM)
    want = head_effects(model, ids(CLEAN), ids(CORRUPTED), metric=logit_difference(11, 12), method=method)
    assert want.effects.abs().max() > 1e-2
    torch.testing.assert_close(torch.tensor(data["effects"], dtype=torch.float64), want.effects, rtol=1e-5, atol=1e-6)
    assert data["answer"] == {"text": "w11", "id": 11} and data["wrong"]["id"] == 12
    assert data["clean"] == pytest.approx(want.clean, rel=1e-5) and data["corrupted"] == pytest.approx(want.corrupted, rel=1e-5)
    assert data["layers"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"] and data["num_heads"] == [6, 6]
    assert data["source"] == f"llama model {llama}" and stdout.startswith(f"llama model {llama}: 2 layers x 6 heads")


def test_zero_equals_zeroing_o_proj_columns_on_sdpa(llama, tmp_path):
    rc, _, err = quietly("effects", "--hf", str(llama), "--method", "zero", "--clean", CLEAN, "--answer", "w11",
                         "--wrong", "w12", "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 0, err
    got = json.loads((tmp_path / "out" / "effects.json").read_text())["effects"]
    reference = transformers.LlamaForCausalLM.from_pretrained(llama, attn_implementation="sdpa").eval()
    x = ids(CLEAN)

    def metric(model) -> float:
        with torch.no_grad():
            logits = model(x).logits
        return float(logits[0, -1, 11] - logits[0, -1, 12])

    whole = metric(reference)
    assert max(abs(v) for row in got for v in row) > 1e-2
    for layer in range(2):
        for head in range(6):
            silenced = copy.deepcopy(reference)
            with torch.no_grad():
                silenced.model.layers[layer].self_attn.o_proj.weight[:, head * 4 : (head + 1) * 4] = 0  # (C, H*Dv)
            assert got[layer][head] == pytest.approx(metric(silenced) - whole, rel=1e-4, abs=1e-5), (layer, head)


def test_folders_effects_cannot_measure_are_one_line(llama, tmp_path):
    out = tmp_path / "never"
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    tokenizer().save(str(bert / "tokenizer.json"))
    assert f"--hf {bert}: model_type 'bert' is a sentence encoder" in refused("--hf", str(bert), "--out", str(out), *ARGS)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tokenizer().save(str(broken / "tokenizer.json"))
    assert f"--hf {broken}: not a transformers model folder" in refused("--hf", str(broken), "--out", str(out), *ARGS)
    encoder = tmp_path / "encoder"  # a RoBERTa loads as a causal LM class, but its heads see later tokens
    config = transformers.RobertaConfig(vocab_size=V, hidden_size=24, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=40, max_position_embeddings=40)  # fmt: skip
    transformers.RobertaForCausalLM(config).save_pretrained(encoder)
    tokenizer().save(str(encoder / "tokenizer.json"))
    assert "the roberta model attends to later tokens; effects reads a causal model's next-token logits" in refused(
        "--hf", str(encoder), "--out", str(out), *ARGS)
    assert "--clean encodes to 21 tokens, more than the model's context_length=16" in refused(
        "--hf", str(llama), "--out", str(out), "--method", "zero", "--clean", "w1 " * 20, "--answer", "w11", "--wrong", "w12")
    assert "--answer 'w11 w3' encodes to 2 tokens [11, 3]" in refused(
        "--hf", str(llama), "--out", str(out), *ARGS[:4], "--answer", "w11 w3", "--wrong", "w12")
    assert not out.exists()
