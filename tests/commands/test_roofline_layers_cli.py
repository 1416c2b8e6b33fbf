"""``multihead roofline --layer-attention-options JSON --positions P`` and ``--checkpoint PATH``:
the model the user describes is the one counted, block by block; mistakes are one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.machine_limits import device_name
from multihead.tools.roofline import phase_costs

LOCAL_GLOBAL = '[{"window": 8}, {}]'


@pytest.fixture
def limits(tmp_path, monkeypatch):
    """A cache holding this machine's entry, so nothing is measured."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    key = f"{device_name('cpu')} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    entry = {"device": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": "2026-01-01", "peak_flops": {"float32": 100e9}, "bandwidth": 20e9}  # fmt: skip
    (tmp_path / "cache" / "machine-limits.json").write_text(json.dumps({key: entry}))


def _phases(record: dict) -> dict:
    return {name: (phase["flops"], phase["bytes"]) for name, phase in record["phases"].items()}


def _expected(config: GPTConfig, context: int) -> dict:
    costs = phase_costs(config, context=context, bytes_per_element=4)
    return {name: (c.flops, c.bytes) for name, c in costs.items()}


def test_layer_options_and_positions_count_the_model_they_describe(tmp_path, limits):
    out = tmp_path / "roof"
    rc, printed, err = quietly("roofline", "--preset", "tiny", "--context", "32", "--device", "cpu",
                               "--layer-attention-options", LOCAL_GLOBAL, "--positions", "rope", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    config = GPTConfig.from_preset("tiny", layer_attention_options=[{"window": 8}, {}], positions="rope")
    record = json.loads((out / "roofline.json").read_text())
    assert GPTConfig.from_dict(record["config"]) == config
    assert _phases(record) == _expected(config, 32)
    assert [b["window"] for b in record["phases"]["decode"]["blocks"]] == [8, None]
    # the blocks' own lines: the local block reads 7 cached positions, the global one 32 (x 512 bytes)
    assert "| 1: 0 | 4 / 4 | 8 | " in printed and f"| {7 * 512 / 1e6:.3g} | 512 |" in printed
    assert "| 1: 1 | 4 / 4 | global | " in printed and f"| {32 * 512 / 1e6:.3g} | 512 |" in printed
    # without the flags: one kind of block, no block table, and other counts
    rc, plain, err = quietly("roofline", "--preset", "tiny", "--context", "32", "--device", "cpu")
    assert rc == 0 and "| blocks |" not in plain and "| blocks |" in printed


def test_a_checkpoints_config_is_counted(tmp_path, limits):
    config = GPTConfig.from_preset("tiny", context_length=64, layer_attention_options=[{"window": 4}, {}],
                                   layer_heads=[4, 2], positions="alibi")  # fmt: skip
    save_checkpoint(GPT(config), tmp_path / "ckpt")
    out = tmp_path / "roof"
    rc, printed, err = quietly("roofline", "--checkpoint", str(tmp_path / "ckpt"), "--context", "16", "--device",
                               "cpu", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    record = json.loads((out / "roofline.json").read_text())
    assert GPTConfig.from_dict(record["config"]) == config
    assert _phases(record) == _expected(config, 16)
    assert (f"checkpoint {tmp_path / 'ckpt'}, mha, per layer [{{'window': 4}}, {{}}], heads per layer [4, 2], "
            "positions alibi: batch 1, context 16") in printed
    assert "| 1: 1 | 2 / 2 | global |" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "CKPT", "--preset", "tiny"], "brings its own model; --preset cannot be given with it"),
        (["--checkpoint", "CKPT", "--positions", "rope", "--attention", "mha"],
         "brings its own model; --attention, --positions cannot be given"),
        (["--checkpoint", "MISSING"], "no checkpoint config at"),
        (["--preset", "tiny", "--positions", "sinusoid"], "positions must be one of"),
        (["--preset", "tiny", "--layer-attention-options", '[{"window": 0}, {}]'], r"block 0 .*window must be an int >= 1"),
        (["--preset", "tiny", "--layer-attention-options", "[{}, {}, {}]"], "holds 3 dicts; give 1 .. num_layers=2"),
        (["--preset", "tiny", "--layer-attention-options", "{window: 4}"], "is not JSON"),
        (["--checkpoint", "CKPT", "--context", "64"], "the decode step needs 65 positions, more than the model's"),
    ],
)
def test_mistakes_are_one_line(tmp_path, limits, argv, message):
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=64)), tmp_path / "ckpt")
    argv = [{"CKPT": str(tmp_path / "ckpt"), "MISSING": str(tmp_path / "none")}.get(a, a) for a in argv]
    rc, out, err = quietly("roofline", *argv)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
