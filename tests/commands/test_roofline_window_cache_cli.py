"""``multihead roofline`` with local and global layers prints the bytes the caches of
``make_kv_caches`` hold after the decode step: a local block its last ``window`` positions."""

from __future__ import annotations

import json

import torch
from support.cli import quietly

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.machine_limits import device_name


def _limits(tmp_path, monkeypatch):
    """A cache holding this machine's entry, so nothing is measured."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    key = f"{device_name('cpu')} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    entry = {"device": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": "2026-01-01", "peak_flops": {"float32": 100e9}, "bandwidth": 20e9}  # fmt: skip
    (tmp_path / "cache" / "machine-limits.json").write_text(json.dumps({key: entry}))


def test_the_kv_cache_line_is_what_the_caches_hold(tmp_path, monkeypatch):
    _limits(tmp_path, monkeypatch)
    rc, printed, err = quietly("roofline", "--preset", "tiny", "--context", "32", "--batch", "2", "--device", "cpu",
                               "--layer-attention-options", '[{"window": 8}, {}]', "--positions", "rope",
                               "--out", str(tmp_path / "roof"))  # fmt: skip
    assert rc == 0, err
    config = GPTConfig.from_preset("tiny", layer_attention_options=[{"window": 8}, {}], positions="rope")
    model = GPT(config).eval()
    caches = model.make_kv_caches(2, 33)
    idx = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(idx[:, :32], kv_caches=caches)
        model(idx[:, 32:], kv_caches=caches)
    held = [sum(t.untyped_storage().nbytes() for t in (c.k, c.v)) for c in caches]
    assert held == [2 * 8 * 512, 2 * 33 * 512]  # (B, positions, 2 C x 4 bytes): the local block its window
    assert (f"KV cache: 1,024 bytes per token of one sequence (float32, all 2 layers); {sum(held):,} bytes for 2 "
            "sequence(s) at 33 positions after the decode step (local blocks hold their last 8 positions)") in printed
    assert f"| 512 | {held[0] / 1e6:.3g} |" in printed and f"| 512 | {held[1] / 1e6:.3g} |" in printed
    record = json.loads((tmp_path / "roof" / "roofline.json").read_text())
    assert record["phases"]["decode"]["kv_cache_bytes"] == sum(held)
    assert [b["kv_cache_positions"] for b in record["phases"]["decode"]["blocks"]] == [8, 33]
