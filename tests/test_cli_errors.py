"""Every mistake on the command line: exit status 2, one line on stderr naming the value,
no traceback, nothing written (and, where the brief says so, no model loaded)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multihead
from multihead.cli import main
from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny byte-level GPT checkpoint (2 layers, 4 heads, context 128), made once."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny")), folder)
    return folder


@pytest.fixture
def work(tmp_path, monkeypatch):
    """Run in an empty folder holding one plain file; yields the placeholders of the cases."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-folder").mkdir()
    return tmp_path


@pytest.fixture
def no_model(monkeypatch):
    """Any model load or build fails the test: the mistake must be found before."""

    def forbidden(*args, **kwargs):
        pytest.fail("a model was loaded before the mistake was reported")

    import multihead.commands.textbook as textbook_command
    import multihead.models.checkpoint as checkpoint
    import multihead.models.gpt as gpt
    import multihead.models.minilm as minilm
    from multihead import cli

    # Commands import their work on first use: import it now, so that no module
    # first imported while the patches are on keeps a patched name for later tests.
    for name in ("multihead.train", "multihead.tools", "multihead.parallel"):
        importlib.import_module(name)
    assert all(callable(command.module.run) for command in cli.COMMANDS)

    monkeypatch.setattr(minilm, "load_minilm", forbidden)
    monkeypatch.setattr(checkpoint, "load_checkpoint", forbidden)
    monkeypatch.setattr(gpt, "GPT", forbidden)
    monkeypatch.setattr(textbook_command, "textbook_cases", forbidden)


def refused(capsys, argv: list[str], *, usage: bool = False) -> str:
    """Run ``main(argv)``; check exit 2, no stdout, no traceback, one error line; return it."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2, err
    assert out == "" and "Traceback" not in err, err
    lines = err.splitlines()
    command = argv[0] if argv and not argv[0].startswith("-") and argv[0] in ("inspect", "generate", "textbook", "prune") else None
    prefix = f"multihead {command}" if command else "multihead"
    assert lines and lines[-1].startswith(f"{prefix}: error: "), err
    assert sum("error:" in line for line in lines) == 1, err
    assert len(lines) == 1, err
    if usage:  # argparse's own errors say where the flags are described
        assert lines[0].endswith(f"; see '{prefix} --help'"), err
    return lines[-1]


def fill(argv: list[str], work: Path, ckpt: Path | None = None) -> list[str]:
    return [a.format(tmp=work, ckpt=ckpt) for a in argv]


# -- inspect: found before any model is loaded ----------------------------------------------------

INSPECT_EARLY = {
    "out is a file": (["inspect", "hi", "--out", "{tmp}/a-file"], "--out {tmp}/a-file: exists and is not a folder"),
    "out under a file": (["inspect", "hi", "--out", "{tmp}/a-file/sub/dir"], "{tmp}/a-file is not a folder"),
    "out in /proc": (["inspect", "hi", "--out", "/proc/multihead-out"], "--out /proc/multihead-out: cannot write in /proc"),
    "out empty": (["inspect", "hi", "--out", ""], "--out is empty"),
    "heads.html is a folder": (["inspect", "hi", "--out", "{tmp}"], "{tmp}/heads.html exists and is not a file"),
    "tokenizer missing": (
        ["inspect", "hi", "--checkpoint", "{ckpt}", "--tokenizer", "{tmp}/none.json"],
        "--tokenizer {tmp}/none.json: no such file",
    ),
    "tokenizer is a folder": (
        ["inspect", "hi", "--checkpoint", "{ckpt}", "--tokenizer", "{tmp}/a-folder"],
        "--tokenizer {tmp}/a-folder: not a file",
    ),
    "tokenizer with MiniLM": (["inspect", "hi", "--tokenizer", "{tmp}/a-file"], "--tokenizer {tmp}/a-file is for a --checkpoint"),
    "checkpoint with model": (
        ["inspect", "hi", "--model", "minilm-l6", "--checkpoint", "{ckpt}"],
        "not both (got --model minilm-l6 --checkpoint {ckpt})",
    ),
    "empty text": (["inspect", ""], "the text '' is empty"),
    "whitespace text": (["inspect", " \n\t "], "the text ' \\n\\t ' is empty or only whitespace"),
    "negative layer": (["inspect", "hi", "--layer", "-1"], "--layer -1 is negative"),
}


@pytest.mark.parametrize("case", INSPECT_EARLY)
def test_inspect_mistakes_are_refused_before_loading_a_model(case, work, tiny_ckpt, no_model, capsys):
    argv, message = INSPECT_EARLY[case]
    if case == "heads.html is a folder":
        (work / "heads.html").mkdir()
    before = files_under(work)
    line = refused(capsys, fill(argv, work, tiny_ckpt))
    assert line.endswith(fill([message], work, tiny_ckpt)[0]) or fill([message], work, tiny_ckpt)[0] in line, line
    assert files_under(work) == before


def test_inspect_without_matplotlib_writes_nothing(work, no_model, capsys, monkeypatch):
    import multihead.commands.inspect as command

    monkeypatch.setattr(command, "find_spec", lambda name: None)
    line = refused(capsys, ["inspect", "hi", "--out", "out"])
    assert "matplotlib, which is not installed: pip install 'multihead[viz]'" in line
    assert files_under(work) == ["a-file", "a-folder"]


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys, which refuses new entries")
def test_inspect_refuses_an_unwritable_out(work, no_model, capsys):
    line = refused(capsys, ["inspect", "hi", "--out", "/sys/multihead-out"])
    assert "--out /sys/multihead-out: cannot write in /sys (" in line


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not bind root")
def test_inspect_refuses_an_out_in_a_read_only_folder(work, no_model, capsys):
    locked = work / "locked"
    locked.mkdir(mode=0o555)
    try:
        line = refused(capsys, ["inspect", "hi", "--out", f"{locked}/out"])
    finally:
        locked.chmod(0o755)
    assert f"--out {locked}/out: cannot write in {locked} (Permission denied)" in line
    assert files_under(locked) == []


# -- inspect: found once the model tells its limits --------------------------------------------------


def test_minilm_refuses_a_text_longer_than_its_maximum(work, capsys):
    line = refused(capsys, ["inspect", "word " * 300, "--out", "out"])
    assert "the text is 302 tokens, more than all-MiniLM-L6-v2's maximum of 256" in line and "--truncate" in line
    assert files_under(work) == ["a-file", "a-folder"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "a" * 200, "--checkpoint", "{ckpt}"], "the text is 200 bytes, more than the checkpoint {ckpt}'s maximum of 128"),
        (["inspect", "hi", "--checkpoint", "{ckpt}", "--layer", "2"], "--layer 2 out of range: the model has layers 0..1"),
        (["inspect", "hi", "--checkpoint", "{tmp}/no-such-ckpt"], "{tmp}/no-such-ckpt"),
        (["inspect", "hi", "--checkpoint", "{ckpt}", "--tokenizer", "{tmp}/a-file"], "--tokenizer {tmp}/a-file: not a readable tokenizer.json"),
    ],
    ids=["too long", "layer out of range", "no checkpoint", "bad tokenizer file"],
)
def test_inspect_checkpoint_mistakes(argv, message, work, tiny_ckpt, capsys):
    line = refused(capsys, fill(argv, work, tiny_ckpt) + ["--out", "out"])
    assert fill([message], work, tiny_ckpt)[0] in line, line
    assert files_under(work) == ["a-file", "a-folder"]


def test_inspect_refuses_token_ids_outside_the_vocabulary(work, tiny_ckpt, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "big": 300}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(work / "tokenizer.json"))
    line = refused(capsys, ["inspect", "big", "--checkpoint", str(tiny_ckpt), "--tokenizer", "tokenizer.json"])
    assert "--tokenizer tokenizer.json produced id 300, but the checkpoint's vocab_size is 256" in line
    assert files_under(work) == ["a-file", "a-folder", "tokenizer.json"]


# -- generate ------------------------------------------------------------------------------------------

GENERATE_EARLY = {
    "preset and checkpoint": (["generate", "--preset", "tiny", "--checkpoint", "{ckpt}"], "not several (got --preset tiny --checkpoint {ckpt})"),
    "save-init and checkpoint": (["generate", "--checkpoint", "{ckpt}", "--save-init", "x"], "cannot be combined with --checkpoint {ckpt}"),
    "save-init and top-k": (["generate", "--save-init", "x", "--top-k", "3"], "so --top-k 3 would be ignored"),
    "save-init and prompt": (["generate", "--save-init", "x", "--prompt", "Hi"], "so --prompt 'Hi' would be ignored"),
    "save-init to a file": (["generate", "--save-init", "{tmp}/a-file"], "--save-init {tmp}/a-file: exists and is not a folder"),
    "save-init under a file": (["generate", "--save-init", "{tmp}/a-file/m.safetensors"], "{tmp}/a-file exists and is not a folder"),
    "save-init in /proc": (["generate", "--save-init", "/proc/multihead-ckpt"], "--save-init /proc/multihead-ckpt: cannot write in /proc"),
    "greedy with top-k": (["generate", "--temperature", "0", "--top-k", "5"], "--temperature 0 is greedy (always the most likely token), so --top-k 5"),
    "greedy with top-p": (["generate", "--temperature", "0", "--top-p", "0.9"], "so --top-p 0.9 would be ignored"),
    "tokenizer missing": (["generate", "--tokenizer", "{tmp}/none.json"], "--tokenizer {tmp}/none.json: no such file"),
    "unknown preset": (["generate", "--preset", "gpt2-smal"], "unknown GPT preset 'gpt2-smal'"),
    "negative max-new-tokens": (["generate", "--max-new-tokens=-1"], "--max-new-tokens -1: must be an integer >= 0"),
    "negative temperature": (["generate", "--temperature=-0.5"], "--temperature -0.5: must be a finite number >= 0"),
    "NaN temperature": (["generate", "--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
    "top-k 0": (["generate", "--top-k", "0"], "--top-k 0: must be an integer >= 1"),
    "top-p 2": (["generate", "--top-p", "2"], "--top-p 2.0: must be a number in (0, 1]"),
}


@pytest.mark.parametrize("case", GENERATE_EARLY)
def test_generate_mistakes_are_refused_before_building_a_model(case, work, tiny_ckpt, no_model, capsys):
    argv, message = GENERATE_EARLY[case]
    before = files_under(work)
    line = refused(capsys, fill(argv, work, tiny_ckpt))
    assert fill([message], work, tiny_ckpt)[0] in line, line
    assert files_under(work) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "y" * 200], "the prompt's 200 tokens exceed the model's context_length=128"),
        (["generate", "--checkpoint", "{tmp}/no-such-ckpt"], "{tmp}/no-such-ckpt"),
    ],
)
def test_generate_value_mistakes(argv, message, work, capsys):
    assert fill([message], work)[0] in refused(capsys, fill(argv, work))
    assert files_under(work) == ["a-file", "a-folder"]


# -- prune: refused before any model is loaded ---------------------------------------------------------

PRUNE_EARLY = {
    "no source": (["prune", "--method", "gradient", "--keep", "0.5", "--out", "out"], "exactly one of --model, --checkpoint and --hf"),
    "hf and checkpoint": (["prune", "--hf", "{tmp}/a-folder", "--checkpoint", "{ckpt}", "--method", "gradient", "--keep", "0.5", "--out", "out"],
                          "exactly one of --model, --checkpoint and --hf"),
    "hf missing": (["prune", "--hf", "{tmp}/none", "--method", "gradient", "--keep", "0.5", "--out", "out"], "--hf {tmp}/none: no such folder"),
    "hf without config": (["prune", "--hf", "{tmp}/a-folder", "--method", "gradient", "--keep", "0.5", "--out", "out"],
                          "--hf {tmp}/a-folder: no config.json in it"),
    "heldout-lines 0": (["prune", "--model", "minilm-l6", "--heldout-lines", "0", "--method", "gradient", "--keep", "0.5", "--out", "out"],
                        "--heldout-lines 0: give a number >= 11"),
    "heldout-lines with a GPT": (["prune", "--checkpoint", "{ckpt}", "--heldout-lines", "20", "--method", "gradient", "--keep", "0.5", "--out", "out"],
                                 "--heldout-lines 20 is for encoders"),
}  # fmt: skip


@pytest.mark.parametrize("case", PRUNE_EARLY)
def test_prune_mistakes_are_refused_before_loading_a_model(case, work, tiny_ckpt, no_model, capsys):
    argv, message = PRUNE_EARLY[case]
    before = files_under(work)
    line = refused(capsys, fill(argv, work, tiny_ckpt))
    assert fill([message], work, tiny_ckpt)[0] in line, line
    assert files_under(work) == before


# -- textbook ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "-1e-9", "nan", "inf"])
def test_textbook_tolerance_must_be_a_finite_non_negative_number(value, work, no_model, capsys):
    line = refused(capsys, ["textbook", f"--tolerance={value}"])
    assert line == f"multihead textbook: error: --tolerance {float(value)}: must be a finite number >= 0 (the largest accepted |difference|)"


# -- argparse's own errors: one line that points at the subcommand's help ------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "hi", "--colour", "red"], "multihead inspect: error: unrecognized arguments: --colour red"),
        (["generate", "--frobnicate"], "multihead generate: error: unrecognized arguments: --frobnicate"),
        (["textbook", "--verbose"], "multihead textbook: error: unrecognized arguments: --verbose"),
        (["inspect", "hi", "--layer", "two"], "multihead inspect: error: argument --layer: invalid int value: 'two'"),
        (["inspect", "hi", "--model", "bert"], "multihead inspect: error: argument --model: invalid choice: 'bert'"),
        (["generate", "--top-k", "1.5"], "multihead generate: error: argument --top-k: invalid int value: '1.5'"),
    ],
)
def test_a_wrong_flag_is_one_line_pointing_at_the_help(argv, message, work, no_model, capsys):
    assert refused(capsys, argv, usage=True).startswith(message)
    assert files_under(work) == ["a-file", "a-folder"]


def test_no_command_or_an_unknown_one(capsys, no_model):
    line = refused(capsys, [], usage=True)
    assert line.startswith("multihead: error: choose a command: textbook, inspect, generate")
    assert "invalid choice: 'inspekt'" in refused(capsys, ["inspekt"], usage=True)


# -- version -------------------------------------------------------------------------------------------


def test_version_in_process(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"multihead {multihead.__version__}\n"
    assert multihead.__version__ == importlib.metadata.version("multihead")


def test_python_dash_m_multihead_version():
    done = subprocess.run([sys.executable, "-m", "multihead", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"multihead {importlib.metadata.version('multihead')}\n"


# -- a bug is not a mistake: its traceback stays -------------------------------------------------------

BUG_LINE = "multihead: this is a bug in multihead"


def broken(*args, **kwargs):
    raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")


@pytest.mark.parametrize(
    "target, argv",
    [
        ("multihead.commands.generate.decode_tokens", ["generate", "--preset", "tiny", "--max-new-tokens", "1"]),
        ("multihead.commands.textbook.textbook_cases", ["textbook"]),
        ("multihead.commands.inspect.classify_heads", ["inspect", "hi", "--checkpoint", "{ckpt}", "--out", "out"]),
        ("multihead.train.loop.train", ["train", "--preset", "tiny", "--data", "{tmp}/a-file", "--out", "run"]),
    ],
    ids=["generate", "textbook", "inspect", "train"],
)
def test_an_internal_error_during_the_work_keeps_its_traceback(target, argv, work, tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(target, broken)
    rc = main(fill(argv, work, tiny_ckpt))
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.splitlines()
    assert "Traceback (most recent call last):" in lines, err
    assert "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'" in lines[-2]
    assert lines[-1].startswith(BUG_LINE) and "report it" in lines[-1] and multihead.__version__ in lines[-1]
    assert "error:" not in err


def test_debug_shows_the_traceback_of_a_mistake(work, no_model, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--debug", "generate", "--top-k", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and BUG_LINE not in err
    assert "ValueError: --top-k 0: must be an integer >= 1" in err  # the original, chained under the UsageError
    assert lines[-1] == "multihead generate: error: --top-k 0: must be an integer >= 1"


def test_a_full_disk_during_the_work_is_one_line(work, capsys, monkeypatch):
    import errno

    def full(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("multihead.models.checkpoint.save_checkpoint", full)
    line = refused(capsys, ["generate", "--save-init", "init"])
    assert line == "multihead generate: error: [Errno 28] No space left on device: 'init'"



def test_a_reader_that_stops_early_is_not_a_bug(capsys, monkeypatch):
    """``multihead textbook | head -1``: the pipe closes under the writer; exit 141, no bug report."""
    import io
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    stdout = io.TextIOWrapper(io.FileIO(write_end, "w"), line_buffering=True)
    monkeypatch.setattr("sys.stdout", stdout)
    try:
        assert main(["textbook"]) == 141
    finally:
        stdout.close()
    assert BUG_LINE not in capsys.readouterr().err
