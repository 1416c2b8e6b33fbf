"""Two data-parallel processes (torchrun, gloo) follow the one-process run
with the same global batch, including across a resume."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from support.torchrun import QUIET_EXIT
from support.training import assert_follows, assert_heads_follow
from support.training import tiny_config as support_tiny_config

from multihead.models.checkpoint import load_checkpoint
from multihead.train import TrainConfig, load_training_state, train

TEXT = "".join(f"all the world's a stage, scene {i % 6}, and all the men merely players.\n" for i in range(300))


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    # lr == min_lr after a one-step warm-up: a constant rate, so a run stopped
    # at step 3 and extended to 6 follows the 6-step run
    values = dict(
        batch_size=8, max_steps=6, lr=3e-3, min_lr=3e-3,
        warmup=1, eval_every=3, log_every=1, checkpoint_every=3,
    )
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


# Each rank: 3 steps, then a resume to 6, in one process group it owns
# (train() leaves a group it did not create alone).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from multihead.train import TrainConfig, train
    values = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    train(TrainConfig.from_dict({**values, "max_steps": 3}), progress=False)
    train(TrainConfig.from_dict(values), resume=True, progress=False)
    dist.destroy_process_group()
    """
)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    # grad_accum 2 under DDP: each rank's 4 rows in two micro-batches of 2 (no_sync on the first)
    parallel = tiny_config(tmp_path / "ddp", grad_accum=2, track_heads=True)
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT + QUIET_EXIT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    done = subprocess.run(
        [*command, str(script), json.dumps(parallel.to_dict())], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]

    single = train(tiny_config(tmp_path / "one", track_heads=True), progress=False)
    got, want = metrics(tmp_path / "ddp" / "run"), metrics(single.run_dir)
    assert_follows(got, want)
    assert_heads_follow(got, want)  # --track-heads: every rank scores, rank 0 writes

    final = tmp_path / "ddp" / "run" / "checkpoints" / "step-000006"
    model = load_checkpoint(final)
    trained = dict(single.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], msg=name)  # float32 tolerance: different sums
    state = load_training_state(final)
    assert state.world_size == 2 and set(state.rng) == {"cpu.0", "cpu.1"}
