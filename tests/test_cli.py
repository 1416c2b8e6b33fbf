"""The ``multihead`` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from multihead.cli import main
from multihead.commands.parity import parity_errors
from multihead.commands.textbook import textbook_cases


def test_textbook_command_matches_the_book(capsys):
    assert main(["textbook"]) == 0
    out = capsys.readouterr().out
    assert "textbook cases: all match" in out
    assert "2,360,064" in out
    assert "nn.MultiheadAttention" in out and "F.scaled_dot_product_attention" in out


def test_textbook_command_fails_when_a_case_differs(capsys, monkeypatch):
    # One published number moved by 1e-3: that case, and only that one, must be reported.
    import multihead.commands.textbook as command
    from multihead.data import load_textbook_oracle

    oracle = load_textbook_oracle()
    name = next(iter(oracle["cases"]))
    oracle["cases"][name]["output"][0][0] += 1e-3
    monkeypatch.setattr(command, "load_textbook_oracle", lambda: oracle)
    assert main(["textbook", "--tolerance", "1e-6"]) == 1
    assert "1 case(s) differ by more than 1e-06" in capsys.readouterr().out


def test_every_textbook_case_is_within_1e_6():
    cases = textbook_cases()
    assert len(cases) == 7
    for case in cases:
        if "max_diff" in case:
            assert case["max_diff"] <= 1e-6, case["name"]
        else:
            assert case["ours"] == case["published"] == 2_360_064


@pytest.mark.parametrize("causal", [False, True])
def test_parity_errors_are_at_rounding_level(causal):
    errs64 = parity_errors(torch.float64, causal)
    assert max(errs64.values()) < 1e-12
    errs32 = parity_errors(torch.float32, causal)
    assert max(errs32.values()) < 1e-5


def test_console_script_help_lists_examples():
    out = subprocess.run(
        [sys.executable, "-m", "multihead", "textbook", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "examples:" in out and "multihead textbook" in out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("textbook", "inspect", "generate", "--version"))


# -- the command table ---------------------------------------------------------------------------------

MODEL_COMMANDS = ("train", "compare", "generate", "inspect", "prune", "convert", "roofline", "effects")


def test_cli_is_a_table_of_command_modules():
    import ast
    from pathlib import Path

    from multihead import cli

    source = Path(cli.__file__).read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 160  # the table of commands and a short dispatcher
    functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
    assert not [node.name for f in functions for node in ast.walk(f) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [c.name for c in cli.COMMANDS] == ["textbook", "inspect", "generate", "train", "heads", "compare", "convert",
                                            "prune", "export", "roofline", "effects"]
    parsers = cli.build_parsers()[1]
    for command in cli.COMMANDS:
        module = command.module
        assert module.__name__ == f"multihead.commands.{command.name}"
        assert callable(module.add_arguments) and callable(module.run), command.name
        assert command.help and command.examples, command.name
        text = parsers[command.name].format_help()
        assert parsers[command.name].description and all(example in text for example in command.examples)
        has_import = any("--import" in action.option_strings for action in parsers[command.name]._actions)
        assert has_import == (command.name in MODEL_COMMANDS), command.name
        assert has_import == any("--import" in example for example in command.examples), command.name


def test_top_level_help_has_debug_and_an_example_of_every_command(capsys):
    from multihead import cli

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--debug" in out and all(c.examples[0] in out for c in cli.COMMANDS)
