"""``multihead prune`` and ``multihead convert`` on a checkpoint with local and global
layers: the report (printed and report.json) also gives one sequence's KV-cache bytes
at the model's context, each local layer holding its window; a model without local
layers gets no such row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

CONTEXT, WINDOW = 32, 8
LABEL = f"KV cache (bytes/sequence at context {CONTEXT})"


def _checkpoint(folder: Path, layer_options) -> Path:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, context_length=CONTEXT, embed_dim=32, num_layers=3, num_heads=4,
                       layer_attention_options=layer_options)  # fmt: skip
    path = folder / "ckpt"
    save_checkpoint(GPT(config), path)
    return path


@pytest.fixture(scope="module")
def local_global(tmp_path_factory) -> Path:
    """Blocks 0 and 2 local (window 8), block 1 global."""
    return _checkpoint(tmp_path_factory.mktemp("local"), [{"window": WINDOW}, {}])


def held_bytes(model: GPT) -> int:
    """Keys and values (2) x G heads x D x 4 bytes (float32) x the positions each block's
    cache holds at the context: its window for a local block, all of them for a global one."""
    D = model.config.embed_dim // model.config.num_heads
    total = 0
    for block in model.blocks:
        positions = CONTEXT if block.attn.sliding_window is None else min(CONTEXT, block.attn.sliding_window)
        total += 2 * block.attn.num_kv_heads * D * 4 * positions
    return total


def _row(stdout: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if LABEL in line)
    return line.replace(LABEL, "").split()


def test_prune_reports_the_cache_at_the_context(local_global, tmp_path):
    out = tmp_path / "pruned"
    rc, stdout, err = quietly("prune", "--checkpoint", str(local_global), "--method", "gradient", "--keep", "0.5",
                              "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    before, after = held_bytes(load_checkpoint(local_global)), held_bytes(load_checkpoint(out))
    assert after < before
    assert report["kv_cache_at_context"] == {"context": CONTEXT, "bytes": [before, after]}
    assert _row(stdout) == [str(before), str(after)] and "a local layer's holding its window" in stdout
    assert before < report["kv_cache_bytes_per_token"][0] * CONTEXT  # the windows matter


def test_convert_reports_the_cache_at_the_context(local_global, tmp_path):
    out = tmp_path / "gqa"
    rc, stdout, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "2", "--method", "mean", "--checkpoint",
                              str(local_global), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    converted = load_checkpoint(out)
    assert [b.attn.sliding_window for b in converted.blocks] == [WINDOW, None, WINDOW]
    before, after = held_bytes(load_checkpoint(local_global)), held_bytes(converted)
    assert report["kv_cache_at_context"] == {"context": CONTEXT, "bytes": [before, after]} and after * 2 == before
    assert _row(stdout) == [str(before), str(after)]


def test_a_model_without_local_layers_has_no_context_row(tmp_path):
    plain = _checkpoint(tmp_path, None)
    out = tmp_path / "gqa"
    rc, stdout, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "2", "--method", "mean", "--checkpoint",
                              str(plain), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert json.loads((out / "report.json").read_text())["kv_cache_at_context"] is None
    assert "at context" not in stdout and "KV cache (bytes/token" in stdout
