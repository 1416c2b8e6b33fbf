"""The training state's checksums and counters: a flipped byte in the optimizer
moments or the RNG state is refused on resume, and a resumed run's counters
equal those of the run that was never interrupted."""

import pytest
import torch
from support.training import tiny_config

from multihead.io import read_safetensors_header
from multihead.train import latest_checkpoint, train
from multihead.train.checkpoint import STATE_NAME, load_training_state

TEXT = "".join(f"a line of text, number {i % 7}, for the tiny model.\n" for i in range(200))


def _flip_a_byte(path, tensor_name: str) -> None:
    """Change one byte in the middle of ``tensor_name``'s data, leaving the header as it was."""
    with open(path, "rb") as f:
        entry = read_safetensors_header(f, path).tensors[tensor_name]
    data = bytearray(path.read_bytes())
    data[(entry.start + entry.end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["optimizer", "rng"])
def test_a_flipped_byte_in_the_training_state_is_refused_on_resume(tmp_path, which):
    """catches: a state reader that skips the sha256 comparison of optimizer moments or RNG states."""
    config = tiny_config(tmp_path, TEXT, max_steps=2, warmup=1, checkpoint_every=2, eval_every=2)
    train(config, progress=False)
    state = latest_checkpoint(tmp_path / "run") / STATE_NAME
    with open(state, "rb") as f:
        names = sorted(read_safetensors_header(f, state).tensors)
    rng = [n for n in names if n.startswith("rng.")]
    name = rng[0] if which == "rng" else next(n for n in names if n not in rng and "exp_avg" in n)
    _flip_a_byte(state, name)
    with pytest.raises(ValueError, match=rf"is corrupt: the bytes of tensor '{name}' do not match"):
        load_training_state(state.parent)
    with pytest.raises(ValueError, match=rf"is corrupt: the bytes of tensor '{name}'"):
        train(tiny_config(tmp_path, TEXT, max_steps=4, warmup=1, checkpoint_every=2, eval_every=2),
              resume=True, progress=False)


def test_resumed_counters_equal_the_uninterrupted_runs(tmp_path):
    """catches: a resume that restarts tokens_seen (or the step) from 0 while weights and losses agree."""
    values = dict(max_steps=4, warmup=1, checkpoint_every=2, eval_every=2, grad_accum=2)
    train(tiny_config(tmp_path / "split", TEXT, **{**values, "max_steps": 2}), progress=False)
    train(tiny_config(tmp_path / "split", TEXT, **values), resume=True, progress=False)
    train(tiny_config(tmp_path / "straight", TEXT, **values), progress=False)
    split = load_training_state(latest_checkpoint(tmp_path / "split" / "run"))
    straight = load_training_state(latest_checkpoint(tmp_path / "straight" / "run"))
    assert split.step == straight.step == 4
    per_step = straight.config.batch_size * straight.config.context_length  # batch_size sequences per step
    assert split.tokens_seen == straight.tokens_seen == 4 * per_step
    assert split.world_size == straight.world_size == 1
    for key in straight.rng:
        assert torch.equal(split.rng[key], straight.rng[key]), key
