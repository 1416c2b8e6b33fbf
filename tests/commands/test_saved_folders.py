"""Every folder ``multihead prune`` and ``multihead convert`` write opens again: with ``--checkpoint``
in inspect, prune and convert, in generate where it can (an encoder is refused in one line), and in
Python through ``multihead.models.load_model``.

References are rebuilt here with the library calls (``prune_heads``, ``to_gqa``) on the folder the
command read, from the heads its report names; compared with float tolerances.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import quietly
from support.encoders import LINES, save_tiny_encoder

from multihead.commands.inspect import inspect_text
from multihead.models import SentenceEncoder, load_model, load_sentence_encoder
from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.convert_heads import to_gqa
from multihead.tools.prune import prune_heads

SENTENCES = LINES[:4]


def table(report: dict) -> dict[int, list[int]]:
    return {int(k): v for k, v in report["removed"].items() if v}


def ok(*argv: str) -> str:
    rc, out, err = quietly(*argv)
    assert rc == 0, err
    return out


def test_a_pruned_and_converted_encoder_opens_in_every_command(tmp_path):
    enc = save_tiny_encoder(tmp_path / "enc")
    pruned, mqa, again = tmp_path / "pruned", tmp_path / "mqa", tmp_path / "again"
    stdout = ok("prune", "--checkpoint", str(enc), "--method", "gradient", "--keep", "0.5", "--calibration-lines",
                "16", "--heldout-lines", "16", "--out", str(pruned))  # fmt: skip
    report = json.loads((pruned / "report.json").read_text())
    assert report["source"] == f"sentence encoder {enc}" and report["heads"] == [8, 4]
    assert f"open it with --checkpoint {pruned} or multihead.models.load_model" in stdout
    got = load_model(pruned)
    assert isinstance(got, SentenceEncoder) and got.encoder.config.layer_heads == report["layer_heads"]
    want = prune_heads(load_sentence_encoder(enc), table(report))
    torch.testing.assert_close(got.encode(SENTENCES), want.encode(SENTENCES))

    found = inspect_text("to be or not to be", checkpoint=str(pruned))
    assert found.record.source == "sentence encoder pruned"
    assert found.token_ids == got.tokenizer.encode("to be or not to be").ids
    assert [len(layer.weights[0]) for layer in found.record.layers] == report["layer_heads"]

    rc, out, err = quietly("generate", "--checkpoint", str(pruned), "to be")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "holds a sentence encoder" in err and f"multihead inspect --checkpoint {pruned}" in err

    stdout = ok("convert", "--to", "mqa", "--checkpoint", str(pruned), "--heldout-lines", "16", "--out", str(mqa))
    converted = json.loads((mqa / "report.json").read_text())
    assert converted["attention"] == ["mha", "mqa"] and converted["layer_heads"] == report["layer_heads"]
    assert converted["removed"] == report["removed"]  # carried over: inspect still knows where each head was
    seen = inspect_text("to be", checkpoint=str(mqa))
    assert seen.slots is not None and seen.slots.original and seen.notices == []
    assert f"try: multihead inspect --checkpoint {mqa}" in stdout
    want = to_gqa(load_model(pruned), 1)
    got = load_model(mqa)
    assert got.encoder.config == want.encoder.config
    torch.testing.assert_close(got.encode(SENTENCES), want.encode(SENTENCES))

    ok("prune", "--checkpoint", str(mqa), "--method", "ablation", "--keep", "0.5", "--calibration-lines", "16",
       "--heldout-lines", "16", "--out", str(again))  # fmt: skip
    second = json.loads((again / "report.json").read_text())
    assert load_model(again).encoder.config.layer_heads == second["layer_heads"]
    assert inspect_text("to be", checkpoint=str(again)).record.num_layers == 2


def test_a_pruned_gpt_folder_opens_in_load_model_and_convert(tmp_path):
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), plain)
    pruned, gqa = tmp_path / "pruned", tmp_path / "gqa"
    ok("prune", "--checkpoint", str(plain), "--method", "gradient", "--keep", "0.5", "--calibration-lines", "16",
       "--out", str(pruned))  # fmt: skip
    model = load_model(pruned)
    assert isinstance(model, GPT) and not model.training
    ok("convert", "--to", "mqa", "--checkpoint", str(pruned), "--out", str(gqa))
    assert load_model(gqa).config.attention == "mqa"


def test_encoder_only_options_are_refused_for_a_gpt_and_back(tmp_path):
    enc = save_tiny_encoder(tmp_path / "enc")
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), plain)
    out = tmp_path / "out"
    rc, _, err = quietly("convert", "--to", "mqa", "--checkpoint", str(plain), "--heldout-lines", "16", "--out", str(out))
    assert rc == 2 and "--heldout-lines 16 is for encoders" in err, err
    rc, _, err = quietly("convert", "--to", "mqa", "--checkpoint", str(enc), "--method", "aligned",
                         "--calibration-data", "shakespeare", "--out", str(out))  # fmt: skip
    assert rc == 2 and "--calibration-data shakespeare is for a GPT --checkpoint" in err, err
    rc, _, err = quietly("inspect", "to be", "--checkpoint", str(enc), "--tokenizer", str(enc / "tokenizer.json"),
                         "--out", str(out))  # fmt: skip
    assert rc == 2 and "is a sentence encoder with its own tokenizer.json" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--to", "mqa", "--num-kv-heads", "2"], "--to mqa has one key/value head; --num-kv-heads 2 is for --to gqa"),
     (["--to", "gqa"], "--to gqa needs --num-kv-heads G")],
)  # fmt: skip
def test_convert_num_kv_heads_goes_with_the_target(flags, message, tmp_path):
    enc = save_tiny_encoder(tmp_path / "enc")
    rc, out, err = quietly("convert", *flags, "--checkpoint", str(enc), "--out", str(tmp_path / "o"))
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o").exists()
