"""``multihead train`` stopped by Ctrl-C (SIGINT) or SIGTERM: one line with the
command that resumes, exit 130 / 143, and the resumed run logs the losses of
an uninterrupted one."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from multihead.cli import main

# `multihead train ARGV` in a child that sends itself the signal in the middle of
# optimizer step AT (as a Ctrl-C or a `kill` from outside would arrive).
CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from multihead.cli import main
    sig, at = getattr(signal, sys.argv[1]), int(sys.argv[2])
    original, calls = torch.optim.AdamW.step, [0]
    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), sig)
        return original(self, *args, **kwargs)
    torch.optim.AdamW.step = step
    sys.exit(main(sys.argv[3:]))
    """
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()


def write_text(path: Path, lines: int = 400) -> Path:
    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n")
    return path


def run_args(data: Path, out: Path) -> list[str]:
    return ["train", "--data", str(data), "--preset", "tiny", "--context-length", "16", "--batch-size", "4",
            "--max-steps", "8", "--eval-every", "4", "--eval-batches", "2", "--log-every", "1",
            "--checkpoint-every", "3", "--dropout", "0.1", "--threads", "1", "--out", str(out)]  # fmt: skip


def multihead(*argv: str, signal_name: str, at: int) -> subprocess.CompletedProcess:
    """``multihead ARGV`` in a child that gets ``signal_name`` during optimizer step ``at``."""
    prefix = [sys.executable, "-c", CHILD, signal_name, str(at)]
    return subprocess.run([*prefix, *argv], env=ENV, capture_output=True, text=True, timeout=300)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def stop(tmp_path: Path, signal_name: str, status: int) -> tuple[Path, Path, str]:
    """(data, run dir, the line) of a run stopped by ``signal_name`` during step 5."""
    data = write_text(tmp_path / "text.txt")
    run = tmp_path / "run"
    stopped = multihead(*run_args(data, run), signal_name=signal_name, at=5)
    assert stopped.returncode == status, stopped.stderr
    assert "Traceback" not in stopped.stderr and stopped.stdout == ""
    said = [line for line in stopped.stderr.splitlines() if signal_name in line]
    assert len(said) == 1 and said[0] == stopped.stderr.splitlines()[-1], stopped.stderr
    resume = f"multihead train --out {shlex.quote(str(run))} --resume"
    assert (
        said[0]
        == f"multihead train: {signal_name}: stopped after step 5 with a checkpoint in {run}; resume with: {resume}"
    )
    assert json.loads((run / "checkpoints" / "latest").read_text())["step"] == 5  # not the step-3 one
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5]
    return data, run, said[0]


def test_sigterm_checkpoints_the_step_and_exits_143(tmp_path):
    stop(tmp_path, "SIGTERM", 143)


def test_ctrl_c_checkpoints_the_step_and_the_printed_command_resumes_as_if_uninterrupted(tmp_path, capsys):
    data, run, line = stop(tmp_path, "SIGINT", 130)
    # the printed command, as the user would paste it
    argv = shlex.split(line.split("resume with: ", 1)[1])
    assert argv[0] == "multihead"
    assert main(argv[1:]) == 0
    assert main(run_args(data, tmp_path / "straight")) == 0
    capsys.readouterr()
    got, want = records(run), records(tmp_path / "straight")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 9))
    for key in ("train_loss", "lr", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]))
    torch.testing.assert_close(
        torch.tensor([r["val_loss"] for r in got if "val_loss" in r]),
        torch.tensor([r["val_loss"] for r in want if "val_loss" in r]),
    )


def test_the_resume_command_under_torchrun_and_with_imports(monkeypatch):
    from multihead.commands.train import resume_command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resume_command("runs/a b", ["mykinds"]) == "multihead train --out 'runs/a b' --resume --import mykinds"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resume_command("runs/x", []) == "torchrun --nproc-per-node 4 -m multihead train --out runs/x --resume"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two machines: the same launch, each
    assert resume_command("runs/x", []).startswith("multihead train --out runs/x --resume (in the same torchrun")


def test_ctrl_c_before_the_first_step_is_one_line_too(tmp_path, monkeypatch, capsys):
    from multihead.train import run_files

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_files, "load_corpus", interrupted)  # Ctrl-C while the data is read
    data = write_text(tmp_path / "text.txt")
    assert main(run_args(data, tmp_path / "run")) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "multihead train: SIGINT outside the training steps: stopped; no checkpoint to resume\n"
