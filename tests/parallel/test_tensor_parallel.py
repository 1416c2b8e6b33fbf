"""multihead.parallel: two and four CPU processes (torchrun, gloo) equal one
process, for every kind that splits by heads; the refusals, in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.registry import attention_class, build_attention, list_attention_kinds
from multihead.parallel import rank_heads, tensor_parallel
from multihead.parallel.head_shards import shard_map

CHECKS = Path(__file__).with_name("tp_checks.py")


def _torchrun(processes: int, check: str, out: Path) -> list[str]:
    """The "ok" lines of every rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--standalone"]
    done = subprocess.run([*command, str(CHECKS), check, str(out)], env=env, capture_output=True, text=True, timeout=300)
    reports = {r: (out / f"rank{r}.txt").read_text() if (out / f"rank{r}.txt").exists() else "" for r in range(processes)}
    assert done.returncode == 0, f"{reports}\n{done.stdout[-2000:]}{done.stderr[-6000:]}"
    assert all(text.endswith("done\n") for text in reports.values()), reports
    return [line for text in reports.values() for line in text.splitlines()]


def test_two_ranks_equal_one_process_for_every_kind_that_splits(tmp_path):
    """Forward, every parameter's gradient and greedy generation (GPT), forward (BERT) in float64;
    the pretrained MiniLM's embeddings in float32; AdamW steps and reloads; with sequence
    parallelism, forward and gradients (decoding refused)."""
    passed = _torchrun(2, "kinds", tmp_path)
    for what in ("gpt mha", "gpt gqa", "gpt mqa", "gpt gated", "gpt collaborative", "gpt moh", "gpt output_gated",
                 "gpt mla", "bert", "minilm",
                 "state mha", "state moh", "sequence-parallel gpt gqa"):
        assert sum(line.startswith(f"ok {what}") for line in passed) == 2, (what, passed)


def test_four_ranks_replicate_key_value_heads_when_the_degree_exceeds_g(tmp_path):
    """GQA with G=2 and MQA on 4 ranks: each key/value head on 2 or 4 ranks, its gradient summed over them."""
    passed = _torchrun(4, "replicated", tmp_path)
    assert sum(line.startswith("ok gpt gqa") for line in passed) == 4
    assert sum(line.startswith("ok gpt mqa") for line in passed) == 4
    assert sum(line.startswith("ok state gqa") for line in passed) == 4


def test_rank_heads_are_contiguous_blocks_and_misfits_are_refused():
    assert rank_heads(8, 2, 4, "gqa") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_heads(8, 8, 2, "mha") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"degree 4 needs the head count to divide: 'mha' attention has 6 heads"):
        rank_heads(6, 6, 4, "mha")
    with pytest.raises(ValueError, match=r"degree 2 on 6 heads in 3 key/value groups"):
        rank_heads(6, 3, 2, "gqa")


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_each_kind_splits_or_gives_its_own_reason(kind):
    """Independent heads split, and Mixture-of-Head with its router whole; the others give their reason."""
    cls = attention_class(kind)
    layer = build_attention(kind, embed_dim=16, num_heads=4, **cls.comparison_options(kind, 4))
    try:
        plan = shard_map(layer, 2)
    except ValueError as e:
        assert not cls.independent_heads and kind != "moh"
        assert f"{kind!r} attention cannot be split by heads: {cls.head_independence}" in str(e)
        return
    assert cls.independent_heads or kind == "moh"
    assert plan.heads == [[0, 1], [2, 3]]
    for name, index in plan.index.items():  # every original element is held by some rank
        held = torch.cat([i.reshape(-1) for i in index]).unique()
        assert held.numel() == plan.shapes[name].numel(), name


@pytest.mark.parametrize("options", [dict(shared_heads=2, routed_heads=2), dict(shared_heads=1, routed_heads=2, num_kv_heads=2),
                                     dict(shared_heads=3, routed_heads=1)])  # fmt: skip
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_moh_parts_sum_to_the_layer_and_share_its_balance_loss(options, path):
    """Each part keeps the router whole and its heads' gates; the parts' outputs and aux losses sum to the layer's."""
    torch.manual_seed(0)
    m = build_attention("moh", embed_dim=32, num_heads=4, **options).double().train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    full, aux = m(x, is_causal=True, path=path), m.aux_loss()
    parts = [m.tensor_parallel_part(heads) for heads in ([0, 1], [2, 3])]
    bias = m.out_proj.bias
    outs = [part(x, is_causal=True, path=path) - bias for part in parts]  # each part's own heads, no bias
    torch.testing.assert_close(outs[0] + outs[1] + bias, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(parts[0].aux_loss() + parts[1].aux_loss(), aux, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="contiguous blocks of heads, got heads=\\[0, 2\\]"):
        m.tensor_parallel_part([0, 2])
    query_norm = build_attention("moh", embed_dim=32, num_heads=4, router="query_norm", shared_heads=1, routed_heads=2)
    with pytest.raises(ValueError, match="router='query_norm' cannot be split by heads"):
        query_norm.tensor_parallel_part([0, 1])


def test_tensor_parallel_checks_its_arguments():
    model = GPT(GPTConfig.from_preset("tiny", vocab_size=20, context_length=8, num_layers=1))
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"):
        tensor_parallel(model, "cuda")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        tensor_parallel(3, "cuda")
