"""``multihead generate``."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
import torch

from multihead.cli import build_parsers, main
from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); a mistake exits through SystemExit(2)."""
    try:
        rc = main(["generate", *args])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_from_a_preset(capsys):
    rc, out, err = run_cli(capsys, "--preset", "tiny", "--max-new-tokens", "5", "--seed", "0")
    assert rc == 0
    assert out.startswith("Hello") and out.endswith("\n")
    assert "preset 'tiny'" in err and "124,672 parameters" in err
    # same seed, same text; another seed, other weights and draws
    assert run_cli(capsys, "--preset", "tiny", "--max-new-tokens", "5", "--seed", "0")[1] == out
    assert run_cli(capsys, "--preset", "tiny", "--max-new-tokens", "20", "--seed", "1")[1] != out


def test_generate_from_a_saved_checkpoint(capsys, tmp_path):
    ckpt = tmp_path / "tiny-init"
    rc, out, _ = run_cli(capsys, "--preset", "tiny", "--seed", "3", "--save-init", str(ckpt))
    assert rc == 0 and (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
    args = ["--prompt", "To be", "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    rc, from_ckpt, err = run_cli(capsys, "--checkpoint", str(ckpt), *args)
    assert rc == 0 and from_ckpt.startswith("To be") and "checkpoint" in err
    # the checkpoint holds the seed-3 weights: same text as building the preset with seed 3
    assert run_cli(capsys, "--preset", "tiny", *args)[1] == from_ckpt


def test_generate_greedy_is_the_model_argmax(capsys, tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    save_checkpoint(model, tmp_path / "m.safetensors")
    rc, out, _ = run_cli(
        capsys,
        "--checkpoint",
        str(tmp_path / "m.safetensors"),
        "--prompt",
        "ab",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
    )
    want = model.generate(torch.tensor([[97, 98]]), 6, temperature=0)[0].tolist()
    assert rc == 0 and out == bytes(want).decode("utf-8", errors="replace") + "\n"


def test_non_byte_vocab_needs_a_tokenizer(capsys, tmp_path):
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", vocab_size=300)), tmp_path / "v300")
    rc, out, err = run_cli(capsys, "--checkpoint", str(tmp_path / "v300"), "--max-new-tokens", "3")
    assert rc == 2 and out == ""
    assert "vocab_size is 300" in err and "--tokenizer" in err and "tokenizer.json" in err

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"w{i}": i for i in range(3, 300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rc, out, err = run_cli(
        capsys,
        "--checkpoint",
        str(tmp_path / "v300"),
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "4",
    )
    assert rc == 0 and out.startswith("hello world") and len(out.split()) == 6


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_generate_with_weight_only_layers(capsys, weights):
    """Greedy text equals float32's on the tiny preset (seed 1: its greedy choices lead by far more
    than the rounding moves the logits); the logit error is printed once, on stderr."""
    args = ["--preset", "tiny", "--seed", "1", "--temperature", "0", "--max-new-tokens", "12"]
    rc, want, _ = run_cli(capsys, *args)
    rc, out, err = run_cli(capsys, *args, "--weights", weights)
    assert rc == 0 and out == want
    lines = [line for line in err.splitlines() if "logit error" in line]
    assert len(lines) == 1 and lines[0].startswith(f"weights {weights}: logit error against fp32")
    assert "greedy 12/12 tokens equal" in lines[0]
    rc, out, err = run_cli(capsys, *args, "--weights", "fp32")
    assert rc == 0 and out == want and "logit error" not in err


def test_weight_only_layers_of_another_attention_kind_are_refused(capsys, tmp_path):
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", attention="talking_heads")), tmp_path / "th")
    rc, out, err = run_cli(capsys, "--checkpoint", str(tmp_path / "th"), "--weights", "bf16")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert "(kinds that declare weight_only_layers), got attention='talking_heads'" in err


@pytest.mark.parametrize(
    "args,match",
    [
        (["--preset", "gpt2-smal"], "unknown GPT preset 'gpt2-smal'; valid presets:"),
        (["--preset", "tiny", "--prompt", "x" * 129], "the prompt's 129 tokens exceed the model's context_length=128"),
        (["--preset", "tiny", "--checkpoint", "x"], "not several"),
        (["--checkpoint", "no/such/dir"], "no/such/dir"),
        (["--preset", "tiny", "--prompt", ""], "encodes to no tokens"),
        (["--preset", "tiny", "--top-p", "2"], "--top-p 2.0: must be a number in (0, 1]"),
        (["--preset", "tiny", "--weights", "int8", "--save-init", "x"], "so --weights int8 would be ignored"),
        (["--preset", "tiny", "--weights", "int4"], "argument --weights: invalid choice: 'int4'"),
    ],
)
def test_errors_are_reported(capsys, args, match):
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("multihead generate: error:") and match in err


def test_help_examples_run(capsys, tmp_path, monkeypatch):
    """Every example in the help epilog is a runnable command."""
    help_text = subprocess.run(
        [sys.executable, "-m", "multihead", "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "examples:" in help_text
    examples = [line.strip() for line in help_text.split("examples:")[1].splitlines() if line.strip()]
    assert len(examples) >= 3 and all(e.startswith("multihead generate") for e in examples)
    assert any("--import mykinds" in e for e in examples)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --import puts the current folder first
    (tmp_path / "mykinds.py").write_text("IMPORTED = True  # the user's module; it would register kinds\n")
    try:
        for example in examples:
            argv = shlex.split(example)[1:]
            assert main(argv) == 0, example
        assert sys.modules["mykinds"].IMPORTED
    finally:
        sys.modules.pop("mykinds", None)
    capsys.readouterr()
    assert "generate" in build_parsers()[0].format_help()
