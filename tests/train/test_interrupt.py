"""``train`` on SIGINT / SIGTERM: it finishes the step, checkpoints it and raises
TrainingInterrupted; a second signal stops at once; the handlers are the run's
only; under torchrun every rank stops after the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from support.torchrun import QUIET_EXIT
from support.training import assert_follows, signal_during_steps
from support.training import tiny_config as support_tiny_config

from multihead.train import latest_checkpoint, load_training_state, train
from multihead.train.interrupt import TrainingInterrupted

TEXT = "".join(f"now is the winter of our discontent, line {i % 7}, made glorious summer.\n" for i in range(300))


def tiny_config(tmp_path, **overrides):
    # constant lr after a one-step warm-up, evaluations at 3 and 6 (what assert_follows reads)
    values = dict(batch_size=8, max_steps=6, lr=3e-3, min_lr=3e-3, warmup=1, eval_every=3, log_every=1,
                  checkpoint_every=3)  # fmt: skip
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


def test_a_signal_ends_the_run_after_its_step_with_a_checkpoint_and_restores_the_handlers(tmp_path, monkeypatch):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = tiny_config(tmp_path)
    signal_during_steps(monkeypatch, {2: [signal.SIGTERM]})
    with pytest.raises(TrainingInterrupted) as err:
        train(config, progress=False)
    assert (err.value.signum, err.value.step, err.value.exit_status) == (signal.SIGTERM, 2, 143)
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert latest_checkpoint(config.out).name == "step-000002"
    monkeypatch.undo()

    resumed = train(config, resume=True, progress=False)
    assert {sig: signal.getsignal(sig) for sig in before} == before
    straight = train(tiny_config(tmp_path / "straight"), progress=False)
    metrics = [[json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
               for r in (resumed, straight)]  # fmt: skip
    assert_follows(*metrics)


def test_the_same_signal_delivered_twice_at_once_is_one_stop(tmp_path, monkeypatch):
    # as under torchrun: from the terminal and forwarded by torchrun
    config = tiny_config(tmp_path)
    signal_during_steps(monkeypatch, {2: [signal.SIGINT, signal.SIGINT]})
    with pytest.raises(TrainingInterrupted) as err:
        train(config, progress=False)
    assert err.value.step == 2 and latest_checkpoint(config.out).name == "step-000002"


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    from multihead.train import interrupt

    monkeypatch.setattr(interrupt, "REPEAT_WINDOW_S", 0.0)  # any second signal comes "later"
    before = signal.getsignal(signal.SIGINT)
    config = tiny_config(tmp_path)
    signal_during_steps(monkeypatch, {5: [signal.SIGINT, signal.SIGINT]})
    with pytest.raises(TrainingInterrupted) as err:
        train(config, progress=False)
    assert err.value.step is None and not err.value.checkpointed and err.value.exit_status == 130
    assert latest_checkpoint(config.out).name == "step-000003"  # the last regular one
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_the_process_ignores_stays_ignored(tmp_path, monkeypatch):
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as under nohup
    try:
        signal_during_steps(monkeypatch, {2: [signal.SIGTERM]})
        result = train(tiny_config(tmp_path), progress=False)
        assert result.steps == 6 and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# Each rank trains 6 steps; rank 1 alone gets SIGTERM during step 2. Every rank
# records where it stopped and what it heard, then resumes to the end.
SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, torch
    import torch.distributed as dist
    from multihead.train import TrainConfig, train
    from multihead.train.interrupt import TrainingInterrupted
    values, out = json.loads(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    original, calls = torch.optim.AdamW.step, [0]
    def step(self, *args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            signal.raise_signal(signal.SIGTERM)
        return original(self, *args, **kwargs)
    torch.optim.AdamW.step = step
    dist.init_process_group("gloo")
    config = TrainConfig.from_dict(values)
    try:
        train(config, progress=False)
        seen = None
    except TrainingInterrupted as e:
        seen = [e.signum, e.step]
    torch.optim.AdamW.step = original
    train(config, resume=True, progress=False)
    dist.destroy_process_group()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(seen, f)
    """
)


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp2"])
def test_under_torchrun_every_rank_stops_after_the_same_step(tmp_path, shard):
    parallel = tiny_config(tmp_path / "ddp", shard=shard)
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT + QUIET_EXIT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    done = subprocess.run([*command, str(script), json.dumps(parallel.to_dict()), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [[signal.SIGTERM, 2], [signal.SIGTERM, 2]]

    run = tmp_path / "ddp" / "run"
    state = load_training_state(run / "checkpoints" / "step-000006")
    assert state.world_size == 2
    single = train(tiny_config(tmp_path / "one"), progress=False)
    got, want = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]
                 for r in (run, single.run_dir))  # fmt: skip
    assert_follows(got, want)
