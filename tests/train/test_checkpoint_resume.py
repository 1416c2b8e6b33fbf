"""Resume after kill -9 equals the uninterrupted run; what resume refuses;
checkpoint pruning and pointers."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.training import tiny_config as support_tiny_config

from multihead.train import TrainConfig, latest_checkpoint, train

TEXT = "".join(f"to be or not to be, line {i % 5}: that is the question.\n" for i in range(300))


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    # dropout and grad_accum > 1: the generator state and micro-batches must be restored too
    values = dict(
        batch_size=4, grad_accum=2, max_steps=12, lr=3e-3, min_lr=3e-4,
        warmup=2, dropout=0.1, eval_every=4, log_every=1, checkpoint_every=3,
    )
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


# The child blocks in the optimizer's 8th step (steps 1..7 done, checkpoint at 6),
# after touching a flag file, until it is killed.
CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from multihead.train import TrainConfig, train
    config = TrainConfig.from_dict(__import__("json").loads(sys.argv[1]))
    flag = sys.argv[2]
    original, calls = torch.optim.AdamW.step, [0]
    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 8:
            open(flag, "w").close()
            time.sleep(600)
        return original(self, *args, **kwargs)
    torch.optim.AdamW.step = step
    train(config, progress=False)
    """
)


def losses(run_dir):
    keys = ("step", "train_loss", "aux_loss", "lr", "grad_norm", "val_loss")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: record.get(k) for k in keys} for record in map(json.loads, lines)]


def test_resume_after_kill_equals_uninterrupted_run(tmp_path):
    killed = tiny_config(tmp_path / "killed")
    flag = tmp_path / "flag"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(killed.to_dict()), str(flag)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert child.poll() is None, f"the training child exited early with status {child.returncode}"
            assert time.monotonic() < deadline, "the training child never reached step 8"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    run = tmp_path / "killed" / "run"
    assert latest_checkpoint(run).name == "step-000006"
    assert [m["step"] for m in losses(run)] == list(range(1, 8))  # step 7 was logged, not checkpointed
    # a checkpoint directory that a crash left half written, above the latest
    partial = run / "checkpoints" / "step-000009"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"cut short")

    resumed = train(killed, resume=True, progress=False)
    straight = train(tiny_config(tmp_path / "straight"), progress=False)

    # Same operations on the same shapes, one thread, same machine: bitwise.
    assert losses(run) == losses(straight.run_dir)
    assert [m["step"] for m in losses(run)] == list(range(1, 13))
    assert resumed.val_loss == straight.val_loss
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step-000009", "step-000012"]  # the partial one replaced, older ones pruned


def test_resume_may_change_only_lengths_intervals_and_out(tmp_path):
    config = tiny_config(tmp_path, max_steps=3, dropout=0.0, grad_accum=1)
    train(config, progress=False)
    other = tiny_config(tmp_path, max_steps=3, dropout=0.0, grad_accum=1, lr=1e-3, seed=5)
    with pytest.raises(ValueError, match=r"another config.*'lr': \(0\.003, 0\.001\).*'seed': \(0, 5\)"):
        train(other, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"already holds a training checkpoint \(step-000003\)"):
        train(config, progress=False)
    longer = tiny_config(tmp_path, max_steps=5, dropout=0.0, grad_accum=1, log_every=2, checkpoint_every=5)
    result = train(longer, resume=True, progress=False)
    assert result.steps == 5 and latest_checkpoint(result.run_dir).name == "step-000005"
    assert [m["step"] for m in losses(result.run_dir)] == [1, 2, 3, 4, 5]


def test_a_corrupt_latest_pointer_is_refused(tmp_path):
    config = tiny_config(tmp_path, max_steps=3, dropout=0.0, grad_accum=1)
    train(config, progress=False)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.write_text(json.dumps({"format": "multihead.train-latest", "step": 3, "directory": "../../etc"}))
    with pytest.raises(ValueError, match="is not a checkpoint pointer"):
        train(config, resume=True, progress=False)
    latest.write_text(json.dumps({"format": "multihead.train-latest", "step": 6, "directory": "step-000006"}))
    with pytest.raises(ValueError, match="names .*step-000006, which holds no state.safetensors"):
        train(config, resume=True, progress=False)
