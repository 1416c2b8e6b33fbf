"""``train`` with tensor_parallel: heads split over 2 processes (and 2 x 2 with data
parallelism) follow the one-process run; their checkpoints resume in one process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.torchrun import QUIET_EXIT
from support.training import tiny_config as support_tiny_config

from multihead.models.gpt import GPTConfig
from multihead.train import TrainConfig, load_training_state, train
from multihead.train.tensor_parallel import check_split

TEXT = "".join(f"now is the winter of our discontent, line {i % 6}, made glorious summer.\n" for i in range(300))


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    # a constant learning rate after a one-step warm-up (a run stopped at 3 and extended to 6
    # follows the 6-step run); gqa with 2 key/value heads (one per rank)
    values = dict(
        batch_size=8, max_steps=6, lr=3e-3, min_lr=3e-3, warmup=1, eval_every=3, log_every=1,
        checkpoint_every=3, attention="gqa", attention_options={"num_kv_heads": 2},
    )  # fmt: skip
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


# Each rank: 3 steps, then a resume to 6 (the second call reads the first's checkpoint).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from multihead.train import TrainConfig, train
    values = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    train(TrainConfig.from_dict({**values, "max_steps": 3}), progress=False)
    if values["max_steps"] > 3:
        train(TrainConfig.from_dict(values), resume=True, progress=False)
    dist.destroy_process_group()
    """
)


def assert_follows(got, want):
    """Steps 1-6 agree (validation at 3 and 6). Split matrix products and all-reduces round
    differently, and AdamW turns the rounding of near-zero gradients into steps of size lr, so
    the tolerance is 1e-4 relative (a missing gradient sum or a wrong shard is off by 1e-1)."""
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4, 5, 6]
    for key in ("train_loss", "aux_loss", "grad_norm", "lr", "val_loss"):
        pairs = [(a[key], b[key]) for a, b in zip(got, want) if key in a or key in b]
        torch.testing.assert_close(torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs]),
                                   rtol=1e-4, atol=1e-6, msg=key)  # fmt: skip
    assert sum("val_loss" in m for m in got) == 2


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _torchrun(tmp_path, processes: int, config: TrainConfig) -> None:
    script = tmp_path / "tp_train.py"
    script.write_text(SCRIPT + QUIET_EXIT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--standalone"]
    done = subprocess.run([*command, str(script), json.dumps(config.to_dict())], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


def test_two_processes_splitting_heads_follow_one_process_across_a_resume(tmp_path):
    _torchrun(tmp_path, 2, tiny_config(tmp_path / "tp", tensor_parallel=2))
    single = train(tiny_config(tmp_path / "one"), progress=False)
    assert_follows(metrics(tmp_path / "tp" / "run"), metrics(single.run_dir))
    state = load_training_state(tmp_path / "tp" / "run" / "checkpoints" / "step-000006")
    assert state.config.tensor_parallel == 2 and state.world_size == 2


def test_mixture_of_head_split_over_two_processes_follows_one_process(tmp_path):
    """Its load-balance loss too: each rank's part reports its share, summed over the ranks
    (catches: the aux loss logged as one rank's part)."""
    moh = dict(attention="moh", attention_options={"shared_heads": 2}, max_steps=3)
    _torchrun(tmp_path, 2, tiny_config(tmp_path / "tp", tensor_parallel=2, **moh))
    single = train(tiny_config(tmp_path / "one", **moh), progress=False)
    got, want = metrics(tmp_path / "tp" / "run"), metrics(single.run_dir)
    assert [m["step"] for m in got] == [1, 2, 3] and want[0]["aux_loss"] > 0
    for key in ("train_loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([m[key] for m in got]), torch.tensor([m[key] for m in want]),
                                   rtol=1e-4, atol=1e-6, msg=key)  # fmt: skip


def test_a_split_run_resumes_in_one_process(tmp_path):
    """Its checkpoint holds the full model and AdamW state in the one-process layout."""
    _torchrun(tmp_path, 2, tiny_config(tmp_path / "tp", tensor_parallel=2, max_steps=3))
    train(tiny_config(tmp_path / "tp", tensor_parallel=1), resume=True, progress=False)  # steps 4..6, one process
    single = train(tiny_config(tmp_path / "one"), progress=False)
    assert_follows(metrics(tmp_path / "tp" / "run"), metrics(single.run_dir))


def test_dropout_draws_the_same_numbers_on_the_ranks_of_one_split_model(tmp_path):
    """catches: a dropout seeded per process, which drops other entries of the replicated residual
    stream on each rank (the checkpoint refuses replicated parameters that differ between ranks)."""
    _torchrun(tmp_path, 2, tiny_config(tmp_path / "tp", tensor_parallel=2, max_steps=3, dropout=0.2))
    assert load_training_state(tmp_path / "tp" / "run" / "checkpoints" / "step-000003").step == 3


@pytest.mark.slow
def test_two_by_two_tensor_and_data_parallel_follows_one_process(tmp_path):
    _torchrun(tmp_path, 4, tiny_config(tmp_path / "tpdp", tensor_parallel=2))
    single = train(tiny_config(tmp_path / "one"), progress=False)
    assert_follows(metrics(tmp_path / "tpdp" / "run"), metrics(single.run_dir))


def test_a_split_that_does_not_fit_is_refused_before_anything_is_written(tmp_path):
    config = tiny_config(tmp_path, tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel=2 must divide the number of processes, 1"):
        train(config, progress=False)
    assert not (tmp_path / "run").exists()
    gpt = GPTConfig.from_preset("tiny", attention="dcmha")
    with pytest.raises(ValueError, match="'dcmha' attention cannot be split by heads: "):
        check_split(gpt, 2, 2, False)
    with pytest.raises(ValueError, match="degree 8 needs the head count to divide: 'mha' attention has 4 heads"):
        check_split(GPTConfig.from_preset("tiny"), 8, 8, False)
    with pytest.raises(ValueError, match="does not go with shard"):
        check_split(GPTConfig.from_preset("tiny"), 4, 2, True)
