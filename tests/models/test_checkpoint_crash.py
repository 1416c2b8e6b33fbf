"""Checkpoints under kill -9: the old or the new one loads, never a mix; no temp files survive the next save."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from multihead.models.checkpoint import checkpoint_paths, load_checkpoint, read_config, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

# A server process: imports once, loads the two models, times a few saves
# (which also warms up everything a save uses), then for each request
# "<0|1> <path>" forks a child that saves them alternately (starting with the
# given one) to <path> until it is killed, appending one byte to the progress
# file after each finished save; the server answers the child's pid, then its
# wait status once the child is gone (so the test never races a zombie).
SERVER = r"""
import os, sys, time
import torch
torch.set_num_threads(1)
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
models = [load_checkpoint(p) for p in sys.argv[1:3]]
save_checkpoint(models[1], sys.argv[3])
start = time.perf_counter()
for i in range(4):
    save_checkpoint(models[i % 2], sys.argv[3])
print("ready", (time.perf_counter() - start) / 4, flush=True)
for line in sys.stdin:
    first, path, progress = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            i = int(first)
            done = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            while True:
                save_checkpoint(models[i % 2], path)
                os.write(done, b"x")
                i += 1
        finally:
            os._exit(3)  # only reached if a save raised
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


def two_models() -> tuple[GPT, GPT]:
    """Different configs and sizes, so new weights with an old config cannot load unnoticed."""
    torch.manual_seed(0)
    a = GPT(GPTConfig.from_preset("tiny", vocab_size=61, context_length=32, num_layers=1))
    torch.manual_seed(1)
    b = GPT(GPTConfig.from_preset("tiny", vocab_size=67, context_length=48, num_layers=2, attention="mqa"))
    return a, b


def temp_names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def which(model: GPT, references: dict[str, GPT]) -> str:
    """The name of the reference whose state dict ``model`` equals (bitwise: the same tensors, saved and loaded)."""
    got = model.state_dict()
    for name, ref in references.items():
        want = ref.state_dict()
        if model.config == ref.config and got.keys() == want.keys():
            if all(torch.equal(got[k], want[k]) for k in want):
                return name
    raise AssertionError(f"the loaded checkpoint is neither saved model: config {model.config}")


def wait_for_saves(progress, count: int, pid: int) -> None:
    """Poll until the saving child ``pid`` has finished ``count`` saves (a minute at most)."""
    deadline = time.monotonic() + 60
    while not (progress.exists() and progress.stat().st_size >= count):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the saver finished fewer than {count} saves in a minute")
        time.sleep(0.001)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the saving children are forked")
def test_kill_9_while_saving_leaves_the_old_or_the_new_checkpoint(tmp_path):
    a, b = two_models()
    save_checkpoint(a, tmp_path / "ref_a")
    save_checkpoint(b, tmp_path / "ref_b")
    references = {"a": load_checkpoint(tmp_path / "ref_a"), "b": load_checkpoint(tmp_path / "ref_b")}
    targets = [tmp_path / "run", tmp_path / "pair" / "tiny.safetensors"]
    for target in targets:
        save_checkpoint(a, target)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path / "ref_a"), str(tmp_path / "ref_b"), str(tmp_path / "timing")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    rng = random.Random(1234)
    seen = {str(t): set() for t in targets}
    left_behind = 0
    progress = tmp_path / "progress"
    try:
        ready, seconds_per_save = server.stdout.readline().split()
        assert ready == "ready"
        save_time = float(seconds_per_save)
        for kill in range(30):
            target = targets[kill % 2]
            # Per target: kill during the first save, or a little after the
            # 1st or 2nd finished one, starting with either model; so the
            # kills land all over a save, and both models were the last one
            # finished before some kill, however slow the machine is.
            finished = (kill // 2) % 3
            progress.unlink(missing_ok=True)  # the last child's count
            server.stdin.write(f"{(kill // 6) % 2} {target} {progress}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            if finished == 0:
                time.sleep(rng.uniform(0, 1.5 * save_time))
            else:
                wait_for_saves(progress, finished, pid)
                time.sleep(rng.uniform(0, 0.3 * save_time))  # before the next save's rename
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the saver ended: {status}"
            loaded = load_checkpoint(target)
            seen[str(target)].add(which(loaded, references))
            assert read_config(target) == loaded.config
            left_behind += len(temp_names(checkpoint_paths(target)[1].parent))
    finally:
        server.kill()
        server.wait()
    # Both outcomes happen (the kills land all over the saves), and neither is ever a mix.
    assert all(s == {"a", "b"} for s in seen.values()), seen
    for target in targets:
        save_checkpoint(a, target)  # removes what the killed savers left
        directory = checkpoint_paths(target)[1].parent
        assert temp_names(directory) == [], f"{left_behind} temp entries seen after kills"
        assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in checkpoint_paths(target))
        assert which(load_checkpoint(target), references) == "a"
