"""``multihead compare`` on a base model with local and global layers: each kind's plan
and compare.json give one sequence's KV-cache bytes at the context (a local layer's
cache holding its window), compare.md has a column of them; a base without local
layers has neither."""

from __future__ import annotations

import json
import random
from pathlib import Path

from multihead.cli import main
from multihead.models.gpt import GPT, GPTConfig
from multihead.train.compare_plan import plan_kind
from multihead.train.compare_report import markdown_table

W, T = 8, 32
LOCAL = [{"window": W}, {}]  # block 0 local, block 1 global
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()


def _config(layer_options=LOCAL) -> GPTConfig:
    return GPTConfig.from_preset("tiny", context_length=T, layer_attention_options=layer_options)


def held_bytes(config: GPTConfig, kv_heads: int) -> int:
    """Keys and values (2) x G x D x 4 bytes (float32) x the positions each block holds at
    the context: W in the local block, T in the global one."""
    D = config.embed_dim // config.num_heads
    return 2 * kv_heads * D * 4 * (W + T)


def test_the_plans_give_the_bytes_at_the_context_and_the_table_a_column():
    mha, mqa = plan_kind(_config(), "mha"), plan_kind(_config(), "mqa")
    assert mha.kv_cache_at_context == {"context": T, "bytes": held_bytes(_config(), 4)}
    assert mqa.kv_cache_at_context == {"context": T, "bytes": held_bytes(_config(), 1)}
    assert GPT(_config()).blocks[0].attn.sliding_window == W  # the plan's model is the base's
    rows = [{**vars(plan), "val_loss": [1.0], "val_loss_mean": 1.0, "val_loss_std": 0.0, "peak_memory_bytes": 2**20}
            for plan in (mha, mqa)]  # fmt: skip
    table = markdown_table(rows)
    header, rule, first = table.splitlines()[:3]
    assert f"KV bytes/token | KV bytes/sequence at context {T} (local layers: their window) | peak memory" in header
    assert header.count("|") == rule.count("|") == first.count("|")
    assert f"| {mha.kv_cache_bytes_per_token} | {held_bytes(_config(), 4)} | 1 MiB |" in first
    assert plan_kind(_config(None), "mha").kv_cache_at_context is None
    plain = markdown_table([{**rows[0], "kv_cache_at_context": None}])
    assert "at context" not in plain and "| KV bytes/token | peak memory |" in plain


def test_a_quick_comparison_of_a_local_global_model_reports_it(tmp_path, capsys):
    rng = random.Random(0)
    data: Path = tmp_path / "text.txt"
    data.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)) + "\n")
    out = tmp_path / "cmp"
    rc = main(["compare", "--quick", "--attention", "gqa", "--attention-option", "gqa:num_kv_heads=2",
               "--layer-attention-options", json.dumps(LOCAL), "--data", str(data), "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    row = json.loads((out / "compare.json").read_text())["kinds"]["gqa"]
    assert row["kv_cache_at_context"] == {"context": T, "bytes": held_bytes(_config(), 2)}
    table = (out / "compare.md").read_text()
    assert f"KV bytes/sequence at context {T}" in table and f"| {held_bytes(_config(), 2)} |" in table
