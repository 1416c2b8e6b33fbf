"""A training state that is damaged or hand-edited is refused with the reason, field by field
(each case rewrites one entry of a real ``state.safetensors`` header)."""

from __future__ import annotations

import json

import pytest
import torch
from support.training import tiny_config

from multihead.io import read_safetensors_header, read_tensors, save_safetensors
from multihead.train import latest_checkpoint, train
from multihead.train.checkpoint import STATE_NAME, check_optimizer_shapes, load_training_state

TEXT = "".join(f"a line of text, number {i % 7}, for the tiny model.\n" for i in range(200))


@pytest.fixture(scope="module")
def state_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    train(tiny_config(tmp, TEXT, max_steps=1, warmup=0, checkpoint_every=1, eval_every=1), progress=False)
    return latest_checkpoint(tmp / "run") / STATE_NAME


def _rewrite(state_file, tmp_path, edit_metadata=None, edit_document=None):
    """A copy of the state with its header metadata or its state document edited."""
    with open(state_file, "rb") as f:
        header = read_safetensors_header(f, state_file)
        tensors = read_tensors(f, header)
    metadata = dict(header.metadata)
    document = json.loads(metadata["state"])
    if edit_document is not None:
        edit_document(document)
    metadata["state"] = json.dumps(document)
    if edit_metadata is not None:
        edit_metadata(metadata)
    out = tmp_path / "step-000001"
    out.mkdir(exist_ok=True)
    save_safetensors(tensors, out / STATE_NAME, metadata)
    return out


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize(
    "metadata, document, message",
    [
        (_set("format", "other"), None, "is not a training state"),
        (_set("version", "999"), None, "is not a training state"),
        (None, lambda d: d["sha256"].popitem(), "the sha256 entry does not list exactly the tensors"),
        (None, _set("sha256", []), "the sha256 entry does not list exactly the tensors"),
        (None, _set("step", -1), "step must be a non-negative int, got -1"),
        (None, _set("step", True), "step must be a non-negative int, got True"),
        (None, _set("tokens_seen", "5"), "tokens_seen must be a non-negative int, got '5'"),
        (None, _set("world_size", 1.5), "world_size must be a non-negative int, got 1.5"),
        (None, _set("elapsed_s", "1"), "elapsed_s must be a number, got '1'"),
        (None, _set("elapsed_s", True), "elapsed_s must be a number, got True"),
        (None, lambda d: d["optimizer"].__setitem__("param_groups", {}), "param_groups are not a list of groups"),
        (None, lambda d: d["optimizer"]["param_groups"][0].__setitem__("params", 3), "param_groups are not a list"),
        (None, lambda d: d["optimizer"].__setitem__("scalars", {"x": {}}), "non-integer parameter index 'x'"),
    ],
)
def test_a_damaged_field_is_refused_with_its_reason(state_file, tmp_path, metadata, document, message):
    """catches: a validation of the state header that lets the damaged field through."""
    with pytest.raises(ValueError, match=message):
        load_training_state(_rewrite(state_file, tmp_path, metadata, document))


def test_the_optimizer_hyperparameters_come_back_as_tuples(state_file):
    """catches: betas restored as a list (only the params lists stay lists)."""
    groups = load_training_state(state_file.parent).optimizer["param_groups"]
    assert all(isinstance(g["betas"], tuple) and isinstance(g["params"], list) for g in groups)


def test_a_one_dimensional_moment_of_another_shape_is_refused_by_name():
    """catches: the shape check skipping 1-D tensors (a bias's moments)."""
    params = [torch.zeros(4, 3), torch.zeros(3)]
    state = {"state": {1: {"exp_avg": torch.zeros(5), "step": torch.tensor(2.0)}}}
    with pytest.raises(ValueError, match=r"optim.1.exp_avg has shape \(5,\), parameter 1 has \(3,\)"):
        check_optimizer_shapes(state, params, "ckpt")
    check_optimizer_shapes({"state": {1: {"exp_avg": torch.zeros(3), "step": torch.tensor(2.0)}}}, params, "ckpt")


def test_zero_counters_are_valid(state_file, tmp_path):
    """catches: refusing 0 (non-negative means 0 is allowed)."""
    state = load_training_state(_rewrite(state_file, tmp_path, None, _set("tokens_seen", 0)))
    assert state.tokens_seen == 0
