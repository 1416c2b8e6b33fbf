"""One KV-cache number everywhere: bytes per token over all layers at the model's dtype, with the
element type named; checked against the bytes of real cache tensors, and printed alike by
``multihead convert`` and ``multihead prune`` for the same model."""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.flops import KVCacheSize, kv_cache_size
from multihead.tools.prune import prune_heads

MAX_LEN = 8


def cache_bytes_per_token(model: GPT, dtype: torch.dtype | None = None) -> int:
    """Bytes of the caches the layers allocate, over all layers, per token (an independent count)."""
    total = 0
    for block in model.blocks:
        cache = block.attn.make_kv_cache(1, MAX_LEN, dtype=dtype)
        total += cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
    return total // MAX_LEN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_are_the_allocated_caches(dtype):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="gqa", num_kv_heads=2)).to(dtype)
    got = kv_cache_size(model)
    assert got == KVCacheSize(cache_bytes_per_token(model), str(dtype).removeprefix("torch."))
    assert str(got) == f"{got.bytes_per_token} bytes/token ({got.dtype})"
    assert kv_cache_size(model, torch.float16).bytes_per_token == cache_bytes_per_token(model, torch.float16)
    pruned = prune_heads(GPT(GPTConfig.from_preset("tiny")), {0: [0, 1, 2]})  # layers of 1 and 4 heads
    assert kv_cache_size(pruned).bytes_per_token == cache_bytes_per_token(pruned)
    with pytest.raises(ValueError, match="holds no multihead attention layer"):
        kv_cache_size(torch.nn.Linear(2, 2))


def test_convert_and_prune_print_the_same_number(tmp_path):
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    model = GPT(GPTConfig.from_preset("tiny", context_length=32))
    save_checkpoint(model, plain)
    want = cache_bytes_per_token(model)
    rows = []
    for argv, out in ((["convert", "--to", "mqa"], tmp_path / "c"),
                      (["prune", "--method", "gradient", "--keep", "0.5", "--calibration-lines", "16"], tmp_path / "p")):  # fmt: skip
        rc, stdout, err = quietly(*argv, "--checkpoint", str(plain), "--out", str(out))
        assert rc == 0, err
        row = next(line for line in stdout.splitlines() if "KV cache (bytes/token, float32)" in line)
        rows.append(int(row.split()[-2]))
        report = json.loads((out / "report.json").read_text())
        assert report["kv_cache_bytes_per_token"][0] == want and report["kv_cache_dtype"] == "float32"
    assert rows == [want, want]
