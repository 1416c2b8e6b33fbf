"""Ctrl-C (SIGINT) or SIGTERM during ``multihead convert`` or ``multihead prune`` leaves no part of
the output folder: one line on stderr, exit status 130 or 143, --out absent (or as it was), and no
staging folder beside it.

Each test runs the command in a subprocess and sends the signal only once the command has said
(on stderr) that it reached the stage under test, so the signal always lands there: the writing
stage is held open by a user module (``--import``) that waits after the weights are written, and
another says when the (long) recovery training starts.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.cli import quietly

import multihead
from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

SRC = str(Path(multihead.__file__).resolve().parents[1])
SLOW_SAVE = '''
import sys, time
import multihead.models.checkpoint as checkpoint

_save = checkpoint.save_checkpoint


def save_checkpoint(model, path, **options):
    written = _save(model, path, **options)
    print("test-marker: weights written", file=sys.stderr, flush=True)
    time.sleep(120)
    return written


checkpoint.save_checkpoint = save_checkpoint
'''
SAY_RECOVERY = '''
import sys
import multihead.tools.recovery as recovery

_recover = recovery.recover


def recover(*args, **options):
    print("test-marker: recovery started", file=sys.stderr, flush=True)
    return _recover(*args, **options)


recovery.recover = recover
'''


@pytest.fixture
def plain(tmp_path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), path)
    (tmp_path / "slow_save.py").write_text(SLOW_SAVE)
    (tmp_path / "say_recovery.py").write_text(SAY_RECOVERY)
    return path


def start(tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "multihead", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def interrupt_at(proc: subprocess.Popen, marker: bytes, signum: int, timeout: float = 120) -> tuple[int, str]:
    """Read stderr until ``marker`` appears, send ``signum``, wait; (exit status, stderr after the marker)."""
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"no {marker!r} on stderr (exit {proc.poll()}): {seen.decode(errors='replace')}")
        if select.select([proc.stderr], [], [], left)[0]:
            seen += os.read(proc.stderr.fileno(), 1 << 16)
    proc.send_signal(signum)
    _, rest = proc.communicate(timeout=timeout)
    return proc.returncode, rest.decode()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def test_sigint_while_convert_writes_leaves_no_folder(plain, tmp_path):
    out = tmp_path / "gqa"
    proc = start(tmp_path, "convert", "--import", "slow_save", "--to", "gqa", "--num-kv-heads", "2",
                 "--checkpoint", str(plain), "--out", str(out))  # fmt: skip
    rc, err = interrupt_at(proc, b"test-marker: weights written", signal.SIGINT)
    assert rc == 130, err
    lines = err.strip().splitlines()
    assert lines == [f"multihead convert: interrupted by SIGINT; {out} was not written (nothing was left behind)"]
    assert not out.exists() and leftovers(tmp_path) == []


def test_sigterm_while_convert_writes_keeps_the_earlier_folder(plain, tmp_path):
    out = tmp_path / "gqa"
    rc, _, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(plain), "--out", str(out))
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = start(tmp_path, "convert", "--import", "slow_save", "--to", "mqa", "--checkpoint", str(plain),
                 "--out", str(out))  # fmt: skip
    rc, err = interrupt_at(proc, b"test-marker: weights written", signal.SIGTERM)
    assert rc == 143 and err.strip().splitlines() == [
        f"multihead convert: interrupted by SIGTERM; {out} was not written (nothing was left behind)"
    ], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier conversion, untouched
    assert leftovers(tmp_path) == []


def test_sigint_while_prune_recovers_leaves_no_folder(plain, tmp_path):
    out = tmp_path / "deep" / "pruned"  # parents that do not exist yet
    proc = start(tmp_path, "prune", "--import", "say_recovery", "--checkpoint", str(plain), "--method", "gradient",
                 "--keep", "0.5", "--calibration-lines", "16", "--recover-steps", "1000000", "--out", str(out))  # fmt: skip
    rc, err = interrupt_at(proc, b"test-marker: recovery started", signal.SIGINT)  # a million steps: still running
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == (
        f"multihead prune: interrupted by SIGINT; {out} was not written (nothing was left behind)"
    )
    assert "Traceback" not in err
    assert not (tmp_path / "deep").exists() and leftovers(tmp_path) == []
