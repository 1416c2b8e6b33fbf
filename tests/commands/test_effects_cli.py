"""``multihead effects``: a checkpoint's and a GPT-2 folder's head map, printed and written; mistakes refused.

The map in effects.json is checked against ``head_effects`` run by hand on
the same ids (a byte-level checkpoint), and, for ``--hf``, "zero" against
the transformers model itself running on multihead attention with that head
masked (``multihead.hf.head_mask``), a separate implementation of the same
model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import head_effects, logit_difference

CLEAN, CORRUPTED = "To be, or not", "To go, or not"
ARGS = ["--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", " ", "--wrong", "t"]


def tiny(folder: Path, attention: str = "mha", **options) -> Path:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, context_length=32, embed_dim=32, num_layers=2, num_heads=4, attention=attention,
                       **options)  # fmt: skip
    model = GPT(config)
    with torch.no_grad():  # larger head outputs than the init's, so the effects stand out of float noise
        for block in model.blocks:
            block.attn.out_proj.weight.mul_(10.0)
    save_checkpoint(model, folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("tiny") / "ckpt")


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("effects", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead effects: error: "), err
    return err.strip()


def ids(text: str) -> torch.Tensor:
    return torch.tensor([list(text.encode("utf-8"))])


@pytest.mark.parametrize("method", ["patch", "restore", "mean"])
def test_the_written_map_is_head_effects_on_the_encoded_prompts(checkpoint, tmp_path, method):
    out = tmp_path / "out"
    rc, stdout, err = quietly("effects", "--checkpoint", str(checkpoint), *ARGS, "--method", method, "--top", "3",
                              "--out", str(out))  # fmt: skip
    assert rc == 0, err
    data = json.loads((out / "effects.json").read_text())
    model = load_checkpoint(checkpoint).eval()
    want = head_effects(model, ids(CLEAN), ids(CORRUPTED), metric=logit_difference(ord(" "), ord("t")), method=method)
    torch.testing.assert_close(torch.tensor(data["effects"], dtype=torch.float64), want.effects, rtol=1e-5, atol=1e-7)
    assert data["method"] == method and data["answer"] == {"text": " ", "id": 32} and data["wrong"]["id"] == ord("t")
    assert data["clean"] == pytest.approx(want.clean, rel=1e-6) and data["corrupted"] == pytest.approx(want.corrupted, rel=1e-6)
    assert data["clean_text"] == CLEAN and data["corrupted_text"] == CORRUPTED and data["layers"] == want.layer_names
    rows = stdout.splitlines()
    top = rows[rows.index(next(r for r in rows if r.startswith("top 3 heads"))) + 2 :][:3]
    assert [tuple(int(x) for x in r.split()[:2]) for r in top] == [(i, h) for i, h, _ in want.top(3)]
    assert (out / "effects.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table id=\"effects-grid\">" in (out / "effects.html").read_text()


def test_zero_without_a_corrupted_prompt(checkpoint, tmp_path):
    rc, stdout, err = quietly("effects", "--checkpoint", str(checkpoint), "--method", "zero", "--clean", CLEAN,
                              "--answer", " ", "--wrong", "t", "--batch-size", "1", "--out", str(tmp_path / "z"))  # fmt: skip
    assert rc == 0, err
    data = json.loads((tmp_path / "z" / "effects.json").read_text())
    assert data["corrupted"] is None and data["corrupted_text"] is None and not [r for r in stdout.splitlines() if r.split()[:1] == ["corrupted"]]
    want = head_effects(load_checkpoint(checkpoint).eval(), ids(CLEAN), metric=logit_difference(32, ord("t")), method="zero")
    torch.testing.assert_close(torch.tensor(data["effects"], dtype=torch.float64), want.effects, rtol=1e-5, atol=1e-7)


def test_mistakes_are_refused_before_anything_is_written(checkpoint, tmp_path):
    out = tmp_path / "never"
    base = ["--checkpoint", str(checkpoint), "--out", str(out)]
    assert "--method ablate: unknown method; valid: zero, mean, patch, restore" in refused(*base, *ARGS, "--method", "ablate")
    assert "--method patch needs --corrupted TEXT" in refused(*base, "--clean", CLEAN, "--answer", " ", "--wrong", "t")
    assert "--clean encodes to 13 tokens and --corrupted to 12" in refused(
        *base, "--clean", CLEAN, "--corrupted", "To go, or no", "--answer", " ", "--wrong", "t")
    assert "--answer ' x' encodes to 2 tokens [32, 120]; give text that is one token" in refused(
        *base, "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", " x", "--wrong", "t")
    assert "--answer 't' and --wrong 't' are the same token 116" in refused(
        *base, "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "t", "--wrong", "t")
    assert "--position 13: out of range for the clean prompt's 13 tokens" in refused(*base, *ARGS, "--position", "13")
    assert "--clean encodes to 40 tokens, more than the model's context_length=32" in refused(
        *base, "--method", "zero", "--clean", "x" * 40, "--answer", " ", "--wrong", "t")
    assert "give exactly one of --model, --checkpoint and --hf" in refused("--out", str(out), *ARGS)
    assert "--batch-size 0: give a number >= 1" in refused(*base, *ARGS, "--batch-size", "0")
    llama = tmp_path / "llama"
    llama.mkdir()
    for name, text in (("config.json", '{"model_type": "llama"}'), ("tokenizer.json", "{}"), ("model.safetensors", "")):
        (llama / name).write_text(text)
    assert f"--hf {llama}: not a transformers model folder" in refused("--hf", str(llama), "--out", str(out), *ARGS)
    from support.encoders import save_tiny_encoder

    encoder = save_tiny_encoder(tmp_path / "encoder")
    assert f"--checkpoint {encoder} is a sentence encoder (BERT)" in refused("--checkpoint", str(encoder), "--out",
                                                                              str(out), *ARGS)  # fmt: skip
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in refused("--checkpoint", str(checkpoint), "--out", str(tmp_path / "file"), *ARGS)
    assert not out.exists()


def test_a_coupled_kind_is_refused_with_its_reason_unless_coupled_heads(tmp_path):
    folder = tiny(tmp_path / "dcmha", attention="dcmha")
    out = tmp_path / "out"
    line = refused("--checkpoint", str(folder), *ARGS, "--out", str(out))
    assert "'dcmha' attention, whose heads are not independent: the composition mixes heads" in line
    assert "--coupled-heads" in line and not out.exists()
    rc, _, err = quietly("effects", "--checkpoint", str(folder), *ARGS, "--coupled-heads", "--out", str(out))
    assert rc == 0, err
    assert len(json.loads((out / "effects.json").read_text())["effects"]) == 2


def test_a_gpt2_folder_zero_map_equals_masking_heads_in_transformers(tmp_path):
    pytest.importorskip("transformers")
    from support.hf_gpt2 import hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    import multihead.hf

    hf = hf_model()
    folder = tmp_path / "gpt2"
    hf.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(hf.config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    clean = "w5 w9 w11 w5 w9"
    rc, _, err = quietly("effects", "--hf", str(folder), "--method", "zero", "--clean", clean, "--answer", "w11",
                         "--wrong", "w3", "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 0, err
    got = json.loads((tmp_path / "out" / "effects.json").read_text())["effects"]
    from transformers import GPT2LMHeadModel

    model = multihead.hf.load_hf(folder, GPT2LMHeadModel)
    x = torch.tensor([[5, 9, 11, 5, 9]])

    def metric() -> float:
        with torch.no_grad():
            logits = model(input_ids=x).logits
        return float(logits[0, -1, 11] - logits[0, -1, 3])

    whole = metric()
    assert max(abs(v) for row in got for v in row) > 1e-3
    for layer in range(2):
        for head in range(4):
            with multihead.hf.head_mask(model, {layer: [head]}):
                assert got[layer][head] == pytest.approx(metric() - whole, rel=1e-4, abs=1e-6), (layer, head)
