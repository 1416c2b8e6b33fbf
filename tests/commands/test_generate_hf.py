"""``multihead generate --hf DIR``: a Hugging Face GPT-2 folder written by transformers itself
(``save_pretrained``) and its tokenizer.json; greedy text compared with transformers' own
greedy ``generate`` (equal up to logit ties, ``assert_greedy_agrees``)."""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import quietly
from support.paths import assert_greedy_agrees

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

LINES = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"] * 10
PROMPT = "To be, or not"
NEW = 12


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=290, show_progress=False, special_tokens=[],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # peaked logits: greedy picks are far from ties
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_generate_from_a_hf_gpt2_folder_follows_transformers(hf_folder):
    rc, text, err = quietly("generate", "--hf", str(hf_folder), PROMPT, "--max-new-tokens", str(NEW),
                            "--temperature", "0")  # fmt: skip
    assert rc == 0, err
    assert f"Hugging Face GPT-2 folder {hf_folder}, its tokenizer.json" in err
    tok = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_folder, attn_implementation="eager").eval()
    idx = torch.tensor([prompt])
    out = hf.generate(idx, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    ref_logits = torch.stack(out.scores, dim=1)  # (1, NEW, V)
    want = tok.decode(out.sequences[0].tolist())
    if text != want + "\n":  # only a tie between two logits may make the paths differ
        from multihead.hf.folders import load_gpt2_folder

        ours = load_gpt2_folder(hf_folder)[0]
        with torch.no_grad():
            tokens, logits = ours.generate(idx, NEW, temperature=0, return_logits=True)
        assert tok.decode(tokens[0].tolist()) + "\n" == text
        assert_greedy_agrees(tokens, out.sequences, logits, ref_logits, start=len(prompt))


def test_hf_folder_mistakes_are_one_line(hf_folder, tmp_path):
    def refused(*argv):
        rc, out, err = quietly("generate", *argv)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
        return err

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    assert "model_type 'bert'; generate takes a GPT-2 folder" in refused("--hf", str(bert))
    assert "give one of --preset, --checkpoint and --hf" in refused("--hf", str(hf_folder), "--preset", "tiny")
    assert "no such folder" in refused("--hf", str(tmp_path / "none"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_folder / name).read_bytes())
    assert "no tokenizer.json in it to encode the prompt; give --tokenizer FILE" in refused("--hf", str(bare))
    rc, text, err = quietly("generate", "--hf", str(bare), "--tokenizer", str(hf_folder / "tokenizer.json"), PROMPT,
                            "--max-new-tokens", "3")  # fmt: skip
    assert rc == 0 and text.startswith(PROMPT), err
