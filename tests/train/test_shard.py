"""``TrainConfig.shard``: two FSDP2 processes (torchrun, gloo) follow the
one-process run with the same global batch, and their checkpoints are the
unsharded format, so runs resume across DDP, FSDP2 and one process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from support.torchrun import QUIET_EXIT
from support.training import assert_follows, assert_heads_follow
from support.training import tiny_config as support_tiny_config

from multihead.models.checkpoint import load_checkpoint
from multihead.train import TrainConfig, load_training_state, train
from multihead.train.config import RESUMABLE_CHANGES, config_differences

TEXT = "".join(f"now is the winter of our discontent, act {i % 5}, made glorious summer.\n" for i in range(300))


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    # lr == min_lr after a one-step warm-up: a constant rate, so a run stopped
    # at step 3 and extended to 6 follows the 6-step run
    values = dict(
        batch_size=8, grad_accum=2, max_steps=6, lr=3e-3, min_lr=3e-3,
        warmup=1, eval_every=3, log_every=1, checkpoint_every=3,
    )  # fmt: skip
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


# Each rank runs the phases [(config values, resume), ...] in one process
# group it owns (train() leaves a group it did not create alone).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from multihead.train import TrainConfig, train
    dist.init_process_group("gloo")
    for values, resume in json.loads(sys.argv[1]):
        train(TrainConfig.from_dict(values), resume=resume, progress=False)
    dist.destroy_process_group()
    """
)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close(got, want, where, **tolerance):
    torch.testing.assert_close(got, want, msg=lambda message: f"{where}: {message}", **tolerance)


def state_tensors(directory):
    with safe_open(str(directory / "state.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_fsdp2_processes_follow_one_process_and_resume_across_modes(tmp_path):
    # grad_accum 2: each rank's 4 rows in two micro-batches of 2, gradients
    # reduce-scattered after the second only (set_requires_gradient_sync)
    sharded = tiny_config(tmp_path / "fsdp", shard=True, track_heads=True).to_dict()
    ddp_then_sharded = tiny_config(tmp_path / "mixed").to_dict()
    sharded_then_one = tiny_config(tmp_path / "back", shard=True).to_dict()
    phases = [
        ({**sharded, "max_steps": 3}, False),
        (sharded, True),  # FSDP2 -> FSDP2
        ({**ddp_then_sharded, "max_steps": 3}, False),
        ({**ddp_then_sharded, "shard": True}, True),  # DDP -> FSDP2
        ({**sharded_then_one, "max_steps": 3}, False),  # resumed below in one process
    ]
    script = tmp_path / "fsdp_train.py"
    script.write_text(SCRIPT + QUIET_EXIT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    done = subprocess.run(
        [*command, str(script), json.dumps(phases)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]

    single = train(tiny_config(tmp_path / "one", track_heads=True), progress=False)
    # FSDP2 on 2 processes -> one plain process, shard switched off
    back = train(TrainConfig.from_dict({**sharded_then_one, "shard": False}), resume=True, progress=False)
    want = metrics(single.run_dir)
    trained = dict(single.model.named_parameters())
    # Weights against one process: AdamW divides each gradient by its running
    # RMS, so an element whose gradient is nearly 0 (cancellation) turns the
    # float32 rounding of a different sum into a difference of a small
    # fraction of lr per step; measured here 1.6e-5 (one element of 16,384 in
    # blocks.0.mlp.fc.weight) for DDP and FSDP2 alike. Allowed: lr / 100.
    atol = sharded["lr"] / 100
    for run in ("fsdp", "mixed", "back"):
        run_dir = tmp_path / run / "run"
        assert_follows(metrics(run_dir), want)
        if run == "fsdp":  # --track-heads under FSDP2: every rank runs the scoring forward
            assert_heads_follow(metrics(run_dir), want)
        model = load_checkpoint(run_dir / "checkpoints" / "step-000006")  # what generate --checkpoint loads
        for name, p in model.named_parameters():
            assert_close(p, trained[name], f"{run}: {name}", atol=atol, rtol=1.3e-6)
    for name, p in back.model.named_parameters():
        assert_close(p, trained[name], f"returned model: {name}", atol=atol, rtol=1.3e-6)

    # The sharded run's checkpoint is the unsharded format: optimizer tensors
    # by parameter index, the same names and groups as one process writes ...
    got_dir, want_dir = (tmp_path / run / "run" / "checkpoints" / "step-000006" for run in ("fsdp", "one"))
    got, want = load_training_state(got_dir), load_training_state(want_dir)
    assert got.world_size == 2 and set(got.rng) == {"cpu.0", "cpu.1"} and got.config.shard
    assert got.optimizer["param_groups"] == want.optimizer["param_groups"]
    optim = sorted(k for k in state_tensors(want_dir) if k.startswith("optim."))
    assert sorted(k for k in state_tensors(got_dir) if k.startswith("optim.")) == optim
    # ... and after 3 steps on 2 processes, FSDP2 and DDP hold the same weights
    # and optimizer tensors, index by index, to float32 rounding (scaled by
    # each tensor's magnitude: exp_avg_sq is ~1e-6)
    fsdp_dir, ddp_dir = (tmp_path / run / "run" / "checkpoints" / "step-000003" for run in ("fsdp", "mixed"))
    got_tensors, want_tensors = state_tensors(fsdp_dir), state_tensors(ddp_dir)
    assert sorted(got_tensors) == sorted(want_tensors)
    for key in optim:
        scale = float(want_tensors[key].abs().max()) or 1.0
        assert_close(got_tensors[key], want_tensors[key], key, atol=1e-5 * scale, rtol=1.3e-6)
    ddp_weights = dict(load_checkpoint(ddp_dir).named_parameters())
    for name, p in load_checkpoint(fsdp_dir).named_parameters():
        assert_close(p, ddp_weights[name], f"step 3, FSDP2 vs DDP: {name}")


def test_shard_is_a_bool_and_a_resumable_change(tmp_path):
    with pytest.raises(TypeError, match=r"shard must be a bool, got shard='yes'"):
        TrainConfig(shard="yes")
    with pytest.raises(TypeError, match=r"shard=1 \(int\)"):
        TrainConfig(shard=1)
    assert "shard" in RESUMABLE_CHANGES
    assert config_differences(TrainConfig(), TrainConfig(shard=True)) == {}
    assert TrainConfig.from_dict(TrainConfig(shard=True).to_dict()).shard is True


@pytest.fixture
def one_process_group():
    """A gloo group of one process (fully_shard then shards over 1 rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_optimizer_state_round_trips_through_parameter_names(one_process_group):
    from multihead.models.gpt import GPT, GPTConfig
    from multihead.train.shard import full_optimizer_state, load_full_optimizer_state, parameter_names, shard_model
    from multihead.train.steps import parameter_groups

    def model_and_optimizer():
        torch.manual_seed(0)
        model = shard_model(GPT(GPTConfig.from_preset("tiny", vocab_size=64, context_length=8)), torch.device("cpu"), 1)
        return model, torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3)

    model, optimizer = model_and_optimizer()
    names = parameter_names(model, optimizer)
    assert "token_embedding.weight" in names and "lm_head.weight" not in names  # tied: its first name, once
    model(torch.randint(0, 64, (2, 8))).float().square().mean().backward()
    optimizer.step()
    saved = full_optimizer_state(model, optimizer)
    # the index form of optimizer.state_dict(): same indices and groups, full tensors
    local = optimizer.state_dict()
    assert saved["param_groups"] == local["param_groups"]
    assert sorted(saved["state"]) == sorted(local["state"]) == list(range(len(names)))
    for i, entries in local["state"].items():
        for key, value in entries.items():
            # the same tensors copied out of their 1-rank DTensors: bitwise
            want = value.full_tensor() if hasattr(value, "full_tensor") else value
            assert torch.equal(saved["state"][i][key], want), (i, key)

    fresh, fresh_optimizer = model_and_optimizer()
    load_full_optimizer_state(fresh, fresh_optimizer, saved)
    assert full_optimizer_state(fresh, fresh_optimizer)["state"].keys() == saved["state"].keys()
    for i, entries in full_optimizer_state(fresh, fresh_optimizer)["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, saved["state"][i][key]), (i, key)  # loaded as saved: bitwise

    bad = {"state": {len(names): saved["state"][0]}, "param_groups": saved["param_groups"]}
    with pytest.raises(ValueError, match=rf"parameter\(s\) \[{len(names)}\], the optimizer has {len(names)}"):
        load_full_optimizer_state(fresh, fresh_optimizer, bad)
    with pytest.raises(ValueError, match=r"the optimizer state has 1 parameter group\(s\), the optimizer 2"):
        load_full_optimizer_state(fresh, fresh_optimizer, {**saved, "param_groups": saved["param_groups"][:1]})
    swapped = [saved["param_groups"][1], saved["param_groups"][0]]
    first = len(saved["param_groups"][0]["params"])  # the decayed matrices
    with pytest.raises(ValueError, match=rf"optimizer parameter group 0 holds indices \[{first}, "):
        load_full_optimizer_state(fresh, fresh_optimizer, {**saved, "param_groups": swapped})
