"""The crash-safe writer behind checkpoints (and other saved files): modes, stale temp
files of killed writers, failed writes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid

import pytest
import torch

import multihead.io
from multihead.io import remove_stale_temps, write_atomic, write_bytes_atomic, write_text_atomic
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


def tiny(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("tiny", vocab_size=61, context_length=32, num_layers=1))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def temp_name(name: str, pid: int) -> str:
    return f".{name}.{pid}.{uuid.uuid4().hex}.tmp"


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_files_get_the_mode_of_a_plain_open(tmp_path, umask, mask, expected):
    # safetensors' own writer makes 0o600 files; a checkpoint is as readable as any file the user writes
    umask(mask)
    config_path, weights_path = save_checkpoint(tiny(), tmp_path / "c")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert mode(plain) == expected
    assert (mode(config_path), mode(weights_path)) == (expected, expected)
    assert mode(write_bytes_atomic(tmp_path / "b.bin", b"x")) == expected


def test_an_existing_files_mode_is_kept(tmp_path, umask):
    config_path, weights_path = save_checkpoint(tiny(), tmp_path / "c")
    os.chmod(weights_path, 0o600)
    os.chmod(config_path, 0o640)
    save_checkpoint(tiny(seed=1), tmp_path / "c")
    assert (mode(config_path), mode(weights_path)) == (0o640, 0o600)


def test_stale_temps_of_dead_writers_are_removed_and_nothing_else(tmp_path):
    save_checkpoint(tiny(), tmp_path / "c")
    directory = tmp_path / "c"
    dead, alive = dead_pid(), os.getppid()
    stale = [temp_name("model.safetensors", dead), temp_name("config.json", dead)]
    kept = [
        temp_name("model.safetensors", alive),  # a writer at work in another process
        temp_name("model.safetensors", os.getpid()),  # perhaps another thread of this one
        temp_name("other.safetensors", dead),  # another file's
        f".model.safetensors.{dead}.not-hex.tmp",
        f".model.safetensors.{dead}.{uuid.uuid4().hex}.tmp.bak",
        "notes.tmp",
    ]
    (directory / stale[0]).mkdir()  # a staging directory, as this version leaves it
    (directory / stale[0] / "model.safetensors").write_bytes(b"half")
    (directory / stale[1]).write_text("{")  # a plain temp file, as the previous version left it
    for name in kept:
        (directory / name).write_text("keep")
    save_checkpoint(tiny(seed=1), tmp_path / "c")
    assert sorted(p.name for p in directory.iterdir()) == sorted(["config.json", "model.safetensors", *kept])
    assert remove_stale_temps(directory / "model.safetensors") == []


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = write_text_atomic(tmp_path / "f.json", "old")

    def fail(staged):
        staged.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.json"]

    # the same for a whole checkpoint: the weights' writer fails, the old checkpoint stays
    m = tiny()
    save_checkpoint(m, tmp_path / "c")
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("no space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(OSError, match="no space left"):
        save_checkpoint(tiny(seed=1), tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(tmp_path / "c")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())


def test_the_attention_record_uses_the_same_writer(tmp_path, umask):
    from multihead import MultiHeadAttention
    from multihead.tools import capture

    attn = MultiHeadAttention(8, 2).eval()
    with capture(attn) as record:
        attn(torch.randn(1, 3, 8))
    dead = dead_pid()
    (tmp_path / temp_name("heads.json", dead)).mkdir()
    path = record.save_json(tmp_path / "heads.json")
    assert mode(path) == 0o644 and [p.name for p in tmp_path.iterdir()] == ["heads.json"]


def test_remove_stale_temps_in_a_missing_directory(tmp_path):
    assert remove_stale_temps(tmp_path / "nowhere" / "model.safetensors") == []
    assert multihead.io._process_alive(os.getpid()) and not multihead.io._process_alive(dead_pid())
